"""A small Megatron-style tensor-parallel MLP on parallelctx's ``gpc``: a column-parallel linear,
GELU and dropout on the shard, a row-parallel linear, dropout on the (replicated) output; and a
two-stage pipeline of such blocks. Tested against the serial model in test_tp_mlp.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallelctx import ParallelMode, gpc


class _CopyToTensorGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the tensor group backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        grad = grad.clone()
        dist.all_reduce(grad, group=gpc.get_group(ParallelMode.TENSOR))
        return grad


class _ReduceFromTensorGroup(torch.autograd.Function):
    """All-reduce over the tensor group forward; identity backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        x = x.clone()
        dist.all_reduce(x, group=gpc.get_group(ParallelMode.TENSOR))
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return grad


def _dropout(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dropout on the current RNG stream; returns (output, keep mask)."""
    keep = (torch.rand(x.shape, dtype=torch.float32) >= p).to(x.dtype)
    return x * keep / (1.0 - p), keep


class ParallelMLP(nn.Module):
    """``dropout(W2 · dropout(gelu(W1 x + b1)) + b2)`` with W1 split by rows (column parallel) and W2
    by columns (row parallel) over gpc's tensor group. ``masks`` keeps the last dropout masks."""

    def __init__(
        self, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, p: float
    ) -> None:
        super().__init__()
        tp, rank = gpc.get_world_size(ParallelMode.TENSOR), gpc.get_local_rank(ParallelMode.TENSOR)
        ffn = w1.shape[0]
        if ffn % tp:
            raise ValueError(f"ffn size {ffn} must be divisible by the tensor-parallel size {tp}")
        part = slice(rank * ffn // tp, (rank + 1) * ffn // tp)
        self.w1 = nn.Parameter(w1[part].clone())
        self.b1 = nn.Parameter(b1[part].clone())
        self.w2 = nn.Parameter(w2[:, part].clone())
        self.b2 = nn.Parameter(b2.clone())
        self.p = p
        self.part = part
        self.masks: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(_CopyToTensorGroup.apply(x), self.w1, self.b1))
        with gpc.seed(ParallelMode.TENSOR):  # a different mask on every shard
            h, keep_h = _dropout(h, self.p)
        y = _ReduceFromTensorGroup.apply(F.linear(h, self.w2)) + self.b2
        y, keep_y = _dropout(y, self.p)  # default stream: the same mask on every tensor rank
        self.masks = (keep_h, keep_y)
        return y


def serial_mlp(
    x: torch.Tensor, params: list[torch.Tensor], masks: tuple[torch.Tensor, torch.Tensor], p: float
) -> torch.Tensor:
    """The serial block with given dropout masks: the reference the parallel block must equal."""
    w1, b1, w2, b2 = params
    h = F.gelu(F.linear(x, w1, b1)) * masks[0] / (1.0 - p)
    return (F.linear(h, w2) + b2) * masks[1] / (1.0 - p)


def pipeline_forward_backward(
    block: ParallelMLP, x: torch.Tensor, grad_out: torch.Tensor
) -> torch.Tensor | None:
    """Run one block per pipeline stage: receive the activation from the previous stage, send
    ours on; backward in reverse. Returns the last stage's output (None elsewhere); the first
    stage leaves the input's gradient in ``x.grad``."""
    first, last = gpc.is_pipeline_first_stage(), gpc.is_pipeline_last_stage()
    if not first:
        x = torch.empty_like(x)
        dist.recv(x, src=gpc.get_prev_global_rank(ParallelMode.PIPELINE))
        x.requires_grad_(True)
    y = block(x)
    if not last:
        dist.send(y.detach().contiguous(), dst=gpc.get_next_global_rank(ParallelMode.PIPELINE))
        grad_out = torch.empty_like(y)
        dist.recv(grad_out, src=gpc.get_next_global_rank(ParallelMode.PIPELINE))
    y.backward(grad_out)
    if not first:
        dist.send(x.grad.contiguous(), dst=gpc.get_prev_global_rank(ParallelMode.PIPELINE))
    return y.detach() if last else None
