"""Two models in one job, each on its own layout (``parallel.modules``): a tensor-parallel MLP
per module, written against a context (``gpc.module(name)``) instead of the global ``gpc``,
trained one data-parallel step on its module's data ranks. Tested against the serial models in
test_two_models.py.

Every collective names its module's group: the tensor all-reduces ``ctx.get_group("tensor")``,
the gradient average ``ctx.get_group("data")``; dropout inside the tensor-parallel region draws
on the module's tensor stream (``ctx.seed("tensor")``), outside it on the module's data-replica
stream (``ctx.seed("replica")``), so two colocated modules never share a mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallelctx.clip import grad_norm


class _Copy(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over ``group`` backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[no-untyped-def, override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """All-reduce over ``group`` forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[no-untyped-def, override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return grad, None


def _dropout(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    keep = (torch.rand(x.shape, dtype=torch.float32) >= p).to(x.dtype)
    return x * keep / (1.0 - p), keep


class ModuleMLP(nn.Module):
    """``dropout(W2 · dropout(gelu(W1 x + b1)) + b2)``, W1 split by rows and W2 by columns over
    the tensor group of ``ctx`` (a module's context). ``masks`` keeps the last dropout masks."""

    def __init__(self, ctx: Any, params: list[torch.Tensor], p: float) -> None:
        super().__init__()
        w1, b1, w2, b2 = params
        tp, rank = ctx.get_world_size("tensor"), ctx.get_local_rank("tensor")
        part = slice(rank * w1.shape[0] // tp, (rank + 1) * w1.shape[0] // tp)
        self.ctx, self.p, self.part = ctx, p, part
        self.w1 = nn.Parameter(w1[part].clone())
        self.b1 = nn.Parameter(b1[part].clone())
        self.w2 = nn.Parameter(w2[:, part].clone())
        self.b2 = nn.Parameter(b2.clone())
        for shard in (self.w1, self.b1, self.w2):  # Megatron's mark: a shard, not a replica
            shard.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.masks: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.ctx.get_group("tensor")
        h = F.gelu(F.linear(_Copy.apply(x, group), self.w1, self.b1))
        with self.ctx.seed("tensor"):
            h, keep_h = _dropout(h, self.p)
        y = _Reduce.apply(F.linear(h, self.w2), group) + self.b2
        with self.ctx.seed("replica"):
            y, keep_y = _dropout(y, self.p)
        self.masks = (keep_h, keep_y)
        return y


def train_step(ctx: Any, params: list[torch.Tensor], batch: torch.Tensor, p: float) -> dict[str, Any]:
    """One data-parallel step of the module of ``ctx``: this data rank's slice of ``batch``,
    loss ``sum(y**2) / len(batch)`` (divided by the whole batch), so the gradients summed over
    the module's data group are the whole batch's.

    Returns:
        ``{"loss": this slice's loss, "norm": the whole model's gradient norm, "grads": full-size gradients of W1, b1, W2, b2 (this tensor
        rank's shard in place, zeros elsewhere), "masks": (hidden mask, output mask), "rows":
        the slice of the batch}``.
    """
    model = ModuleMLP(ctx, params, p)
    dp, d = ctx.get_world_size("data"), ctx.get_local_rank("data")
    rows = slice(d * len(batch) // dp, (d + 1) * len(batch) // dp)
    y = model(batch[rows])
    loss = (y**2).sum() / len(batch)
    loss.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, group=ctx.get_group("data"))
    norm = grad_norm(model.parameters(), ctx=ctx)  # the whole model's, over the module's groups
    full = [torch.zeros_like(t) for t in params]
    full[0][model.part] = model.w1.grad
    full[1][model.part] = model.b1.grad
    full[2][:, model.part] = model.w2.grad
    full[3] = model.b2.grad
    assert model.masks is not None
    return {
        "loss": loss.item(),
        "norm": norm.item(),
        "grads": full,
        "masks": model.masks,
        "rows": rows,
        "part": model.part,
    }


def serial_step(
    params: list[torch.Tensor], batch: torch.Tensor, masks_h: torch.Tensor, masks_y: torch.Tensor, p: float
) -> tuple[float, list[torch.Tensor]]:
    """The serial model's step on the whole batch with the given dropout masks (full size)."""
    w = [t.clone().requires_grad_(True) for t in params]
    h = F.gelu(F.linear(batch, w[0], w[1])) * masks_h / (1.0 - p)
    y = (F.linear(h, w[2]) + w[3]) * masks_y / (1.0 - p)
    loss = (y**2).sum() / len(batch)
    loss.backward()
    return loss.item(), [t.grad for t in w]
