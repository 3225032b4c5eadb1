"""torch.distributed.pipelining on gpc's pipeline group, with data=2, equals a serial run.

Each test runs on 8 pooled ranks (pipeline 4 × data 2): the model is cut into stages
(``parallelctx.pipelining.stage_indices``), a torch schedule runs forward and backward over
microbatches on gpc's pipeline group, gradients are averaged over gpc's data group, and after 3
SGD steps every stage's parameters and every step's loss equal the serial model's, trained on the
whole batch in one process (float64).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from parallelctx import ParallelMode, gpc
from parallelctx.pipelining import num_stages, stage_indices, virtual_size

WIDTH, BATCH, MICRO, STEPS, LR = 8, 16, 4, 3, 0.5


def _layers(n: int) -> list[nn.Module]:
    """``n`` stages of the model, the same on every rank (seeded outside gpc's streams)."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double() for _ in range(n)]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch per step (2 replicas × BATCH rows), the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2 * BATCH, WIDTH, generator=g, dtype=torch.float64),
         torch.randn(2 * BATCH, WIDTH, generator=g, dtype=torch.float64))
        for _ in range(STEPS)
    ]  # fmt: skip


def _serial(n: int) -> tuple[list[nn.Module], list[float]]:
    """The whole model trained on the whole batch in this process: (stages after, losses)."""
    layers = _layers(n)
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return layers, losses


def _train(schedule_cls: type) -> None:
    stages_total = num_stages()
    mine = stage_indices()
    layers = _layers(stages_total)
    group = gpc.get_group(ParallelMode.PIPELINE)
    stages = [PipelineStage(layers[i], i, stages_total, gpc.device, group=group) for i in mine]
    loss_fn = nn.functional.mse_loss
    if schedule_cls is ScheduleInterleaved1F1B:
        schedule = schedule_cls(stages, n_microbatches=MICRO, loss_fn=loss_fn)
    else:
        (stage,) = stages
        schedule = schedule_cls(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    params = [p for i in mine for p in layers[i].parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    data = gpc.get_local_rank(ParallelMode.DATA)
    last = stages_total - 1 in mine
    losses = []
    for x, y in _batches():
        x, y = x[data * BATCH : (data + 1) * BATCH], y[data * BATCH : (data + 1) * BATCH]
        opt.zero_grad()
        step_losses: list[torch.Tensor] = []
        if 0 in mine:
            schedule.step(x, target=y if last else None, losses=step_losses if last else None)
        elif last:
            schedule.step(target=y, losses=step_losses)
        else:
            schedule.step()
        for p in params:  # data parallelism: the average gradient of the replicas
            dist.all_reduce(p.grad, group=gpc.get_group(ParallelMode.DATA))
            p.grad /= gpc.get_world_size(ParallelMode.DATA)
        opt.step()
        if last:
            local = torch.stack(step_losses).mean()
            dist.all_reduce(local, group=gpc.get_group(ParallelMode.DATA))
            losses.append(local.item() / gpc.get_world_size(ParallelMode.DATA))
    serial, serial_losses = _serial(stages_total)
    for i in mine:
        for p, q in zip(layers[i].parameters(), serial[i].parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=f"stage {i}")
        assert not torch.equal(layers[i][0].weight, _layers(stages_total)[i][0].weight), "it trained"
    if last:
        assert losses == pytest.approx(serial_losses, rel=1e-12, abs=0)


@pytest.mark.parallel(world_size=8, pipeline=4)
@pytest.mark.parametrize("schedule_cls", [Schedule1F1B, ScheduleGPipe], ids=["1F1B", "GPipe"])
def test_one_stage_per_rank_equals_serial(schedule_cls: type) -> None:
    assert gpc.get_world_size(ParallelMode.DATA) == 2
    assert stage_indices() == [gpc.get_local_rank(ParallelMode.PIPELINE)]
    _train(schedule_cls)


@pytest.mark.parallel(world_size=8, pipeline=dict(size=4, virtual=2))
def test_interleaved_1f1b_with_gpcs_virtual_stages_equals_serial() -> None:
    assert virtual_size() == 2 and num_stages() == 8
    rank = gpc.get_local_rank(ParallelMode.PIPELINE)
    assert stage_indices() == [rank, rank + 4]
    _train(ScheduleInterleaved1F1B)


@pytest.mark.parallel(world_size=2, pipeline=dict(size=2, virtual=0))
def test_a_bad_virtual_size_is_named() -> None:
    with pytest.raises(ValueError, match=r"parallel.pipeline.virtual=0 must be a positive int"):
        stage_indices()


@pytest.mark.parallel(world_size=4, pipeline=dict(size=2, virtual=3))
def test_interleaved_1f1b_with_three_virtual_stages_on_two_ranks_equals_serial() -> None:
    # another shape: 6 stages on pipeline 2 × data 2, rank r holds r, r + 2, r + 4
    rank = gpc.get_local_rank(ParallelMode.PIPELINE)
    assert num_stages() == 6 and stage_indices() == [rank, rank + 2, rank + 4]
    _train(ScheduleInterleaved1F1B)


@pytest.mark.parallel(world_size=2, pipeline=dict(size=2, virtual_pipeline_model_parallel_size=2))
def test_a_misnamed_virtual_key_is_refused_not_read_as_one() -> None:
    # Megatron's name for the setting: silently one stage per rank would be the wrong model cut
    with pytest.raises(
        ValueError, match=r"virtual_pipeline_model_parallel_size=2 .*parallel.pipeline.virtual"
    ):
        stage_indices()
