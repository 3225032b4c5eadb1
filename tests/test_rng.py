"""RNG streams that model code relies on: checkpoint recomputation, save/restore, pinned seeds,
and the equal/different table of docs/seeds.md checked on 8 real ranks."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as tc
from mp_workers import seed_table_worker

import parallelctx
from parallelctx import REPLICA, ParallelMode, gpc, plan
from parallelctx.checkpoint import _Replay
from parallelctx.seed import STREAM_SLOTS, STREAMS, mode_seed

ROOT = Path(__file__).resolve().parent.parent
M = ParallelMode


@pytest.fixture
def launched(world_of_one: Any) -> None:
    world_of_one({"parallel": {"tensor": 1}, "seed": 77})


# ----------------------------------------------------------------------------- checkpoint
def _block(x: torch.Tensor) -> torch.Tensor:
    """A region that draws on the default stream and on two mode streams, nested."""
    y = torch.nn.functional.dropout(x, 0.2)  # default stream
    with gpc.seed(M.TENSOR):
        y = torch.nn.functional.dropout(y, 0.5)
        with gpc.seed(M.DATA):
            y = torch.nn.functional.dropout(y.tanh(), 0.3)
    with gpc.seed(REPLICA):
        y = y + torch.rand_like(y)
    return y * 3


def _nested(ck: Callable[..., Any], reentrant: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def outer(x: torch.Tensor) -> torch.Tensor:
        with gpc.seed(M.CONTEXT):
            x = torch.nn.functional.dropout(x, 0.4)
        return ck(_block, x.sin(), use_reentrant=reentrant) + x

    return outer


def _after_draws() -> list[torch.Tensor]:
    """One draw from every stream: where each stream stands."""
    out = [torch.rand(4)]
    for stream in STREAMS:
        with gpc.seed(stream):
            out.append(torch.rand(4))
    return out


def _train_step(ck: Callable[..., Any] | None, reentrant: bool, nested: bool) -> tuple[Any, ...]:
    start = gpc.get_rng_state()
    x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    h = x @ w
    if ck is None:
        out = (_nested(lambda f, *a, use_reentrant: f(*a), reentrant) if nested else _block)(h)
    elif nested:
        out = ck(_nested(ck, reentrant), h, use_reentrant=reentrant)
    else:
        out = ck(_block, h, use_reentrant=reentrant)
    (out**2).sum().backward()
    result = (out.detach(), x.grad, w.grad, _after_draws())
    gpc.set_rng_state(start)
    return result


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        torch.equal(a[0], b[0])
        and torch.equal(a[1], b[1])
        and torch.equal(a[2], b[2])
        and all(torch.equal(p, q) for p, q in zip(a[3], b[3]))
    )


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # torch, nested reentrant
@pytest.mark.parametrize("nested", [False, True], ids=["one-region", "nested"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_is_bit_exact_with_mode_streams(launched: None, reentrant: bool, nested: bool) -> None:
    plain = _train_step(None, reentrant, nested)
    assert _same(plain, _train_step(None, reentrant, nested))  # the reference is repeatable
    assert _same(plain, _train_step(parallelctx.checkpoint, reentrant, nested))
    # torch's own checkpoint recomputes with the mode streams advanced: the bug this fixes
    assert not _same(plain, _train_step(tc.checkpoint, reentrant, nested))


@pytest.mark.parametrize("nested", [False, True], ids=["one-region", "nested"])
def test_rng_context_fn_with_torch_checkpoint(launched: None, nested: bool) -> None:
    def ck(fn: Callable[..., Any], *args: Any, use_reentrant: bool) -> Any:
        return tc.checkpoint(fn, *args, use_reentrant=False, context_fn=parallelctx.rng_context_fn)

    assert _same(_train_step(None, False, nested), _train_step(ck, False, nested))


def test_checkpoint_without_the_restore_fails(launched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # remove the save/restore: the same comparison must then catch the wrong masks
    import contextlib

    monkeypatch.setattr(_Replay, "recompute", lambda self: contextlib.nullcontext())
    for reentrant in (True, False):
        assert not _same(
            _train_step(None, reentrant, False), _train_step(parallelctx.checkpoint, reentrant, False)
        )


def test_checkpoint_before_launch_is_torchs() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    parallelctx.checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    assert torch.equal(x.grad, torch.cos(x).detach())


# ----------------------------------------------------------------------------- RNG state
def _draw_everything() -> list[Any]:
    return [random.random(), float(np.random.rand()), *[t.tolist() for t in _after_draws()]]


def test_rng_state_restores_every_stream(launched: None) -> None:
    state = gpc.get_rng_state()
    first = _draw_everything()
    assert _draw_everything() != first  # the streams moved on
    gpc.set_rng_state(state)
    assert _draw_everything() == first
    gpc.set_rng_state(pickle.loads(pickle.dumps(state)))  # survives a checkpoint file
    assert _draw_everything() == first


def test_rng_state_restored_inside_a_seed_block(launched: None) -> None:
    state = gpc.get_rng_state()
    with gpc.seed(M.TENSOR):
        a = torch.rand(3)
    gpc.set_rng_state(state)
    with gpc.seed(M.TENSOR):
        gpc.set_rng_state(state)  # the block keeps running on the TENSOR stream
        b = torch.rand(3)
    assert torch.equal(a, b)


def test_rng_state_from_elsewhere_is_refused(launched: None) -> None:
    state = gpc.get_rng_state()
    with pytest.raises(ValueError, match="rank 3 there, 0 here"):
        gpc.set_rng_state(dataclasses.replace(state, rank=3))
    with pytest.raises(ValueError, match="world_size 8 there, 1 here"):
        gpc.set_rng_state(dataclasses.replace(state, world_size=8))
    with pytest.raises(ValueError, match="layout 'world=8 tp=2"):
        gpc.set_rng_state(dataclasses.replace(state, layout=plan(8, tensor=2).describe()))
    with pytest.raises(TypeError, match="what gpc.get_rng_state\\(\\) returned"):
        gpc.set_rng_state({"rank": 0})  # type: ignore[arg-type]


def test_rng_state_before_launch_raises() -> None:
    with pytest.raises(parallelctx.NotLaunchedError):
        gpc.get_rng_state()


# ----------------------------------------------------------------------------- seeds
def test_seeds_are_pinned() -> None:
    # Today's seeds, written out: a change here breaks every bit-exact resume.
    layout = plan(16, tensor=2, pipeline=2, context=2, expert=2)
    pinned = {
        "global": [1234, 1234, 1235, 1235],
        "tensor": [4294968530, 4294968531, 4294968533, 4294968533],
        "pipeline": [8589935826, 8589935826, 8589935827, 8589935827],
        "data": [12884903122, 12884903122, 12884903123, 12884903123],
        "context": [17179870418, 17179870418, 17179870421, 17179870421],
        "model": [21474837714, 21474837715, 21474837717, 21474837717],
        "data_context": [25769805010, 25769805010, 25769805011, 25769805011],
        "embedding": [30064772306, 30064772306, 30064772307, 30064772307],
        "expert": [34359739602, 34359739603, 34359739609, 34359739609],
        "expert_tensor": [38654706898, 38654706899, 38654706901, 38654706901],
        "expert_data": [42949674194, 42949674194, 42949674195, 42949674195],
        "expert_tensor_and_expert": [47244641490, 47244641491, 47244641497, 47244641497],
        "expert_model": [51539608786, 51539608787, 51539608793, 51539608793],
        "data_shard": [55834576082, 55834576082, 55834576083, 55834576083],
        "data_replicate": [60129543378, 60129543378, 60129543379, 60129543379],
        "data_shard_context": [64424510674, 64424510674, 64424510675, 64424510675],
        "expert_data_shard": [68719477970, 68719477970, 68719477971, 68719477971],
        "expert_data_replicate": [73014445266, 73014445266, 73014445267, 73014445267],
        "replica": [274877908178, 274877908179, 274877908180, 274877908181],
    }
    got = {str(k): [mode_seed(layout, r, k, 1234) for r in (0, 5, 11, 15)] for k in STREAMS}
    assert got == pinned
    assert set(STREAM_SLOTS) == set(STREAMS) and len(set(STREAM_SLOTS.values())) == len(STREAMS)


def test_replica_stream_is_a_stream_name(launched: None) -> None:
    assert gpc.get_seed("replica") == gpc.get_seed(REPLICA) == 77 + 64 * 2**32
    with pytest.raises(parallelctx.LayoutError, match="unknown parallel mode 'replicas'"):
        gpc.get_seed("replicas")


# ----------------------------------------------------------------------------- 8 ranks
def _doc_table() -> dict[str, dict[str, str]]:
    text = (ROOT / "docs" / "seeds.md").read_text()
    section = text.split("## Equal or different across ranks", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| [a-z_]+ \| (same|differs) ", line)]
    table = {}
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0]] = dict(zip(("tp", "cp", "dp", "pp", "ep"), cells[1:]))
    return table


AXIS_MODE = {"tp": M.TENSOR, "cp": M.CONTEXT, "dp": M.DATA, "pp": M.PIPELINE, "ep": M.EXPERT}


@pytest.mark.timeout(400)
def test_seed_table_holds_on_8_ranks(tmp_path: Path) -> None:
    table = _doc_table()
    assert set(table) == {str(s) for s in STREAMS}, "docs/seeds.md must have a row per stream"
    layouts = {"a": {"tensor": 2, "pipeline": 2, "expert": 2}, "b": {"tensor": 2, "context": 2}}
    parallelctx.spawn(
        seed_table_worker,
        8,
        args=(str(tmp_path), layouts),
        config={"parallel": layouts["a"]},
        backend="gloo",
        timeout=120,
        join_timeout=300,
    )
    draws = {k: json.loads((tmp_path / f"{k}.json").read_text()) for k in layouts}
    checked = 0
    for axis, mode in AXIS_MODE.items():
        which = "b" if axis == "cp" else "a"
        layout = plan(8, **{k: v for k, v in layouts[which].items()})
        for stream, cells in table.items():
            for group in layout.groups(mode):
                values = {tuple(draws[which][str(r)][stream]) for r in group}
                seen = "same" if len(values) == 1 else "differs" if len(values) == len(group) else "mixed"
                assert seen == cells[axis], (
                    f"{stream} across {axis} group {group}: {seen}, docs say {cells[axis]}"
                )
                checked += 1
    assert checked == len(table) * (4 + 4 + 4 + 4 + 4)  # every cell, on every group of its mode
