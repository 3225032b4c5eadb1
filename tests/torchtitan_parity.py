"""One rank of the torchtitan parity test, started by real torchrun:

    torchrun --standalone --nproc-per-node 8 tests/torchtitan_parity.py OUT_DIR

For each layout of :data:`LAYOUTS` (``dp_replicate, dp_shard, cp, tp, pp, ep``), in one process:
``launch_from_torch`` with ``parallel=dict(tensor=tp, pipeline=pp, context=cp,
data=dict(replicate=R, shard=S), expert=dict(size=ep, tensor=1))``, then
``parallelctx.torchtitan.parallel_dims()`` (the bridge), then torchtitan's own
``ParallelDims(...).build_mesh()`` on the same processes, then ``gpc.destroy()`` and the next
layout. Records, per layout, every mesh of both (each single name, ``["dp_replicate",
"dp_shard"]``, ``["dp_replicate", "dp_shard", "cp", "tp"]``, the world mesh; all with
``include_singleton_axes=True``) as (dim names, mesh ranks), under torchtitan's default
``spmd_backend`` and, for three layouts, its other two; the members of each of the bridge's
real 1-d groups, proved by an all-gather over it; and the number of real (non-fake) process
groups each made (``new_group``/``split_group`` calls, and the groups this rank joined), timed.
Writes OUT_DIR/rank-<R>.json; the test compares in the parent.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import parallelctx
from parallelctx import gpc

# (dp_replicate, dp_shard, cp, tp, pp, ep) on 8 ranks
LAYOUTS: list[tuple[int, int, int, int, int, int]] = [
    (8, 1, 1, 1, 1, 1),
    (1, 8, 1, 1, 1, 1),
    (2, 4, 1, 1, 1, 1),
    (2, 2, 1, 2, 1, 1),
    (1, 2, 2, 2, 1, 1),
    (2, 2, 1, 1, 2, 1),
    (1, 4, 1, 2, 1, 2),
    (2, 2, 1, 2, 1, 4),
    (1, 2, 2, 1, 2, 2),
]
MULTI = (["dp_replicate", "dp_shard"], ["dp_replicate", "dp_shard", "cp", "tp"])
BACKENDS = ("spmd_types", "full_dtensor", "partial_dtensor")
ALL_BACKENDS_ON = (3, 4, 8)  # layouts (by index) checked under every spmd_backend; the rest: spmd_types


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count real (non-fake) process-group creations inside the block: ``calls`` (new_group /
    split_group calls, members or not) and ``joined`` (real groups this rank is a member of)."""
    counts = {"calls": 0, "fake_calls": 0, "joined": 0}
    new_group_with_tag: Callable[..., Any] = c10d._new_group_with_tag
    split_group: Callable[..., Any] = c10d.split_group
    before = set(c10d._world.pg_map)

    def is_fake(args: tuple, kwargs: dict) -> bool:
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        return backend is not None and str(backend).lower() == "fake"

    def counted_new(*args: Any, **kwargs: Any) -> Any:
        counts["fake_calls" if is_fake(args, kwargs) else "calls"] += 1
        return new_group_with_tag(*args, **kwargs)

    def counted_split(*args: Any, **kwargs: Any) -> Any:
        counts["calls"] += 1
        return split_group(*args, **kwargs)

    c10d._new_group_with_tag = counted_new
    c10d.split_group = counted_split
    try:
        yield counts
    finally:
        c10d._new_group_with_tag = new_group_with_tag
        c10d.split_group = split_group
        made = [pg for pg in c10d._world.pg_map if pg not in before]
        counts["joined"] = sum(1 for pg in made if dist.get_backend(pg) != "fake")


def meshes(dims: Any) -> dict[str, Any]:
    """Every mesh to compare: name -> (dim names, ranks)."""
    out: dict[str, Any] = {}
    names = list(dims._single_axis_meshes)
    for key in [*names, *MULTI]:
        try:
            mesh = dims.get_optional_mesh(key, include_singleton_axes=True)
        except ValueError as exc:  # a combination this spmd backend has no mesh for
            out[",".join(key) if isinstance(key, list) else key] = f"ValueError: {exc}"
            continue
        out[",".join(key) if isinstance(key, list) else key] = [list(mesh.mesh_dim_names), mesh.mesh.tolist()]
    world = dims.world_mesh
    out["world"] = [list(world.mesh_dim_names), world.mesh.tolist()]
    return out


def proved(dims: Any) -> dict[str, list[int]]:
    """Members of the bridge's 1-d meshes' groups, by an all-gather of global ranks over each."""
    out = {}
    for name, mesh in dims._single_axis_meshes.items():
        group = mesh.get_group()
        size = dist.get_world_size(group)
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(got, torch.tensor([dist.get_rank()]), group=group)
        out[name] = [int(t.item()) for t in got]
    return out


def main() -> int:
    """Run every layout on this rank; return 0 (the test reads the JSON files)."""
    out_dir = Path(sys.argv[1])
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend torchtitan uses)
    import torchtitan.distributed.parallel_dims as tt

    from parallelctx.torchtitan import parallel_dims

    tt.device_type = "cpu"  # torchtitan assumes CUDA where no accelerator is found
    records = []
    for index, (rep, shard, cp, tp, pp, ep) in enumerate(LAYOUTS):
        parallel = dict(
            tensor=tp,
            pipeline=pp,
            context=cp,
            data=dict(replicate=rep, shard=shard),
            expert=dict(size=ep, tensor=1),
        )
        record: dict[str, Any] = {"layout": [rep, shard, cp, tp, pp, ep], "backends": {}}
        with counting() as launch:
            start = time.perf_counter()
            parallelctx.launch_from_torch(config={"parallel": parallel, "dist": {"timeout": 120}})
            record["launch_s"] = time.perf_counter() - start
        record["launch_groups"] = dict(launch)
        record["gpc_group_creations"] = gpc.group_creations
        for backend in BACKENDS if index in ALL_BACKENDS_ON else BACKENDS[:1]:
            with counting() as bridge_count:
                start = time.perf_counter()
                bridge = parallel_dims(spmd_backend=backend)
                bridge_s = time.perf_counter() - start
            entry: dict[str, Any] = {
                "bridge_s": bridge_s,
                "bridge_groups": dict(bridge_count),
                "bridge": meshes(bridge),
                "bridge_proved": proved(bridge),
                "bridge_is_parallel_dims": isinstance(bridge, tt.ParallelDims),
            }
            dist.barrier()
            before = set(c10d._world.pg_map)
            # torchtitan's gloo groups connect on first use, as gpc's do (and NCCL's always do)
            os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
            with counting() as own_count:
                start = time.perf_counter()
                own = tt.ParallelDims(
                    dp_replicate=rep,
                    dp_shard=shard,
                    cp=cp,
                    tp=tp,
                    pp=pp,
                    ep=ep,
                    world_size=8,
                    spmd_backend=backend,
                )
                own.build_mesh()
                entry["torchtitan_s"] = time.perf_counter() - start
            os.environ.pop("TORCH_GLOO_LAZY_INIT")
            entry["torchtitan_groups"] = dict(own_count)
            entry["torchtitan"] = meshes(own)
            dist.barrier()
            for pg in [pg for pg in c10d._world.pg_map if pg not in before]:
                dist.destroy_process_group(pg)
            record["backends"][backend] = entry
        records.append(record)
        rank = gpc.get_global_rank()
        gpc.destroy()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
