"""The model the engine tests train: a Megatron-style tensor-parallel MLP on gpc's tensor group,
its data, and the serial run it must equal (the whole model on the whole batch in one process).

Every engine test trains ``TPMLP`` for ``STEPS`` SGD steps on its data-parallel share of each
global batch and compares its shard of the weights with :func:`serial_weights`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallelctx import ParallelMode, gpc

HIDDEN, FFN, ROWS, STEPS, LR = 8, 16, 4, 3, 0.1


class _Copy(torch.autograd.Function):
    """Identity forward; gradient all-reduced over the tensor group backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        grad = grad.clone()
        dist.all_reduce(grad, group=gpc.get_group(ParallelMode.TENSOR))
        return grad


class _Reduce(torch.autograd.Function):
    """All-reduce over the tensor group forward; identity backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        x = x.clone()
        dist.all_reduce(x, group=gpc.get_group(ParallelMode.TENSOR))
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return grad


def full_weights(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The serial model's initial weights, the same in every process (a fixed generator)."""
    g = torch.Generator().manual_seed(7)
    shapes = {"w1": (FFN, HIDDEN), "b1": (FFN,), "w2": (HIDDEN, FFN), "b2": (HIDDEN,)}
    return {k: torch.randn(s, generator=g, dtype=dtype) * 0.5 for k, s in shapes.items()}


def shard(weights: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Tensor rank ``rank``'s slice of ``weights``: w1/b1 by rows, w2 by columns, b2 whole."""
    part = slice(rank * FFN // size, (rank + 1) * FFN // size)
    return {
        "w1": weights["w1"][part],
        "b1": weights["b1"][part],
        "w2": weights["w2"][:, part],
        "b2": weights["b2"],
    }


class TPMLP(nn.Module):
    """``W2 · tanh(W1 x + b1) + b2``, W1 split by rows and W2 by columns over gpc's tensor group."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        mine = shard(full_weights(dtype), gpc.tensor.rank, gpc.tensor.size)
        for name, value in mine.items():
            self.register_parameter(name, nn.Parameter(value.clone()))
            # Megatron's mark of a sharded parameter (b2 is replicated): DeepSpeed's gradient norm
            # counts a sharded one on every tensor rank and a replicated one on tensor rank 0 only
            getattr(self, name).tensor_model_parallel = name != "b2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(_Copy.apply(x), self.w1, self.b1))
        return _Reduce.apply(F.linear(h, self.w2)) + self.b2


def batches(replicas: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch per step (``replicas × ROWS`` rows), the same in every process."""
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(replicas * ROWS, HIDDEN, generator=g, dtype=dtype),
         torch.randn(replicas * ROWS, HIDDEN, generator=g, dtype=dtype))
        for _ in range(STEPS)
    ]  # fmt: skip


def my_share(batch: tuple[torch.Tensor, torch.Tensor], replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel replica ``replica``'s rows of a global batch."""
    x, y = batch
    rows = slice(replica * ROWS, (replica + 1) * ROWS)
    return x[rows], y[rows]


def serial_weights(
    replicas: int, dtype: torch.dtype = torch.float32, clip: float | None = None
) -> dict[str, torch.Tensor]:
    """The whole model after ``STEPS`` SGD steps on the whole batches, in this process; with
    ``clip``, the gradient's global norm clipped to it first (every step asserts it is clipped)."""
    w = {k: v.clone().requires_grad_(True) for k, v in full_weights(dtype).items()}
    opt = torch.optim.SGD(list(w.values()), lr=LR)
    for x, y in batches(replicas, dtype):
        opt.zero_grad()
        out = F.linear(torch.tanh(F.linear(x, w["w1"], w["b1"])), w["w2"], w["b2"])
        F.mse_loss(out, y).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(w.values()), clip)
            assert norm > 2 * clip, f"the gradient norm {norm} is not clipped by {clip}"
        opt.step()
    return {k: v.detach() for k, v in w.items()}


def check_equals_serial(
    mine: dict[str, torch.Tensor], atol: float = 1e-6, clip: float | None = None, replicas: int | None = None
) -> float:
    """Compare this rank's trained shard with the serial run's; return the largest difference.

    ``replicas`` is the number of ranks that split each global batch (default: gpc's data size).

    Raises:
        AssertionError: a weight differs by more than ``atol``, or did not change in training.
    """
    dtype = next(iter(mine.values())).dtype
    replicas = gpc.data.size if replicas is None else replicas
    want = shard(serial_weights(replicas, dtype, clip), gpc.tensor.rank, gpc.tensor.size)
    start = shard(full_weights(dtype), gpc.tensor.rank, gpc.tensor.size)
    worst = 0.0
    for name, value in mine.items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
        assert not torch.allclose(value, start[name]), f"{name} did not train"
        worst = max(worst, (value - want[name]).abs().max().item())
    return worst
