"""A data-parallel step whose gradient-accumulation branch depends on the pipeline stage.

    parallelctx dry-run --world-size 256 --ranks all examples/deadlocks/extra_allreduce.py [--bug]

With ``--bug``, data rank 5 of stage 2 all-reduces its gradients one time more than its data
peers (it thinks it is at an accumulation boundary): the real job hangs there, or on NCCL
reduces the wrong tensors together. Without it the sweep passes.
"""

import sys

import torch
import torch.distributed as dist

from parallelctx import ParallelMode, gpc, launch_from_torch

launch_from_torch({"parallel": {"tensor": 4, "pipeline": 4}})
bug = "--bug" in sys.argv[1:]
data = gpc.get_group(ParallelMode.DATA)
stage = gpc.get_local_rank(ParallelMode.PIPELINE)
boundary = bug and stage == 2 and gpc.get_local_rank(ParallelMode.DATA) == 5
grad = torch.ones(4, 8)
for step in range(4):
    dist.all_reduce(grad, group=data)
    if boundary and step == 1:
        dist.all_reduce(grad, group=data)
    dist.broadcast(grad, src=dist.get_global_rank(data, 0), group=data)
gpc.destroy()
