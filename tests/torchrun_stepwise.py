"""One rank of the stepwise-equals-launch check, started by real torchrun (or run alone as a
world of one):

    torchrun --standalone --nproc-per-node 4 tests/torchrun_stepwise.py OUT_DIR

Launches twice in the same process, once with ``launch_from_torch`` and once with the six
InternLM step methods, and writes OUT_DIR/rank-<R>.json with what each gave: the summary, every
mode's view (rank, size, ranks, next, prev), every stream's seed and first draws, and a one-hot
all-reduce over every mode's group (the group's real members).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rng_cases import stream_draws

import parallelctx
from parallelctx import ParallelMode, gpc
from parallelctx.seed import STREAMS

CONFIG = {"parallel": {"tensor": 2, "pipeline": 2}, "seed": 99, "dist": {"timeout": 60}}
ALONE = {"seed": 99}


def observed() -> dict[str, Any]:
    """What model code sees of gpc now."""
    views = {}
    for mode in ParallelMode:
        if not gpc.is_initialized(mode):
            continue
        view = getattr(gpc, mode.value if mode is not ParallelMode.GLOBAL else "world")
        hot = torch.zeros(gpc.get_world_size(ParallelMode.GLOBAL))
        hot[gpc.get_global_rank()] = 1.0
        dist.all_reduce(hot, group=gpc.get_group(mode))
        members = [r for r, x in enumerate(hot.tolist()) if x]
        views[mode.value] = [view.rank, view.size, list(view.ranks), view.next_rank, view.prev_rank, members]
    return {
        "summary": gpc.summary(),
        "views": views,
        "seeds": {str(s): gpc.get_seed(s) for s in STREAMS},
        "draws": stream_draws(4),
        "local_rank": gpc.local_rank,
        "nodes": gpc.num_nodes,
    }


def stepwise(config: Any) -> None:
    """The InternLM sequence, as InternLM users write it."""
    env = os.environ
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    gpc.load_config(config)
    port = int(env["MASTER_PORT"]) if world > 1 else None
    gpc.init_global_dist(rank, world, "gloo", env.get("MASTER_ADDR", "127.0.0.1"), port)
    gpc.init_parallel_groups()
    gpc.detect_num_processes_on_current_node()
    gpc.set_device(int(env.get("LOCAL_RANK", 0)))
    gpc.set_seed()


def main(out_dir: str) -> None:
    """Both launches on this rank, one after the other; writes its record."""
    config = CONFIG if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ALONE
    if "RANK" in os.environ:
        parallelctx.launch_from_torch(config)
    else:
        parallelctx.launch(config)
    launched = observed()
    gpc.destroy()
    stepwise(config)
    steps = observed()
    rank = gpc.get_global_rank()
    gpc.destroy()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps({"launch": launched, "stepwise": steps}))


if __name__ == "__main__":
    main(sys.argv[1])
