"""Worker for the start-up benchmark; started by :mod:`benchmarks.run` under torchrun.

    torchrun --standalone --nproc-per-node 8 -m benchmarks.startup_worker \
        --tensor 2 --pipeline 2 --repeats 5 --out startup.json

Every rank joins one gloo default group, imports all three libraries, then runs rounds: in
each round every library builds the same layout once, in an order that rotates from round to
round (one unmeasured warm-up round first). Per library and round it records, as the max
over ranks, the seconds from a common barrier to "all groups ready" and to "a first collective
done in every group this rank belongs to", the group-creation calls per rank, and (rank 0)
query nanoseconds. Rank 0 writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import timeit
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .peers import LIBS, SETUP, Built, Query, count_new_groups

# Calls per timing and timings per query: the best of REPEATS, minus the same loop's empty cost.
QUERY_REPEATS = 5


def time_query(query: Query, number: int) -> float:
    """Return the nanoseconds one evaluation of ``query`` costs, net of the timeit loop.

    The best of :data:`QUERY_REPEATS` timings of ``number`` calls, minus the best timing of an
    empty statement with the same loop.
    """
    timer = timeit.Timer(query.stmt, globals=dict(query.env))
    empty = timeit.Timer("pass")
    best = min(timer.repeat(QUERY_REPEATS, number)) / number
    base = min(empty.repeat(QUERY_REPEATS, number)) / number
    return max(best - base, 0.0) * 1e9


def measure(lib: str, tensor: int, pipeline: int, queries: bool, number: int) -> dict[str, Any]:
    """Build ``lib``'s layout once on every rank; return this round's record (on every rank)."""
    dist.barrier()
    t0 = time.perf_counter()
    with count_new_groups() as counter:
        built: Built = SETUP[lib](tensor, pipeline)
    t1 = time.perf_counter()
    one = torch.ones(1)
    for group in built.groups:
        dist.all_reduce(one, group=group)
    t2 = time.perf_counter()
    stats = torch.tensor([t1 - t0, t2 - t0, float(counter[0]), float(len(built.groups))], dtype=torch.float64)
    low = stats.clone()
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    record: dict[str, Any] = {
        "lib": lib,
        "create_s": stats[0].item(),
        "first_collective_s": stats[1].item(),
        "calls_max": int(stats[2].item()),
        "calls_min": int(low[2].item()),
        "member_groups_max": int(stats[3].item()),
        "member_groups_min": int(low[3].item()),
        "queries_ns": {},
    }
    if queries and dist.get_rank() == 0:
        for q in built.queries:
            # DeviceMesh queries cost microseconds: fewer calls keep the run short.
            n = number // 20 if lib == "devicemesh" else number
            record["queries_ns"][q.name] = time_query(q, n)
    dist.barrier()
    built.teardown()
    dist.barrier()
    return record


def main(argv: list[str] | None = None) -> int:
    """Run the rounds on this rank; rank 0 writes the JSON file named by ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensor", type=int, default=2)
    parser.add_argument("--pipeline", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--query-calls", type=int, default=200_000)
    parser.add_argument("--libs", default=",".join(LIBS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for every wait")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    libs = [lib for lib in args.libs.split(",") if lib]
    for lib in libs:
        if lib not in SETUP:
            parser.error(f"--libs names {lib!r}; valid: {', '.join(LIBS)}")

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    if "megatron" in libs:
        import megatron.core.parallel_state  # noqa: F401  (import cost is not start-up cost)
    if "devicemesh" in libs:
        import torch.distributed.device_mesh  # noqa: F401
    import parallelctx  # noqa: F401

    rounds: list[list[dict[str, Any]]] = []
    for index in range(args.repeats + 1):  # round 0 warms up and is dropped
        order = libs[index % len(libs) :] + libs[: index % len(libs)]
        rounds.append(
            [measure(lib, args.tensor, args.pipeline, index > 0, args.query_calls) for lib in order]
        )
    if dist.get_rank() == 0:
        result = {
            "world_size": dist.get_world_size(),
            "tensor": args.tensor,
            "pipeline": args.pipeline,
            "lazy_init": os.environ.get("TORCH_GLOO_LAZY_INIT", "0") == "1",
            "repeats": args.repeats,
            "rounds": rounds[1:],
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
