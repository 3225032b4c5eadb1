"""Parameters broadcast from the first rank of each data group.

    parallelctx dry-run --world-size 256 --ranks all examples/deadlocks/broadcast_root.py [--bug]

With ``--bug``, one rank names the root by its data rank where torch wants a global rank: its
broadcast has another root than its peers'. Without it the sweep passes.
"""

import sys

import torch
import torch.distributed as dist

from parallelctx import ParallelMode, gpc, launch_from_torch

launch_from_torch({"parallel": {"tensor": 4, "pipeline": 4}})
bug = "--bug" in sys.argv[1:]
data = gpc.get_group(ParallelMode.DATA)
first = gpc.get_ranks_in_group(ParallelMode.DATA)[0]
wrong = bug and dist.get_rank() == 133
weights = torch.zeros(16)
dist.broadcast(weights, src=gpc.get_ranks_in_group(ParallelMode.DATA)[1] if wrong else first, group=data)
gpc.destroy()
