"""The queries model code makes, timed in one quiet process: parallelctx beside Megatron-core.

    python -m benchmarks.queries [--calls 1000000] [--rounds 7] [--write-results]

A query's cost does not depend on the world size, so this launches a world of one (gloo) and
calls each query written out as model code writes it (``gpc.get_local_rank(ParallelMode.TENSOR)``,
not with the mode bound beforehand) ``--calls`` times per round; the libraries take turns every
round and the table gives the best round, in ns per call, and the ratio to Megatron-core's getter.
It avoids the torchrun jobs of ``benchmarks.run``, whose other ranks load the machine while rank 0
times its queries. ``--write-results`` writes a labelled section of benchmarks/RESULTS.md.
Goal (issue 8): the whole expression at most 100 ns.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit
from pathlib import Path

from . import sections

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"

PARALLELCTX = {
    "gpc.tensor.rank": "gpc.tensor.rank",
    "gpc.get_local_rank(ParallelMode.TENSOR)": "gpc.get_local_rank(ParallelMode.TENSOR)",
    "gpc.get_local_rank(mode=ParallelMode.TENSOR)": "gpc.get_local_rank(mode=ParallelMode.TENSOR)",
    "gpc.get_world_size(ParallelMode.TENSOR)": "gpc.get_world_size(ParallelMode.TENSOR)",
    "gpc.get_group(ParallelMode.TENSOR)": "gpc.get_group(ParallelMode.TENSOR)",
}
MEGATRON = {
    "ps.get_tensor_model_parallel_rank()": "ps.get_tensor_model_parallel_rank()",
    "ps.get_tensor_model_parallel_world_size()": "ps.get_tensor_model_parallel_world_size()",
    "ps.get_tensor_model_parallel_group()": "ps.get_tensor_model_parallel_group()",
}


def measure(calls: int, rounds: int) -> dict[str, float]:
    """Launch a world of one, set up Megatron-core's state on it, and time every query.

    Returns:
        ``{query: best ns per call}``.

    Raises:
        ImportError: megatron-core is not installed (``pip install 'parallelctx[megatron]'``).
    """
    import warnings

    import torch.distributed as dist

    import parallelctx
    from parallelctx import ParallelMode, gpc

    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps

    parallelctx.launch({"dist": {"backend": "gloo"}})
    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    try:
        names = {"gpc": gpc, "ParallelMode": ParallelMode, "ps": ps}
        queries = {**PARALLELCTX, **MEGATRON}
        best = {name: float("inf") for name in queries}
        for _ in range(rounds):
            for name, stmt in queries.items():
                seconds = timeit.timeit(stmt, globals=names, number=calls)
                best[name] = min(best[name], seconds / calls * 1e9)
        return best
    finally:
        ps.destroy_model_parallel()
        gpc.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


def table(best: dict[str, float]) -> str:
    """Markdown table: ns per call and the ratio to Megatron-core's rank getter."""
    base = best["ps.get_tensor_model_parallel_rank()"]
    lines = [
        "| library | query, as model code writes it | ns per call | ÷ Megatron's rank getter |",
        "|---|---|---:|---:|",
    ]
    for name, ns in best.items():
        lib = "parallelctx" if name in PARALLELCTX else "Megatron-core"
        lines.append(f"| {lib} | `{name}` | {ns:.1f} | {ns / base:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print, optionally write RESULTS.md; return 0."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    text = table(measure(args.calls, args.rounds))
    print(text)
    if args.write_results:
        sections.write_section(
            RESULTS,
            "queries",
            "## Queries as model code writes them, one quiet process (issue 8)\n\n"
            f"Written by `python -m benchmarks.queries --calls {args.calls} --rounds {args.rounds} "
            f"--write-results`: best of {args.rounds} rounds, Python {sys.version.split()[0]}; load "
            f"average {load[0]:.1f} before the run. Goal: `gpc.get_local_rank(ParallelMode.TENSOR)` "
            "at most 100 ns; `gpc.tensor.rank` the fastest path.\n\n" + text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
