"""Model code that trips a naive single-process simulation (issue 36), as a user writes it. Each
function runs on every rank and returns what that rank saw; tests/test_local_world.py runs them
as a local world (``parallelctx.run_local``) and, in its slow test, on real processes, and
compares.

    python tests/local_traps.py OUT_DIR      # under torchrun: each rank writes OUT_DIR/rank-<r>.pt
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc

CONFIG = dict(parallel=dict(tensor=2, pipeline=2), seed=77)


def list_all_gather() -> dict[str, Any]:
    """The list form of all_gather on the tensor and data groups: each rank its own group's."""
    out = {}
    for mode in (ParallelMode.TENSOR, ParallelMode.DATA):
        parts = [torch.zeros(2) for _ in range(gpc.get_world_size(mode))]
        mine = torch.tensor([float(dist.get_rank()), float(gpc.get_local_rank(mode))])
        dist.all_gather(parts, mine, group=gpc.get_group(mode))
        out[mode.name] = torch.stack(parts)
    return out


def rank_branch() -> dict[str, Any]:
    """Control flow on the rank: the first tensor rank broadcasts what only it computed."""
    value = torch.zeros(3)
    if gpc.is_first_rank(ParallelMode.TENSOR):
        value = torch.rand(3) + dist.get_rank()
    src = gpc.get_ranks_in_group(ParallelMode.TENSOR)[0]
    dist.broadcast(value, src=src, group=gpc.get_group(ParallelMode.TENSOR))
    return {"value": value, "rank": dist.get_rank(), "first": gpc.is_first_rank(ParallelMode.TENSOR)}


def save_and_restore() -> dict[str, Any]:
    """A save, draw, restore, draw cycle of the default generator, with a collective between."""
    state = torch.get_rng_state()
    first = torch.rand(4)
    dist.all_reduce(torch.ones(1), group=gpc.get_group(ParallelMode.GLOBAL))  # other ranks run here
    torch.set_rng_state(state)
    again = torch.rand(4)
    return {"first": first, "again": again, "python": random.random(), "numpy": float(np.random.rand())}


def fork_rng() -> dict[str, Any]:
    """torch.random.fork_rng around draws and a collective, then the default stream goes on."""
    with torch.random.fork_rng():
        torch.manual_seed(1000 + dist.get_rank())
        inside = torch.rand(2)
        dist.all_reduce(torch.ones(1))
        inside_after = torch.rand(2)
    outside = torch.rand(2)
    return {"inside": inside, "inside_after": inside_after, "outside": outside}


def streams() -> dict[str, Any]:
    """Draws on gpc's per-mode streams and gpc's saved RNG state restored."""
    out: dict[str, Any] = {}
    for mode in (ParallelMode.TENSOR, ParallelMode.DATA, ParallelMode.PIPELINE, "replica"):
        with gpc.seed(mode):
            out[str(mode)] = torch.rand(3)
    saved = gpc.get_rng_state()
    a = torch.rand(2)
    gpc.set_rng_state(saved)
    out["replayed"] = torch.equal(a, torch.rand(2))
    return out


def everything() -> dict[str, Any]:
    """Every trap in order, on one launch."""
    return {
        "all_gather": list_all_gather(),
        "branch": rank_branch(),
        "save_restore": save_and_restore(),
        "fork_rng": fork_rng(),
        "streams": streams(),
    }


if __name__ == "__main__":
    parallelctx.launch_from_torch(config=CONFIG)
    torch.save(everything(), Path(sys.argv[1]) / f"rank-{gpc.get_global_rank()}.pt")
    gpc.destroy()
