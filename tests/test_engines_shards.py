"""parallelctx.engines.save / load: a tensor-parallel model and its optimizer resume equal to
continuing, every shard from its own rank's part of the checkpoint.

The model is the user-style tensor-parallel MLP of tests/user_tp_model.py; SGD with momentum, so the
optimizer's state matters. Every rank trains 2 steps, saves, trains 2 more; a fresh model and
optimizer (initialised differently) load the checkpoint and train the same 2 steps: every
parameter and momentum buffer equals the continued run exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from user_tp_model import MLP, ROWS, batches

import parallelctx.engines
from parallelctx import ParallelMode, gpc
from parallelctx.engines import shards


def _model(seed_shift: float = 0.0) -> tuple[MLP, torch.optim.Optimizer]:
    model = MLP(gpc.get_local_rank(ParallelMode.TENSOR), gpc.get_world_size(ParallelMode.TENSOR))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(seed_shift)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _steps(model: MLP, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    data, replicas = gpc.get_local_rank(ParallelMode.DATA), gpc.get_world_size(ParallelMode.DATA)
    for x, y in batches:
        x, y = x[data * ROWS : (data + 1) * ROWS], y[data * ROWS : (data + 1) * ROWS]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=gpc.get_group(ParallelMode.DATA))
            p.grad /= replicas
        opt.step()


@pytest.mark.parallel(world_size=4, tensor=2)
def test_save_then_load_into_a_fresh_model_equals_continuing(tmp_path: Path) -> None:
    steps = batches(gpc.get_world_size(ParallelMode.DATA))
    model, opt = _model()
    _steps(model, opt, steps[:2])
    parallelctx.engines.save(tmp_path / "ckpt", model, opt)
    _steps(model, opt, steps[2:])

    fresh, fresh_opt = _model(seed_shift=1.0)
    parallelctx.engines.load(tmp_path / "ckpt", fresh, fresh_opt)
    _steps(fresh, fresh_opt, steps[2:])
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert torch.equal(opt.state[p]["momentum_buffer"], fresh_opt.state[q]["momentum_buffer"]), name
    # each tensor rank resumed its own shard: the two ranks' w1 differ (gathered)
    both = [torch.empty_like(fresh.w1) for _ in range(2)]
    dist.all_gather(both, fresh.w1.detach(), group=gpc.get_group(ParallelMode.TENSOR))
    assert not torch.equal(both[0], both[1])


@pytest.mark.parallel(world_size=4, tensor=2)
def test_a_checkpoint_of_another_layout_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    monkeypatch.setattr(shards, "_layout_text", lambda: "tensor=4 pipeline=1")
    parallelctx.engines.save(tmp_path / "other", model, opt)
    monkeypatch.undo()
    with pytest.raises(
        ValueError,
        match=r"saved with 'tensor=4 pipeline=1', and this job runs 'tensor=2 pipeline=1 expert=1.*resume with the saved model-parallel sizes",
    ):
        parallelctx.engines.load(tmp_path / "other", model, opt)


@pytest.mark.parallel(world_size=2, tensor=2)
def test_a_folder_not_written_by_save_is_named(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model, _ = _model()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "plain"))
    with pytest.raises(ValueError, match=r"plain was not written by parallelctx.engines.save"):
        parallelctx.engines.load(tmp_path / "plain", model)


@pytest.mark.parallel(world_size=4, tensor=2, config={"parallel": {"gtp_remat": 2}})
def test_gtp_remat_shards_are_kept_apart(tmp_path: Path) -> None:
    # tensor 2 x gtp_remat 2: four shards, each rank resumes its own (the key names the gtp rank)
    me = float(gpc.get_global_rank())
    model = nn.Linear(3, 3)
    with torch.no_grad():
        model.weight.fill_(me)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    parallelctx.engines.save(tmp_path / "gtp", model, opt)
    before = model.weight.detach().clone(), opt.state[model.weight]["momentum_buffer"].clone()
    fresh = nn.Linear(3, 3)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    parallelctx.engines.load(tmp_path / "gtp", fresh, fresh_opt)
    assert torch.equal(fresh.weight, before[0])
    assert torch.equal(fresh_opt.state[fresh.weight]["momentum_buffer"], before[1])


@pytest.mark.parallel(world_size=2, tensor=2)
def test_a_model_only_checkpoint_loaded_with_an_optimizer_is_named(tmp_path: Path) -> None:
    model, opt = _model()
    parallelctx.engines.save(tmp_path / "model-only", model)
    with pytest.raises(ValueError, match=r"holds no optimizer state \(it was saved without one\)"):
        parallelctx.engines.load(tmp_path / "model-only", model, opt)
    parallelctx.engines.load(tmp_path / "model-only", model)  # the group is still in step


@pytest.mark.parallel(world_size=2, tensor=2)
def test_a_rank_that_cannot_save_stops_every_rank_at_once(tmp_path: Path) -> None:
    class Broken(nn.Linear):
        def state_dict(self, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
            raise RuntimeError("disk of rank 1")

    model = Broken(2, 2) if gpc.get_global_rank() == 1 else nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"disk of rank 1|rank 1 could not use the checkpoint"):
        parallelctx.engines.save(tmp_path / "broken", model)
