"""torchtitan's meshes through parallelctx against torchtitan's own ``build_mesh``, same run.

    python -m benchmarks.torchtitan_bridge [--repeats 3] [--world 8]

One torchrun job of ``--world`` ranks runs this module with ``--worker``: for each layout of
:data:`LAYOUTS` it alternates, ``--repeats`` rounds after a warm-up,

* **bridge**: ``launch_from_torch`` (parallelctx's groups) + ``parallelctx.torchtitan.parallel_dims()``;
* **torchtitan**: ``init_process_group`` + ``ParallelDims(...).build_mesh()`` (device type
  ``cpu``, torch's ``fake`` backend registered, as torchtitan needs on a machine without GPU),

each torn down before the next (``gpc.destroy()``; ``destroy_process_group()``). Both run with
``TORCH_GLOO_LAZY_INIT=1`` (gloo groups connect on first use, as NCCL's do), so the time *to a
first collective* over every enabled 1-d mesh (``get_all_one_dimensional_meshes()``) is reported
too. Real (non-fake) ``new_group``/``split_group`` calls and the real groups a rank joins are
counted. Each rank writes its records; the parent takes the max over ranks per round and the
median over rounds, prints a table and writes it as a labelled section of ``--results`` (default
benchmarks/RESULTS.md). Timings never decide a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import sections
from .run import run_command

HERE = Path(__file__).resolve().parent

# (dp_replicate, dp_shard, cp, tp, pp, ep) on 8 ranks
LAYOUTS: list[tuple[int, int, int, int, int, int]] = [
    (2, 4, 1, 1, 1, 1),
    (2, 2, 1, 2, 1, 1),
    (1, 2, 2, 2, 1, 1),
    (2, 2, 1, 1, 2, 1),
    (2, 2, 1, 2, 1, 4),
]


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count real process-group creations in the block: ``calls`` (new_group/split_group calls
    that are not of the fake backend) and ``joined`` (real groups this rank became a member of)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    counts = {"calls": 0, "joined": 0}
    new_group_with_tag: Callable[..., Any] = c10d._new_group_with_tag
    split_group: Callable[..., Any] = c10d.split_group
    before = set(c10d._world.pg_map)

    def counted_new(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is None or str(backend).lower() != "fake":
            counts["calls"] += 1
        return new_group_with_tag(*args, **kwargs)

    def counted_split(*args: Any, **kwargs: Any) -> Any:
        counts["calls"] += 1
        return split_group(*args, **kwargs)

    c10d._new_group_with_tag = counted_new  # type: ignore[assignment]
    c10d.split_group = counted_split  # type: ignore[assignment]
    try:
        yield counts
    finally:
        c10d._new_group_with_tag = new_group_with_tag  # type: ignore[assignment]
        c10d.split_group = split_group  # type: ignore[assignment]
        made = [pg for pg in c10d._world.pg_map if pg not in before]
        counts["joined"] = sum(1 for pg in made if dist.get_backend(pg) != "fake")


def _first_collectives(dims: Any) -> None:
    """One all-reduce over every enabled 1-d mesh's group (connects lazily made gloo groups)."""
    import torch
    import torch.distributed as dist

    for mesh in dims.get_all_one_dimensional_meshes().values():
        dist.all_reduce(torch.ones(1), group=mesh.get_group())


def _bridge_round(layout: tuple[int, ...]) -> dict[str, Any]:
    import parallelctx
    from parallelctx import gpc
    from parallelctx.torchtitan import parallel_dims

    rep, shard, cp, tp, pp, ep = layout
    parallel = dict(
        tensor=tp,
        pipeline=pp,
        context=cp,
        data=dict(replicate=rep, shard=shard),
        expert=dict(size=ep, tensor=1),
    )
    with counting() as counts:
        start = time.perf_counter()
        parallelctx.launch_from_torch(config={"parallel": parallel, "dist": {"timeout": 300}})
        dims = parallel_dims()
        create = time.perf_counter() - start
        _first_collectives(dims)
        first = time.perf_counter() - start
    gpc.destroy()
    return {"create_s": create, "first_collective_s": first, **counts}


