"""A tensor-parallel MLP written as model code writes one, for the tests of clipping,
checkpoints and DeepSpeed's pipeline (tests/test_clip.py, tests/test_engines_shards.py,
tests/engine_deepspeed_pipe.py), with its data and the serial run it must equal.

``relu(x w1ᵀ + b1) w2ᵀ + b2``: w1 and b1 split by rows and w2 by columns over gpc's tensor group
(marked ``tensor_model_parallel``, as Megatron's layers mark theirs), the partial outputs summed
over the tensor group in the forward, the output bias b2 replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallelctx import ParallelMode, gpc

IN, HIDDEN, OUT, ROWS, STEPS, LR, MAX_NORM = 6, 8, 4, 8, 4, 0.5, 0.05


class _AllReduce(torch.autograd.Function):
    """Sum over the tensor group in the forward, identity in the backward (Megatron's g)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=gpc.get_group(ParallelMode.TENSOR))
        return x

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


class _Copy(torch.autograd.Function):
    """Identity in the forward, sum over the tensor group in the backward (Megatron's f)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=gpc.get_group(ParallelMode.TENSOR))
        return grad


def full_weights(
    seed: int = 0, sizes: tuple[int, int, int] = (IN, HIDDEN, OUT), scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """The whole model's weights (``sizes``: in, hidden, out), drawn from ``seed``; ``scale``
    multiplies w1 and w2."""
    n_in, hidden, out = sizes
    g = torch.Generator().manual_seed(seed)
    w1, b1 = torch.randn(hidden, n_in, generator=g) * scale, torch.randn(hidden, generator=g)
    w2, b2 = torch.randn(out, hidden, generator=g) * scale, torch.randn(out, generator=g)
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}


class MLP(nn.Module):
    """``relu(x w1ᵀ + b1) w2ᵀ + b2``: w1, b1 split by rows and w2 by columns over ``parts``
    (weights from :func:`full_weights` with ``seed``, ``sizes``, ``scale``)."""

    def __init__(
        self,
        part: int = 0,
        parts: int = 1,
        *,
        seed: int = 0,
        sizes: tuple[int, int, int] = (IN, HIDDEN, OUT),
        scale: float = 1.0,
    ) -> None:
        super().__init__()
        full, step = full_weights(seed, sizes, scale), sizes[1] // parts
        rows = slice(part * step, (part + 1) * step)
        self.w1 = nn.Parameter(full["w1"][rows].clone())
        self.b1 = nn.Parameter(full["b1"][rows].clone())
        self.w2 = nn.Parameter(full["w2"][:, rows].clone())
        self.b2 = nn.Parameter(full["b2"].clone())
        self.sharded = parts > 1
        if self.sharded:
            for p in (self.w1, self.b1, self.w2):
                p.tensor_model_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sharded:
            x = _Copy.apply(x)
        y = torch.relu(x @ self.w1.T + self.b1) @ self.w2.T
        if self.sharded:
            y = _AllReduce.apply(y)
        return y + self.b2


def batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(replicas * ROWS, IN, generator=g), torch.randn(replicas * ROWS, OUT, generator=g))
            for _ in range(STEPS)]  # fmt: skip


def serial(
    replicas: int, norm_type: float = 2.0, momentum: float = 0.0, max_norm: float | None = MAX_NORM
) -> tuple[MLP, list[float]]:
    """The whole model trained on the whole batch in this process, clipped at ``max_norm`` by
    torch (None: not clipped): (the model after ``STEPS`` steps, each step's norm before
    clipping)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    norms = []
    for x, y in batches(replicas):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        opt.step()
    return model, norms


def my_rows(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This data rank's ``ROWS`` rows of a global batch."""
    d = gpc.get_local_rank(ParallelMode.DATA)
    return x[d * ROWS : (d + 1) * ROWS], y[d * ROWS : (d + 1) * ROWS]


def shard_of(model: MLP) -> dict[str, torch.Tensor]:
    """This tensor rank's part of the serial ``model``'s parameters, by name."""
    part, parts = gpc.get_local_rank(ParallelMode.TENSOR), gpc.get_world_size(ParallelMode.TENSOR)
    rows = slice(part * HIDDEN // parts, (part + 1) * HIDDEN // parts)
    return {"w1": model.w1[rows], "b1": model.b1[rows], "w2": model.w2[:, rows], "b2": model.b2}
