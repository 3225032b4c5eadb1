"""A tensor-parallel layer that all-gathers its output shards.

    parallelctx dry-run --world-size 256 --ranks all examples/deadlocks/gather_shape.py [--bug]

With ``--bug``, tensor rank 3 of the last stage pads its shard (a padded vocabulary on one
rank): its all-gather has another shape than its peers'. Without it the sweep passes.
"""

import sys

import torch
import torch.distributed as dist

from parallelctx import ParallelMode, gpc, launch_from_torch

launch_from_torch({"parallel": {"tensor": 4, "pipeline": 4}})
bug = "--bug" in sys.argv[1:]
tensor = gpc.get_group(ParallelMode.TENSOR)
last = gpc.is_last_rank(ParallelMode.PIPELINE)
padded = (
    bug
    and last
    and gpc.get_local_rank(ParallelMode.TENSOR) == 3
    and gpc.get_local_rank(ParallelMode.DATA) == 0
)
shard = torch.zeros(8, 17 if padded else 16)
for _ in range(2):
    out = torch.zeros(4 * shard.shape[0], shard.shape[1])
    dist.all_gather_into_tensor(out, shard, group=tensor)
gpc.destroy()
