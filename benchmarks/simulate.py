"""Simulated start-up of one rank in a huge world, in this process only.

    python -m benchmarks.simulate --world 131072 --repeats 5

torch's ``"fake"`` backend with the in-process ``FakeStore`` lets this process act as one
rank of a world of any size: ``new_group`` does its bookkeeping but no other process is
needed. Per world size this prints one JSON line: the rank's start-up time (config, adopting
the default group, plan, creating its groups; median of ``--repeats``), the peak Python
memory of one start-up (tracemalloc), its group creations, and the time of the layout for the
whole world (``plan`` plus ``group_array`` of every mode), with converting every group to
Python lists timed apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc
from typing import Any

import torch.distributed as dist

WANTED = {"tensor": 8, "pipeline": 16, "context": 2, "expert": 8}


def sizes_for(world: int) -> dict[str, int]:
    """Return tensor 8, pipeline 16, context 2, expert 8, halving the larger of pipeline and
    expert (then context, then tensor) until every product divides ``world``.

    Raises:
        ValueError: ``world`` is not a positive integer.
    """
    if world < 1:
        raise ValueError(f"world={world} must be a positive integer")
    s = dict(WANTED)

    def fits() -> bool:
        dense = s["tensor"] * s["pipeline"] * s["context"]
        expert = s["tensor"] * s["expert"] * s["pipeline"]
        return world % dense == 0 and world % expert == 0

    while not fits() and max(s["pipeline"], s["expert"]) > 1:
        axis = "pipeline" if s["pipeline"] >= s["expert"] else "expert"
        s[axis] //= 2
    for axis in ("context", "tensor"):
        while not fits() and s[axis] > 1:
            s[axis] //= 2
    return s


def _start_up(rank: int, world: int, sizes: dict[str, int]) -> int:
    from parallelctx import gpc

    gpc.load_config({"parallel": {k: v for k, v in sizes.items()}})
    gpc.init_global_dist(rank, world)
    gpc.init_parallel_groups()
    return gpc.group_creations


def _tear_down(rank: int) -> None:
    from parallelctx import gpc

    gpc.destroy()
    # A kept singleton group shifts torch's group count, so the next start-up gets fresh names
    # (parallelctx refuses to re-create a destroyed group under its old name).
    _SPACERS.append(dist.new_group([rank], use_local_synchronization=True))


_SPACERS: list[Any] = []


def simulate(world: int, repeats: int, rank: int | None = None) -> dict[str, Any]:
    """Simulate one rank's start-up in a world of ``world`` ranks; return the measurements.

    ``rank`` defaults to the last rank (last pipeline stage, so it holds an embedding group).
    Needs a process where torch.distributed is not initialised yet; leaves it initialised.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallelctx.layout import ParallelMode, plan

    rank = world - 1 if rank is None else rank
    sizes = sizes_for(world)
    t = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    init_s = time.perf_counter() - t
    times, calls = [], 0
    for _ in range(repeats + 1):  # the first start-up warms imports and caches: dropped
        t = time.perf_counter()
        calls = _start_up(rank, world, sizes)
        times.append(time.perf_counter() - t)
        _tear_down(rank)
    tracemalloc.start()
    _start_up(rank, world, sizes)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    _tear_down(rank)

    t = time.perf_counter()
    layout = plan(world, **sizes)
    arrays = [layout.group_array(mode) for mode in ParallelMode]
    layout_s = time.perf_counter() - t
    t = time.perf_counter()
    lists = [a.tolist() for a in arrays]
    lists_s = time.perf_counter() - t
    return {
        "world_size": world,
        "rank": rank,
        "sizes": sizes,
        "fake_init_s": init_s,
        "startup_s": statistics.median(times[1:]),
        "startup_min_s": min(times[1:]),
        "startup_max_s": max(times[1:]),
        "peak_bytes": peak,
        "group_creations": calls,
        "layout_s": layout_s,
        "to_lists_s": lists_s,
        "groups_total": sum(len(x) for x in lists),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the JSON measurements of one simulated world."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print(json.dumps(simulate(args.world, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
