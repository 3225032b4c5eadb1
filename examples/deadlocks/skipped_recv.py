"""A pipeline's forward pass: each stage receives its activation from the stage before and sends
its own to the next, one micro-batch at a time.

    parallelctx dry-run --world-size 256 --ranks all examples/deadlocks/skipped_recv.py [--bug]

With ``--bug``, one rank of stage 2 skips the receive of micro-batch 1 (a variable sequence
length it believes is empty): the stage before sends an activation no one receives. Without it
the sweep passes.
"""

import sys

import torch
import torch.distributed as dist

from parallelctx import ParallelMode, gpc, launch_from_torch

launch_from_torch({"parallel": {"tensor": 4, "pipeline": 4}})
bug = "--bug" in sys.argv[1:]
stage = gpc.get_local_rank(ParallelMode.PIPELINE)
first, last = gpc.is_first_rank(ParallelMode.PIPELINE), gpc.is_last_rank(ParallelMode.PIPELINE)
skips = (
    bug
    and stage == 2
    and gpc.get_local_rank(ParallelMode.DATA) == 7
    and gpc.get_local_rank(ParallelMode.TENSOR) == 1
)
activation = torch.zeros(4, 8)
for micro in range(3):
    if not first and not (skips and micro == 1):
        dist.recv(activation, src=gpc.get_prev_global_rank(ParallelMode.PIPELINE))
    activation = activation + 1
    if not last:
        dist.send(activation, dst=gpc.get_next_global_rank(ParallelMode.PIPELINE))
gpc.destroy()
