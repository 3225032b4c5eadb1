"""A local world against real ranks: the tensor-parallel MLP check of examples/tp_mlp (forward,
backward and dropout against the serial model) as 64 and 8 threads of one process
(``parallelctx.run_local``) and as 8 real processes under torchrun, side by side.

    python -m benchmarks.local_world [--rounds 3] [--write-results]

Each run is a fresh command, timed from its start to its exit (interpreters and imports
included, as a user waits for them) and, inside, from the first rank's launch to the last rank's
end; peak memory is the sum over the command's processes of each one's peak resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import sections

ROOT = Path(__file__).resolve().parent.parent
RUNS = [("local", 64, 8), ("local", 8, 8), ("torchrun", 8, 8)]  # (how, ranks, tensor)


def _check() -> None:
    sys.path.insert(0, str(ROOT / "examples" / "tp_mlp"))
    from test_tp_mlp import _check_against_the_serial_model

    _check_against_the_serial_model()


def worker(how: str, world: int, tensor: int, out: str) -> None:
    """Be one run (``local``) or one rank (``torchrun``); write the timing and peak memory."""
    import parallelctx

    begin = time.perf_counter()
    if how == "local":
        parallelctx.run_local(_check, world, dict(parallel=dict(tensor=tensor)))
        rank = 0
    else:
        parallelctx.launch_from_torch(config=dict(parallel=dict(tensor=tensor)))
        _check()
        rank = parallelctx.gpc.get_global_rank()
        parallelctx.gpc.destroy()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    Path(out, f"rank-{rank}.json").write_text(
        json.dumps({"work_s": time.perf_counter() - begin, "peak_kib": peak})
    )


def one(how: str, world: int, tensor: int) -> dict[str, float]:
    """One fresh command; returns its wall time, the ranks' work time and the summed peak memory."""
    with tempfile.TemporaryDirectory() as out:
        me = [sys.executable, "-m", "benchmarks.local_world", "--worker", how, str(world), str(tensor), out]
        if how == "torchrun":
            me = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(world),
                "-m",
                *me[2:],
            ]
        begin = time.perf_counter()
        proc = subprocess.run(
            me,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        wall = time.perf_counter() - begin
        if proc.returncode != 0:
            raise RuntimeError(f"{how} {world} failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(p.read_text()) for p in Path(out).glob("rank-*.json")]
    return {
        "wall_s": wall,
        "work_s": max(r["work_s"] for r in rows),
        "peak_mib": sum(r["peak_kib"] for r in rows) / 1024,
    }


def run(rounds: int) -> list[dict[str, Any]]:
    """Every run of :data:`RUNS`, ``rounds`` times in turn; the median of each."""
    found: dict[tuple[str, int, int], list[dict[str, float]]] = {key: [] for key in RUNS}
    for _ in range(rounds):
        for key in RUNS:
            found[key].append(one(*key))
    out = []
    for (how, world, tensor), got in found.items():
        med = {k: statistics.median(g[k] for g in got) for k in got[0]}
        out.append(
            {
                "how": how,
                "world": world,
                "tensor": tensor,
                "processes": world if how == "torchrun" else 1,
                **med,
            }
        )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, with ratios to 8 real ranks."""
    real = next(r for r in rows if r["how"] == "torchrun")
    lines = [
        "| run | ranks | processes | command wall | ranks' work | peak memory, all processes | wall ÷ 8 real | memory ÷ 8 real |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        name = "run_local (threads)" if r["how"] == "local" else "torchrun (processes)"
        lines.append(
            f"| {name}, tensor {r['tensor']} | {r['world']} | {r['processes']} | {r['wall_s']:.2f} s | "
            f"{r['work_s']:.2f} s | {r['peak_mib']:.0f} MiB | {r['wall_s'] / real['wall_s']:.2f} | "
            f"{r['peak_mib'] / real['peak_mib']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; run (or, with ``--worker``, be one run); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        how, world, tensor, out = args.worker
        worker(how, int(world), int(tensor), out)
        return 0
    rows = run(args.rounds)
    body = table(rows)
    print(body)
    if args.write_results:
        sections.write_run(
            ROOT / "benchmarks" / "RESULTS.md",
            "local_world",
            "A local world against real ranks (issue 36)",
            f"python -m benchmarks.local_world {' '.join(argv if argv is not None else sys.argv[1:])}",
            "The tensor-parallel MLP check of examples/tp_mlp (forward, backward, dropout, against the "
            "serial model); median of the rounds. Command wall: from the command's start to its exit. "
            "Ranks' work: from the launch to the end of the check (the slowest rank).",
            body,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
