"""Record what a launch without parallel.modules does: every new_group call (members, backend,
local synchronization, description), each mode's members and each stream's seed and first draw.
Run as a script under torchrun (real gloo), or call ``record_simulated`` (torch's fake backend)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2_pp2_dp2": dict(tensor=2, pipeline=2),
    "tp2_pp4": dict(tensor=2, pipeline=4),
    "tp2_ep2_etp1_cp2": dict(tensor=2, context=2, expert=dict(size=2, tensor=1)),
}


def _record_one(launch: Any) -> dict[str, Any]:
    from parallelctx import gpc
    from parallelctx.planning.layout import ParallelMode

    calls: list[Any] = []
    real = dist.new_group

    def new_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        calls.append(
            [
                None if ranks is None else list(ranks),
                kwargs.get("backend"),
                bool(kwargs.get("use_local_synchronization")),
                kwargs.get("group_desc"),
            ]
        )
        return real(ranks, *args, **kwargs)

    dist.new_group = new_group
    try:
        launch()
    finally:
        dist.new_group = real
    groups = {m.value: list(gpc.get_ranks_in_group(m)) for m in ParallelMode if gpc.is_initialized(m)}
    seeds, draws = {}, {}
    for key in [*ParallelMode, "replica"]:
        name = getattr(key, "value", key)
        seeds[name] = gpc.get_seed(key)
        with gpc.seed(key):
            draws[name] = torch.rand(1).item()
    out = dict(calls=calls, groups=groups, seeds=seeds, draws=draws, group_creations=gpc.group_creations)
    gpc.destroy()
    return out


def record_simulated(world_size: int, rank: int) -> dict[str, Any]:
    """Every layout of LAYOUTS launched as rank ``rank`` of ``world_size`` on the fake backend."""
    from parallelctx import gpc

    out = {}
    for name, parallel in LAYOUTS.items():
        out[name] = _record_one(
            lambda p=parallel: gpc.launch(dict(parallel=p), simulate=dict(world_size=world_size, rank=rank))
        )
    return out


def main() -> None:
    from parallelctx import launch_from_torch

    out = {}
    for name, parallel in LAYOUTS.items():
        out[name] = _record_one(lambda p=parallel: launch_from_torch(dict(parallel=p)))
    path = os.path.join(sys.argv[1], f"rank{gpc_rank()}.json")
    with open(path, "w") as f:
        json.dump(out, f, sort_keys=True)


def gpc_rank() -> int:
    return int(os.environ["RANK"])


if __name__ == "__main__":
    main()