def _torchtitan_round(layout: tuple[int, ...], index: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as tt

    rep, shard, cp, tp, pp, ep = layout
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    with counting() as counts:
        start = time.perf_counter()
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"titan{index}", store), rank=rank, world_size=world
        )
        dims = tt.ParallelDims(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, pp=pp, ep=ep, world_size=world)
        dims.build_mesh()
        create = time.perf_counter() - start
        _first_collectives(dims)
        first = time.perf_counter() - start
    dist.destroy_process_group()
    return {"create_s": create, "first_collective_s": first, **counts}


def worker(out: Path, repeats: int) -> None:
    """One rank of the torchrun job: every layout, warm-up + ``repeats`` alternating rounds."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (torchtitan's "fake" backend)
    import torchtitan.distributed.parallel_dims as tt

    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    tt.device_type = "cpu"  # torchtitan assumes CUDA where no accelerator is found
    records: dict[str, Any] = {}
    index = 0
    for layout in LAYOUTS:
        rounds = []
        for rnd in range(repeats + 1):
            pair = {}
            for lib in ("bridge", "torchtitan") if rnd % 2 == 0 else ("torchtitan", "bridge"):
                index += 1
                pair[lib] = _bridge_round(layout) if lib == "bridge" else _torchtitan_round(layout, index)
            if rnd > 0:  # round 0 warms up
                rounds.append(pair)
        records[",".join(map(str, layout))] = rounds
    Path(out, f"rank-{os.environ['RANK']}.json").write_text(json.dumps(records))


def table(ranks: list[dict[str, Any]]) -> str:
    """The markdown table: per layout, max over ranks per round, median over rounds."""
    lines = [
        (
            "| dp_replicate, dp_shard, cp, tp, pp, ep | launch + parallel_dims() | init + build_mesh() "
            "| ratio | to first collective: ratio | real new_group calls / rank (bridge, torchtitan) "
            "| real groups joined / rank (bridge, torchtitan) |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in ranks[0]:
        n = len(ranks[0][key])

        def per_round(lib: str, field: str, key: str = key, n: int = n) -> list[float]:
            return [max(r[key][i][lib][field] for r in ranks) for i in range(n)]

        ours, theirs = per_round("bridge", "create_s"), per_round("torchtitan", "create_s")
        first = [
            a / b
            for a, b in zip(
                per_round("bridge", "first_collective_s"), per_round("torchtitan", "first_collective_s")
            )
        ]
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        calls = (
            max(r[key][0]["bridge"]["calls"] for r in ranks),
            max(r[key][0]["torchtitan"]["calls"] for r in ranks),
        )
        joined = (
            max(r[key][0]["bridge"]["joined"] for r in ranks),
            max(r[key][0]["torchtitan"]["joined"] for r in ranks),
        )
        lines.append(
            f"| {key.replace(',', ', ')} | {statistics.median(ours) * 1e3:.0f} ms | {statistics.median(theirs) * 1e3:.0f} ms "
            f"| {ratio:.2f} | {statistics.median(first):.2f} | {calls[0]}, {calls[1]} | {joined[0]}, {joined[1]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the torchrun job (or, with ``--worker``, one rank of it); print and write the table."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.out, args.repeats)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(args.world),
        ]
        cmd += [
            "-m",
            "benchmarks.torchtitan_bridge",
            "--worker",
            "--out",
            tmp,
            "--repeats",
            str(args.repeats),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        print(
            f"torchtitan bridge: {args.world} ranks, {len(LAYOUTS)} layouts, {args.repeats} rounds ...",
            flush=True,
        )
        run_command(cmd, env, args.timeout)
        ranks = [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(args.world)]
    body = table(ranks)
    print(body)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    section = (
        "## torchtitan's meshes: `launch + parallel_dims()` against `init_process_group + build_mesh()`\n\n"
        f"Written by `python -m benchmarks.torchtitan_bridge {' '.join(argv)}` on {now} (load average "
        f"{load} after the run; {os.cpu_count()} CPU cores, gloo, `TORCH_GLOO_LAZY_INIT=1` for both). "
        "Start-up from the call to meshes ready, then to a first all-reduce over every enabled 1-d mesh "
        "(max over ranks, median of rounds; ratio = median of per-round ratios, below 1 means "
        "parallelctx is faster). The bridge's count is gpc's whole launch plus `parallel_dims()` "
        "(which itself makes none); torchtitan's is its default group plus `build_mesh()`. "
        "See the module docstring.\n\n"
        f"{body}\n"
    )
    sections.write_section(args.results, "torchtitan_bridge", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
