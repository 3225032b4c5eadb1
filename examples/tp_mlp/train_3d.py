"""Train the MLP of tp_mlp.py on a 3-D layout (tensor 2 x pipeline 2 x data 2 on 8 ranks, dropout
on, each block under activation checkpointing) for a few SGD steps, and keep what each rank saw:
the losses, every dropout mask and every parameter after the last step.

The same :func:`train` runs on 8 real processes::

    torchrun --nproc-per-node 8 examples/tp_mlp/train_3d.py OUT_DIR

(each rank writes ``OUT_DIR/rank-<r>.pt``) and as 8 threads of one process::

    parallelctx.run_local(train, 8, CONFIG)

(:mod:`parallelctx.local`); tests/test_local_world.py checks the two agree bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tp_mlp import ParallelMLP

import parallelctx
from parallelctx import ParallelMode, gpc

HIDDEN, FFN, BATCH, P, LR, STEPS = 8, 16, 4, 0.3, 0.02, 5
CONFIG = dict(parallel=dict(tensor=2, pipeline=2), seed=1234)


def _full_params(stage: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + stage)
    shapes = [(FFN, HIDDEN), (FFN,), (HIDDEN, FFN), (HIDDEN,)]
    return [torch.randn(s, generator=gen) * 0.3 for s in shapes]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data replica's batch of ``step`` (the ranks of one model replica share it)."""
    gen = torch.Generator().manual_seed(100 * step + gpc.get_local_rank(ParallelMode.DATA))
    return torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, HIDDEN, generator=gen)


def train(steps: int = STEPS) -> dict[str, Any]:
    """Train ``steps`` steps on gpc's layout; return this rank's losses (last stage), masks and
    parameters."""
    stage = gpc.get_local_rank(ParallelMode.PIPELINE)
    first, last = gpc.is_pipeline_first_stage(), gpc.is_pipeline_last_stage()
    block = ParallelMLP(*_full_params(stage), p=P)
    losses, masks = [], []
    for step in range(steps):
        x, target = _batch(step)
        if not first:
            x = torch.empty(BATCH, HIDDEN)
            dist.recv(x, src=gpc.get_prev_global_rank(ParallelMode.PIPELINE))
        x.requires_grad_(not first)
        y = parallelctx.checkpoint(block, x, use_reentrant=False)
        masks.append([m.clone() for m in block.masks])
        if last:
            loss = ((y - target) ** 2).mean()
            losses.append(loss.detach().clone())
            loss.backward()
        else:
            dist.send(y.detach().contiguous(), dst=gpc.get_next_global_rank(ParallelMode.PIPELINE))
            grad = torch.empty_like(y)
            dist.recv(grad, src=gpc.get_next_global_rank(ParallelMode.PIPELINE))
            y.backward(grad)
        if not first:
            dist.send(x.grad.contiguous(), dst=gpc.get_prev_global_rank(ParallelMode.PIPELINE))
        with torch.no_grad():
            for param in block.parameters():
                dist.all_reduce(param.grad, group=gpc.get_group(ParallelMode.DATA))
                param -= LR * param.grad / gpc.get_world_size(ParallelMode.DATA)
                param.grad = None
    params = {name: p.detach().clone() for name, p in block.named_parameters()}
    return dict(rank=gpc.get_global_rank(), losses=losses, masks=masks, params=params)


if __name__ == "__main__":
    parallelctx.launch_from_torch(config=CONFIG)
    record = train()
    torch.save(record, Path(sys.argv[1]) / f"rank-{gpc.get_global_rank()}.pt")
    gpc.destroy()
