"""A tensor-parallel MLP written with DTensor, which logs its weight's norm.

    parallelctx dry-run --world-size 64 --ranks all examples/deadlocks/dtensor_log.py [--bug]

The MLP's two linears are split over the tensor group with torch's ``parallelize_module``
(column-wise, then row-wise): its forward and backward reduce and gather through torch's
functional collectives, which never pass through ``torch.distributed``'s functions.
``--bug``: only tensor rank 0 logs, and ``full_tensor()`` gathers the weight over the tensor
group, so rank 0 makes a collective its tensor peers never make: every real job hangs there.
"""

import sys

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from parallelctx import ParallelMode, gpc, launch_from_torch

launch_from_torch({"parallel": {"tensor": 4, "pipeline": 2}})
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
mesh = gpc.device_mesh["tp"]
parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
x = torch.randn(4, 8)
loss = mlp(x).sum()
loss.backward()
logs = "--bug" not in sys.argv or gpc.get_local_rank(ParallelMode.TENSOR) == 0
if logs:
    norm = mlp[0].weight.full_tensor().norm()  # every tensor rank must gather, or none
gpc.destroy()
