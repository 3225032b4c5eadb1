"""Two models in one job (examples/modules/two_models.py) on 8 gloo processes equal the serial
models: each module's loss, gradients (its tensor shards and its data-parallel average), and
its dropout masks drawn on its own streams. Colocated (both modules on all 8 ranks, different
grids) and disjoint (vision on ranks 0-1, language on 2-7)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from two_models import serial_step, train_step

from parallelctx import gpc

P = 0.25
COLOCATED = dict(language=dict(ranks=8, tensor=4), vision=dict(colocated_with="language", tensor=2))
DISJOINT = dict(vision=dict(ranks=2), language=dict(ranks=6, tensor=2))


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in ((16, 6), (16,), (6, 16), (6,))]


def _check_against_serial(name: str, seed: int) -> None:
    """Run ``name``'s step on its ranks, gather what every rank saw, compare with serial."""
    ctx = gpc.module(name)
    params, batch = (
        _params(seed),
        torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1)),
    )
    out = train_step(ctx, params, batch, P)
    # each mask is the first draw of the module's own stream (fresh for each test): the seed
    # formula with the module in it, not gpc's primary module's stream
    for keep, stream in zip(out["masks"], ("tensor", "replica")):
        first = torch.rand(keep.shape, generator=torch.Generator().manual_seed(ctx.get_seed(stream)))
        assert torch.equal(keep, (first >= P).to(keep.dtype)), (name, stream)
    mine = (gpc.get_global_rank(), out["rows"], out["part"], out["masks"], out["grads"], out["loss"])
    seen: list[Any] = [None] * ctx.get_world_size("world")
    dist.all_gather_object(seen, mine, group=ctx.get_group("world"))
    # the full masks, assembled from every rank's shard (hidden: by tensor shard and batch rows;
    # output: by batch rows, the same on every tensor rank of a data rank)
    mask_h = torch.zeros(12, 16, dtype=torch.float64)
    mask_y = torch.zeros(12, 6, dtype=torch.float64)
    for _, rows, part, (keep_h, keep_y), _, _ in seen:
        mask_h[rows, part] = keep_h
        mask_y[rows] = keep_y
    loss, grads = serial_step(params, batch, mask_h, mask_y, P)
    assert out["norm"] == pytest.approx(torch.cat([g.flatten() for g in grads]).norm().item(), rel=1e-10)
    assert sum(s[5] for s in seen) / ctx.get_world_size("tensor") == pytest.approx(loss, rel=1e-12)
    for _, _, part, _, g, _ in seen:
        for got, want, sharded in zip(g, grads, (True, True, "cols", False)):
            if sharded is True:
                torch.testing.assert_close(got[part], want[part], rtol=1e-10, atol=1e-12)
            elif sharded == "cols":
                torch.testing.assert_close(got[:, part], want[:, part], rtol=1e-10, atol=1e-12)
            else:
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the output mask agrees across a data rank's tensor ranks (no silent tensor-rank drift)
    for r, rows, _, (_, keep_y), _, _ in seen:
        for r2, rows2, _, (_, keep_y2), _, _ in seen:
            if rows == rows2:
                assert torch.equal(keep_y, keep_y2), (name, r, r2)


@pytest.mark.slow  # the local-world test below runs the same in make test
@pytest.mark.parallel(world_size=8, modules=COLOCATED)
def test_two_colocated_models_train_like_the_serial_ones() -> None:
    _check_against_serial("language", 1)
    _check_against_serial("vision", 2)
    # the two modules' hidden masks differ on the same rank: their streams are their own
    torch.manual_seed(0)
    with gpc.module("vision").seed("tensor"):
        a = torch.rand(64)
    with gpc.module("language").seed("tensor"):
        b = torch.rand(64)
    assert not torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parallel(world_size=8, modules=DISJOINT)
def test_two_disjoint_models_train_like_the_serial_ones() -> None:
    (name,) = gpc.modules
    _check_against_serial(name, 3 if name == "vision" else 4)


@pytest.mark.parallel(world_size=8, modules=COLOCATED, local=True)
def test_two_colocated_models_train_like_the_serial_ones_in_one_process() -> None:
    _check_against_serial("language", 1)
    _check_against_serial("vision", 2)


@pytest.mark.parallel(world_size=8, modules=DISJOINT, local=True)
def test_two_disjoint_models_train_like_the_serial_ones_in_one_process() -> None:
    (name,) = gpc.modules
    _check_against_serial(name, 3 if name == "vision" else 4)
