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
    monkeypatch.setattr(shards, "_layout_text", lambda: "Layout(world_size=4, tensor=4)")
    parallelctx.engines.save(tmp_path / "other", model, opt)
    monkeypatch.undo()
    with pytest.raises(
        ValueError,
        match=r"saved under the layout 'Layout\(world_size=4, tensor=4\)'.*resume with the saved layout",
    ):
        parallelctx.engines.load(tmp_path / "other", model, opt)


@pytest.mark.parallel(world_size=2, tensor=2)
def test_a_folder_not_written_by_save_is_named(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model, _ = _model()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "plain"))
    with pytest.raises(ValueError, match=r"plain was not written by parallelctx.engines.save"):
        parallelctx.engines.load(tmp_path / "plain", model)
