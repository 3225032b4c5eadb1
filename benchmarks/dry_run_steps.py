"""A training loop of a few hundred calls per rank, for the dry-run sweep's cost of recording them.

    parallelctx dry-run --world-size 1024 --ranks all benchmarks/dry_run_steps.py [--steps 60]

Tensor 8 x pipeline 16 (where the world allows). Each step: an all-reduce on the tensor group,
an activation sent to the next pipeline stage and received from the previous one, a gradient
all-reduce on the data group and, every 10 steps, a broadcast of a scalar on the world group:
5 calls per step on a middle stage (300 at the default 60 steps).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 60
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tensor = 8 if world % 8 == 0 else 1
    pipeline = 16 if world % (tensor * 16) == 0 else 1
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=tensor, pipeline=pipeline)))
    tp, dp = gpc.get_group(ParallelMode.TENSOR), gpc.get_group(ParallelMode.DATA)
    act, grad, flag = torch.ones(4, 8), torch.ones(64), torch.zeros(1)
    for step in range(steps):
        dist.all_reduce(act, group=tp)
        if not gpc.is_pipeline_last_stage():
            dist.send(act, dst=gpc.get_next_global_rank(ParallelMode.PIPELINE))
        if not gpc.is_pipeline_first_stage():
            dist.recv(act, src=gpc.get_prev_global_rank(ParallelMode.PIPELINE))
        dist.all_reduce(grad, group=dp)
        if step % 10 == 0:
            dist.broadcast(flag, src=0)
    gpc.destroy()


if __name__ == "__main__":
    main()
