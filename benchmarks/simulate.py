"""Simulated start-up of one rank in a huge world, in this process only.

    python -m benchmarks.simulate --world 131072 --repeats 5 [--lib megatron|devicemesh]

torch's ``"fake"`` backend with the in-process ``FakeStore`` lets this process act as one
rank of a world of any size: ``new_group`` does its bookkeeping but no other process is
needed. Per world size this prints one JSON line: the rank's start-up time (config, adopting
the default group, plan, creating its groups; median of ``--repeats``), the peak Python
memory of one start-up (tracemalloc), its group creations, and the time of the layout for the
whole world (``plan`` plus ``group_array`` of every mode), with converting every group to
Python lists timed apart. For parallelctx it also measures torch alone making the same groups
(:func:`torch_alone`), the floor under parallelctx's time and memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc
from typing import Any

import numpy as np
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


LIBS = ("parallelctx", "megatron", "devicemesh", "bridge", "bridge_pgc")


def _start_up(lib: str, rank: int, world: int, sizes: dict[str, int]) -> int:
    """Build ``lib``'s groups for ``sizes`` on this (fake) rank; return the new_group calls."""
    from .peers import count_new_groups

    with count_new_groups() as counter:
        if lib in ("parallelctx", "bridge", "bridge_pgc"):
            from parallelctx import gpc

            gpc.load_config({"parallel": dict(sizes)})
            gpc.init_global_dist(rank, world)
            gpc.init_parallel_groups()
            if lib != "parallelctx":  # + seeds and Megatron-core's groups (benchmarks/megatron_bridge.py)
                import parallelctx.megatron as bridge

                gpc.set_seed()
                if lib == "bridge":
                    bridge.install()  # every parallel_state global
                else:
                    _COLLECTIONS.append(bridge.process_groups())  # the pg_collection route
        elif lib == "megatron":
            from megatron.core import parallel_state as ps

            ps.initialize_model_parallel(
                tensor_model_parallel_size=sizes["tensor"],
                pipeline_model_parallel_size=sizes["pipeline"],
                context_parallel_size=sizes["context"],
                expert_model_parallel_size=sizes["expert"],
                create_gloo_process_groups=False,
            )
        else:
            from torch.distributed.device_mesh import init_device_mesh

            t, p, c = sizes["tensor"], sizes["pipeline"], sizes["context"]
            _MESHES.append(
                init_device_mesh(
                    "cpu", (p, world // (t * p * c), c, t), mesh_dim_names=("pp", "dp", "cp", "tp")
                )
            )
    return counter[0]


def _tear_down(lib: str, rank: int) -> None:
    """Undo :func:`_start_up` as far as the next round needs."""
    if lib in ("parallelctx", "bridge", "bridge_pgc"):
        from parallelctx import gpc

        _COLLECTIONS.clear()
        gpc.destroy()
        # A kept singleton group shifts torch's group count, so the next start-up gets fresh
        # names (parallelctx refuses to re-create a destroyed group under its old name).
        _SPACERS.append(dist.new_group([rank], use_local_synchronization=True))
    elif lib == "megatron":
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    else:
        _MESHES.clear()


_MESHES: list[Any] = []
_COLLECTIONS: list[Any] = []  # kept until tear-down, as a user keeps the collection


_SPACERS: list[Any] = []


def torch_alone(rank: int, world: int, sizes: dict[str, int], repeats: int) -> dict[str, float]:
    """Time and memory of torch alone making the same groups as parallelctx on this rank.

    The member lists are computed first, outside the measurement; then only the
    ``new_group(members, use_local_synchronization=True)`` calls are measured: torch's own cost
    (its registry keeps every member of every group), the floor under parallelctx's.
    """
    from parallelctx.groups import creation_order
    from parallelctx.layout import ParallelMode, plan

    layout = plan(world, **sizes)
    seen, lists = set(), []
    world_sig = layout.signature(ParallelMode.GLOBAL)
    for mode in creation_order(layout):
        sig = layout.signature(mode)
        if mode is ParallelMode.GLOBAL or layout.size(mode) == 1 or sig == world_sig or sig in seen:
            continue
        seen.add(sig)
        members = layout.group_of(mode, rank)
        if members:
            lists.append(np.asarray(members, dtype=np.int64))

    def make() -> list[Any]:
        # tolist() inside the measurement: torch needs (and keeps) Python ints.
        return [dist.new_group(m.tolist(), use_local_synchronization=True) for m in lists]

    def undo(groups: list[Any]) -> None:
        for g in groups:
            dist.destroy_process_group(g)
        _SPACERS.append(dist.new_group([rank], use_local_synchronization=True))

    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        groups = make()
        times.append(time.perf_counter() - t)
        undo(groups)
    tracemalloc.start()
    groups = make()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    undo(groups)
    return {
        "torch_alone_s": statistics.median(times[1:]),
        "torch_alone_kept_bytes": kept,
        "torch_alone_peak_bytes": peak,
    }


def simulate(world: int, repeats: int, lib: str = "parallelctx", rank: int | None = None) -> dict[str, Any]:
    """Simulate one rank's start-up with ``lib`` in a world of ``world`` ranks; return the
    measurements.

    ``rank`` defaults to the last rank (last pipeline stage, so it holds an embedding group).
    DeviceMesh gets the dense axes only (pp, dp, cp, tp): it has no expert axis. Needs a
    process where torch.distributed is not initialised yet; leaves it initialised.

    Raises:
        ValueError: ``lib`` is not one of :data:`LIBS`.
    """
    if lib not in LIBS:
        raise ValueError(f"lib={lib!r}; valid: {', '.join(LIBS)}")
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
        calls = _start_up(lib, rank, world, sizes)
        times.append(time.perf_counter() - t)
        _tear_down(lib, rank)
    tracemalloc.start()
    _start_up(lib, rank, world, sizes)
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    _tear_down(lib, rank)
    base = torch_alone(rank, world, sizes, repeats) if lib == "parallelctx" else {}

    t = time.perf_counter()
    layout = plan(world, **sizes)
    arrays = [layout.group_array(mode) for mode in ParallelMode]
    layout_s = time.perf_counter() - t
    t = time.perf_counter()
    lists = [a.tolist() for a in arrays]
    lists_s = time.perf_counter() - t
    return {
        "lib": lib,
        "world_size": world,
        "rank": rank,
        "sizes": sizes,
        "fake_init_s": init_s,
        "startup_s": statistics.median(times[1:]),
        "startup_min_s": min(times[1:]),
        "startup_max_s": max(times[1:]),
        "peak_bytes": peak,
        "kept_bytes": kept,
        **base,
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
    parser.add_argument("--lib", choices=LIBS, default="parallelctx")
    args = parser.parse_args(argv)
    print(json.dumps(simulate(args.world, args.repeats, args.lib)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
