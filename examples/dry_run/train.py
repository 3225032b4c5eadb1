"""A training script that runs unchanged under torchrun and under ``parallelctx dry-run``.

    torchrun --nproc-per-node 8 examples/dry_run/train.py
    parallelctx dry-run --world-size 16384 --rank 12345 examples/dry_run/train.py
    parallelctx dry-run --world-size 1024 --ranks all examples/dry_run/train.py

It launches from torchrun's variables (tensor 8, pipeline 16 where the world allows), builds
``gpc.device_mesh``, shards a linear layer's weight across the tensor group on the meta device,
and records its local shape, which every rank of a tensor group must agree on.
"""

from __future__ import annotations

import os

import torch

import parallelctx
from parallelctx import gpc
from parallelctx.dryrun import record

HIDDEN = 4096


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tensor = 8 if world % 8 == 0 else 1
    pipeline = 16 if world % (tensor * 16) == 0 else 1
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=tensor, pipeline=pipeline), seed=1234))
    mesh = gpc.device_mesh
    tp = gpc.get_world_size("tensor")
    with torch.device("meta"):
        shard = torch.empty(HIDDEN // tp, HIDDEN)  # column-parallel weight: rows split over tp
    record("weight_shard", list(shard.shape), same_across="tensor")
    record("mesh_shape", list(mesh.shape), same_across="data")
    if gpc.is_pipeline_last_stage():
        record("has_head", True, same_across="tensor")
    gpc.destroy()


if __name__ == "__main__":
    main()
