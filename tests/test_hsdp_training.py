"""FSDP2 on gpc's device mesh: HSDP (replicate × shard) and HSDP + TP training equals a serial run,
as model code writes it (``fully_shard(model, mesh=gpc.device_mesh["dp_replicate", "dp_shard"])``).

A tiny float64 MLP trains a few SGD steps on a global batch that the data-parallel ranks split;
FSDP2 averages the gradients over the data axis, so the loss of every step and the final
weights equal the serial model's on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallelctx import ParallelMode, gpc

STEPS, BATCH, LR = 3, 16, 0.1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 8, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, 4, generator=gen, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def _serial() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _data():
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(model: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train on this data rank's rows; return the global losses and the full weights."""
    rank, size = gpc.get_local_rank(ParallelMode.DATA), gpc.get_world_size(ParallelMode.DATA)
    rows = BATCH // size
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _data():
        mine = slice(rank * rows, (rank + 1) * rows)
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=gpc.get_group(ParallelMode.DATA))
        losses.append(total.item() / size)
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
        for k, v in model.state_dict().items()
    }
    return losses, full


def _check(losses: list[float], weights: dict[str, torch.Tensor]) -> None:
    want_losses, want_weights = _serial()
    assert losses == pytest.approx(want_losses, rel=1e-12, abs=1e-12)
    assert set(weights) == set(want_weights)
    for key, value in weights.items():
        torch.testing.assert_close(value, want_weights[key], rtol=1e-12, atol=1e-12)
    assert any(not torch.equal(v, _model().state_dict()[k]) for k, v in weights.items()), "nothing trained"


@pytest.mark.parallel(world_size=4, data=dict(replicate=2, shard=2))
def test_fsdp2_hsdp_equals_serial() -> None:
    from torch.distributed.fsdp import fully_shard

    mesh = gpc.device_mesh["dp_replicate", "dp_shard"]
    assert mesh.shape == (2, 2)
    model = _model()
    fully_shard(model, mesh=mesh)
    # HSDP: every parameter is sharded over dp_shard and replicated over dp_replicate
    weight = model[0].weight
    from torch.distributed.tensor import Replicate, Shard

    assert tuple(weight.placements) == (Replicate(), Shard(0))
    assert weight.to_local().shape[0] == 16 // 2
    _check(*_train(model))


@pytest.mark.parallel(world_size=8, tensor=2, data=dict(replicate=2, shard=2))
@pytest.mark.slow
def test_fsdp2_hsdp_with_tensor_parallel_equals_serial() -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = gpc.device_mesh
    model = _model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    weight = model[0].weight
    assert weight.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
    assert weight.to_local().shape[0] == 16 // 2 // 2  # columns split over tp, then rows over dp_shard
    assert mesh["tp"].get_group() is gpc.get_group(ParallelMode.TENSOR)
    _check(*_train(model))


@pytest.mark.parallel(world_size=4, data=dict(replicate=2, shard=2))
def test_flattened_dp_dim_is_gpcs_data_group() -> None:
    import warnings

    with warnings.catch_warnings():  # torch warns that slicing a flattened dim from the root is deprecated
        warnings.simplefilter("ignore")
        dp = gpc.device_mesh["dp"]
    assert dp.get_group() is gpc.get_group(ParallelMode.DATA)
    assert dp.mesh.tolist() == gpc.get_ranks_in_group(ParallelMode.DATA)


@pytest.mark.parallel(world_size=8, tensor=2, data=dict(replicate=2), expert=dict(size=2, tensor=1))
def test_queries_groups_and_streams_of_the_hsdp_modes() -> None:
    from parallelctx.testing import assert_same_across

    layout = gpc.layout
    rank = gpc.get_global_rank()
    assert (layout.replicate, layout.shard, layout.expert_shard) == (2, 2, 2)
    for mode in (
        ParallelMode.DATA_SHARD,
        ParallelMode.DATA_REPLICATE,
        ParallelMode.DATA_SHARD_CONTEXT,
        ParallelMode.EXPERT_DATA_SHARD,
        ParallelMode.EXPERT_DATA_REPLICATE,
    ):
        members = layout.group_of(mode, rank)
        assert gpc.get_ranks_in_group(mode) == members
        assert gpc.get_local_rank(mode) == members.index(rank) == getattr(gpc, mode.value).rank
        assert gpc.get_world_size(mode) == len(members) == 2
        # the group holds those ranks: an all-gather of global ranks over it
        got = [torch.zeros(1, dtype=torch.int64) for _ in members]
        dist.all_gather(got, torch.tensor([rank]), group=gpc.get_group(mode))
        assert [int(t) for t in got] == members
        with gpc.seed(mode):
            draw = torch.rand(3)
        assert_same_across(mode, draw)  # one stream per group (and per stage), like DATA
    assert gpc.get_ranks_in_group("dp_shard") == layout.group_of(ParallelMode.DATA_SHARD, rank)
