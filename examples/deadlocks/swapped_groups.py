"""A step that reduces over the tensor group, then the data group.

    parallelctx dry-run --world-size 256 --ranks all examples/deadlocks/swapped_groups.py [--bug cycle|serialise] [--functional]

``--bug cycle``: of stage 0, tensor rank 0 of data rank 0 and tensor rank 1 of data rank 1 reduce
over the data group first: with their peers they wait on each other in a cycle (the first waits
for the second in the data group, which waits for a tensor peer, and so on), and the job hangs.
``--bug serialise``: only the first of them swaps; its groups still complete (one after the
other), so the sweep passes. ``--functional``: the reduces are torch's functional all-reduces
(as DTensor makes them), each waited for at once; the same cycle.
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from parallelctx import ParallelMode, gpc, launch_from_torch

launch_from_torch({"parallel": {"tensor": 4, "pipeline": 4}})
bug = sys.argv[sys.argv.index("--bug") + 1] if "--bug" in sys.argv else ""
tensor, data = gpc.get_group(ParallelMode.TENSOR), gpc.get_group(ParallelMode.DATA)
where = (
    gpc.get_local_rank(ParallelMode.PIPELINE),
    gpc.get_local_rank(ParallelMode.TENSOR),
    gpc.get_local_rank(ParallelMode.DATA),
)
swaps = (bug == "cycle" and where in ((0, 0, 0), (0, 1, 1))) or (bug == "serialise" and where == (0, 0, 0))
grad = torch.ones(4, 8)
for group in (data, tensor) if swaps else (tensor, data):
    if "--functional" in sys.argv:
        grad = funcol.all_reduce(grad, "sum", group).wait()
    else:
        dist.all_reduce(grad, group=group)
gpc.destroy()
