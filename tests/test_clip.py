"""parallelctx.clip_grad_norm_: clipping a tensor-parallel model by the whole model's norm.

The model is written as a user writes one (a column-parallel and a row-parallel linear with
Megatron's mark, a replicated output bias, the reduce in the forward), trained on pooled ranks
with the gradients averaged over the data group and clipped every step, and compared with the
serial model (whole weights, whole batch, ``torch.nn.utils.clip_grad_norm_``) in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import parallelctx
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


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(HIDDEN, IN, generator=g),
        "b1": torch.randn(HIDDEN, generator=g),
        "w2": torch.randn(OUT, HIDDEN, generator=g),
        "b2": torch.randn(OUT, generator=g),
    }


class MLP(nn.Module):
    """``relu(x w1ᵀ + b1) w2ᵀ + b2``: w1, b1 split by rows and w2 by columns over ``parts``."""

    def __init__(self, part: int = 0, parts: int = 1) -> None:
        super().__init__()
        full, step = _full(), HIDDEN // parts
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


def _batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(replicas * ROWS, IN, generator=g), torch.randn(replicas * ROWS, OUT, generator=g))
            for _ in range(STEPS)]  # fmt: skip


def _serial(replicas: int, norm_type: float) -> tuple[MLP, list[float]]:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for x, y in _batches(replicas):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        opt.step()
    return model, norms


def _train(norm_type: float) -> tuple[MLP, list[float]]:
    data, replicas = gpc.get_local_rank(ParallelMode.DATA), gpc.get_world_size(ParallelMode.DATA)
    model = MLP(gpc.get_local_rank(ParallelMode.TENSOR), gpc.get_world_size(ParallelMode.TENSOR))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for x, y in _batches(replicas):
        x, y = x[data * ROWS : (data + 1) * ROWS], y[data * ROWS : (data + 1) * ROWS]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():  # the data replicas' average, as DDP gives it
            dist.all_reduce(p.grad, group=gpc.get_group(ParallelMode.DATA))
            p.grad /= replicas
        norms.append(float(parallelctx.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        opt.step()
    return model, norms


def _shard(serial: MLP) -> dict[str, torch.Tensor]:
    part, parts = gpc.get_local_rank(ParallelMode.TENSOR), gpc.get_world_size(ParallelMode.TENSOR)
    rows = slice(part * HIDDEN // parts, (part + 1) * HIDDEN // parts)
    return {"w1": serial.w1[rows], "b1": serial.b1[rows], "w2": serial.w2[:, rows], "b2": serial.b2}


@pytest.mark.parallel(world_size=4, tensor=2)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clipped_tensor_parallel_training_equals_the_serial_clipped_run(norm_type: float) -> None:
    model, norms = _train(norm_type)
    serial, serial_norms = _serial(gpc.get_world_size(ParallelMode.DATA), norm_type)
    assert min(serial_norms) > MAX_NORM, "every step clips"
    assert norms == pytest.approx(serial_norms, rel=1e-5)
    want = _shard(serial)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name].detach(), rtol=0, atol=1e-5, msg=name)
    # the replicated bias is the same tensor on both tensor ranks (gathered, not read back)
    both = [torch.empty_like(model.b2) for _ in range(2)]
    dist.all_gather(both, model.b2.detach(), group=gpc.get_group(ParallelMode.TENSOR))
    assert torch.equal(both[0], both[1])


@pytest.mark.parallel(world_size=4, tensor=2)
def test_torchs_own_clip_on_the_shards_clips_by_the_wrong_norm() -> None:
    # the control: the shard norm differs from the model's, which is why the replicas drift
    model = MLP(gpc.get_local_rank(ParallelMode.TENSOR), 2)
    x, y = _batches(2)[0]
    nn.functional.mse_loss(model(x), y).backward()
    mine = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    whole = float(parallelctx.grad_norm(model.parameters()))
    serial = MLP()
    nn.functional.mse_loss(serial(x), y).backward()
    assert whole == pytest.approx(
        float(torch.nn.utils.get_total_norm([p.grad for p in serial.parameters()])), rel=1e-5
    )
    assert abs(mine - whole) > 1e-3 * whole


@pytest.mark.parallel(world_size=2, tensor=2)
def test_a_shard_without_the_mark_is_named_on_every_rank() -> None:
    model = MLP(gpc.get_local_rank(ParallelMode.TENSOR), 2)
    del model.w2.tensor_model_parallel  # type: ignore[attr-defined]
    x, y = _batches(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(
        ValueError, match=r"parameter 2 .*shape \[4, 4\].*no tensor_model_parallel mark.*ranks \[0, 1\]"
    ):
        parallelctx.clip_grad_norm_(model.parameters(), MAX_NORM)
    # the group is still in step after the refusal on both ranks
    one = torch.ones(())
    dist.all_reduce(one, group=gpc.get_group(ParallelMode.TENSOR))
    assert one.item() == 2.0


@pytest.mark.parallel(world_size=2, pipeline=2)
def test_each_pipeline_stage_counts_its_own_layers() -> None:
    # stage s holds a parameter whose gradient is all (s + 1): the norm is over both stages
    stage = gpc.get_local_rank(ParallelMode.PIPELINE)
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), float(stage + 1))
    norm = parallelctx.clip_grad_norm_([p], max_norm=1.0)
    assert norm.item() == pytest.approx((3 * 1 + 3 * 4) ** 0.5, rel=1e-6)
    assert p.grad.tolist() == pytest.approx([(stage + 1) / (15**0.5)] * 3, rel=1e-5)


@pytest.mark.parallel(world_size=2, tensor=2)
def test_a_bad_norm_type_and_a_nonfinite_norm_are_named() -> None:
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([1.0, float("nan")])
    with pytest.raises(ValueError, match=r"norm_type=0.0 must be positive"):
        parallelctx.clip_grad_norm_([p], 1.0, norm_type=0)
    with pytest.raises(RuntimeError, match=r"gradient norm .* is nan; set error_if_nonfinite=False"):
        parallelctx.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
