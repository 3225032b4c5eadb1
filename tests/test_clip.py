"""parallelctx.clip_grad_norm_: clipping a tensor-parallel model by the whole model's norm.

The model is written as a user writes one (tests/user_tp_model.py: a column-parallel and a
row-parallel linear with Megatron's mark, a replicated output bias, the reduce in the forward),
trained on pooled ranks with the gradients averaged over the data group and clipped every step,
and compared with the serial model (whole weights, whole batch, ``torch.nn.utils.clip_grad_norm_``) in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from user_tp_model import LR, MAX_NORM, MLP, ROWS, batches, serial, shard_of

import parallelctx
from parallelctx import ParallelMode, gpc


def _train(norm_type: float) -> tuple[MLP, list[float]]:
    data, replicas = gpc.get_local_rank(ParallelMode.DATA), gpc.get_world_size(ParallelMode.DATA)
    model = MLP(gpc.get_local_rank(ParallelMode.TENSOR), gpc.get_world_size(ParallelMode.TENSOR))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for x, y in batches(replicas):
        x, y = x[data * ROWS : (data + 1) * ROWS], y[data * ROWS : (data + 1) * ROWS]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():  # the data replicas' average, as DDP gives it
            dist.all_reduce(p.grad, group=gpc.get_group(ParallelMode.DATA))
            p.grad /= replicas
        norms.append(float(parallelctx.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)))
        opt.step()
    return model, norms


@pytest.mark.parallel(world_size=4, tensor=2)
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clipped_tensor_parallel_training_equals_the_serial_clipped_run(norm_type: float) -> None:
    model, norms = _train(norm_type)
    serial_model, serial_norms = serial(gpc.get_world_size(ParallelMode.DATA), norm_type)
    assert min(serial_norms) > MAX_NORM, "every step clips"
    assert norms == pytest.approx(serial_norms, rel=1e-5)
    want = shard_of(serial_model)
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
    x, y = batches(2)[0]
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
    x, y = batches(1)[0]
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


@pytest.mark.parallel(world_size=2, tensor=2)
def test_an_unmarked_shard_holding_the_other_ranks_values_in_another_order_is_named() -> None:
    # equal sums and sums of squares on both tensor ranks: only the order tells the shards apart
    values = torch.arange(6.0)
    p = nn.Parameter(values if gpc.get_local_rank(ParallelMode.TENSOR) == 0 else values.flip(0))
    p.grad = torch.ones(6)
    with pytest.raises(
        ValueError, match=r"parameter 0 of those given \(shape \[6\]\) has no tensor_model_parallel"
    ):
        parallelctx.grad_norm([p])
    p.tensor_model_parallel = True  # type: ignore[attr-defined]
    assert parallelctx.grad_norm([p]).item() == pytest.approx(12**0.5)


@pytest.mark.parallel(world_size=2, tensor=2)
def test_a_zero_initialised_shard_without_the_mark_is_named_by_its_gradient() -> None:
    # equal values on both ranks (zeros, as Megatron initialises biases), different gradients
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 1.0 + gpc.get_local_rank(ParallelMode.TENSOR))
    with pytest.raises(ValueError, match=r"parameter 0 of those given \(shape \[4\]\).*its gradients differ"):
        parallelctx.grad_norm([p])


@pytest.mark.parallel(world_size=2, tensor=2)
def test_different_parameter_counts_on_a_tensor_group_are_named_not_crashed() -> None:
    params = [nn.Parameter(torch.ones(2)) for _ in range(1 + gpc.get_local_rank(ParallelMode.TENSOR))]
    for p in params:
        p.grad = torch.ones(2)
    with pytest.raises(
        ValueError, match=r"hold from 1 to 2 parameters without the tensor_model_parallel mark"
    ):
        parallelctx.grad_norm(params)


@pytest.mark.parallel(world_size=2, pipeline=2)
def test_megatrons_shared_copy_of_a_tied_embedding_is_counted_once() -> None:
    # both stages hold the embedding (gradient 1 each, 4 entries); the last stage's copy is shared
    emb = nn.Parameter(torch.zeros(4))
    emb.grad = torch.ones(4)
    if gpc.get_local_rank(ParallelMode.PIPELINE) == 1:
        emb.shared = True  # type: ignore[attr-defined]
    assert parallelctx.grad_norm([emb]).item() == pytest.approx(2.0)


@pytest.mark.parallel(world_size=2, tensor=2)
def test_a_nan_on_any_rank_makes_the_inf_norm_nan_on_every_rank() -> None:
    # gloo's MAX keeps a nan only from the group's first rank: the last rank's nan must still count
    p = nn.Parameter(torch.zeros(2))
    p.tensor_model_parallel = True  # type: ignore[attr-defined]
    p.grad = torch.tensor([1.0, float("nan") if gpc.get_global_rank() == 1 else 2.0])
    assert parallelctx.grad_norm([p], float("inf")).isnan()
    with pytest.raises(RuntimeError, match=r"gradient norm \(order inf\) is nan"):
        parallelctx.clip_grad_norm_([p], 1.0, float("inf"), error_if_nonfinite=True)


@pytest.mark.parallel(world_size=2, tensor=2)
def test_float64_gradients_are_normed_in_float64() -> None:
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.tensor_model_parallel = True  # type: ignore[attr-defined]
    p.grad = torch.full((3,), 1e20, dtype=torch.float64)
    norm = parallelctx.grad_norm([p])
    assert norm.dtype == torch.float64 and norm.item() == pytest.approx((6 * 1e40) ** 0.5, rel=1e-12)


@pytest.mark.parallel(world_size=2, config={"parallel": {"gtp_remat": 2}})
def test_gtp_remat_is_refused_naming_megatrons_optimizer() -> None:
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"gtp_remat=2 .*megatron.core.optimizer"):
        parallelctx.grad_norm([p])
