"""What the layered redesign (issue 34) promises users: the InternLM steps make the same world as
``launch()``; every old module path is the same module; an RNGState pickled by the release before
the move still restores the same draws."""

from __future__ import annotations

import importlib
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_helpers import run_torchrun, run_torchrun_env

import parallelctx
from parallelctx import REPLICA, ParallelMode, gpc

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


def _check_same(record: dict) -> None:
    launched, steps = record["launch"], record["stepwise"]
    assert launched == steps
    for mode, (_, size, ranks, *_rest, members) in launched["views"].items():
        assert members == ranks and len(ranks) == size, mode  # the groups are what they say


def test_stepwise_equals_launch_in_a_world_of_one(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "tests/torchrun_stepwise.py", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_same(json.loads((tmp_path / "rank-0.json").read_text()))


def test_stepwise_equals_launch_on_four_ranks_under_torchrun(tmp_path: Path) -> None:
    proc = run_torchrun(4, ["tests/torchrun_stepwise.py", str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    for record in records:
        _check_same(record)
    # tensor 2 x pipeline 2: the tensor stream differs inside a tensor group, the default doesn't
    draws = [r["launch"]["draws"] for r in records]
    assert draws[0]["tensor"] != draws[1]["tensor"] and draws[0]["global"] == draws[1]["global"]


def test_old_module_paths_are_the_modules_and_a_patch_on_them_acts(monkeypatch: pytest.MonkeyPatch) -> None:
    for old, new in parallelctx.MOVED.items():
        assert importlib.import_module(f"parallelctx.{old}") is importlib.import_module(f"parallelctx.{new}")
    old_abort = importlib.import_module("parallelctx.abort")
    from parallelctx.guard import abort

    # a patch through the old name is seen by the code at the new place
    monkeypatch.setattr(old_abort, "_socket_fds", lambda: {})
    assert abort.listening() == {}
    assert pickle.loads(pickle.dumps(parallelctx.plan(8, tensor=2))) == parallelctx.plan(8, tensor=2)


def test_an_rng_state_pickled_before_the_move_restores_the_same_draws() -> None:
    expected = json.loads((FIXTURES / "rngstate-0.1.0.json").read_text())
    state = pickle.loads((FIXTURES / "rngstate-0.1.0.pkl").read_bytes())
    parallelctx.launch(expected["config"])
    try:
        gpc.set_rng_state(state)
        import random

        import numpy as np

        got = {"python": [random.random() for _ in range(3)], "numpy": np.random.rand(3).tolist()}
        got["default"] = torch.rand(4).tolist()
        for stream in (ParallelMode.TENSOR, ParallelMode.DATA, ParallelMode.PIPELINE, REPLICA):
            with gpc.seed(stream):
                got[str(getattr(stream, "value", stream))] = torch.rand(4).tolist()
        assert got == expected["draws"]
    finally:
        gpc.destroy()


@pytest.mark.faults
@pytest.mark.timeout(900)
def test_launch_and_abort_cost_no_more_with_18000_open_descriptors() -> None:
    # Sharded datasets opened eagerly, IPC handles: descriptors that are none of the launch's
    # business. Before issue 34 every group's notes and every abort scanned them all (a 4-rank
    # launch went from 0.33-0.53 s to 1.8-3.3 s, abort from 0.07 s to 1 s).
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 19_100:
        pytest.skip("the hard limit on open descriptors is below 19,100 here")
    from benchmarks.many_fds import run

    result = run(nproc=4, rounds=11, extra=18_000)
    assert result["fd_scans"] == 0, "something listed /proc/self/fd during a launch or an abort"
    for rank in result["ranks"]:
        opened = {row["open_after"] for row in rank["rounds"]}
        assert len(opened) == 1, f"descriptors left open after destroy grow: {rank}"  # nothing leaks
    # Every rank aborts at about the same time: a rank whose peers aborted first may find every
    # connection already closed by them (0 shut; 1 round in about 60 here), but the first rank to
    # abort in a round finds them open, so every round shuts some down on some rank.
    shut = [[row["shut"] for row in rank["rounds"]] for rank in result["ranks"]]
    assert all(sum(column) > 0 for column in zip(*shut)), f"an abort round shut down no connection: {shut}"
    # The CPU ratios (about 1.0-1.2 here; a scan made them 5-15) are printed, not asserted: timings
    # decide no test, the count of listings above does.
    print({key: round(result[key]["ratio"], 2) for key in ("launch_cpu", "abort_cpu")})


def _rounds(tmp_path: Path, *extra: str, stall: str = "3") -> None:
    env_proc = run_torchrun_env(
        8, ["tests/torchrun_megatron_rounds.py", str(tmp_path), *extra], {"STALL_RANK": stall}
    )
    assert env_proc.returncode == 0, env_proc.stdout[-3000:] + env_proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("rank-*.json")) == [f"rank-{r}.json" for r in range(8)]


@pytest.mark.faults  # 8 ranks x 4 rounds of Megatron's init: 45 s here, too long for make test
@pytest.mark.timeout(600)
def test_megatrons_init_then_gpc_four_times_with_a_late_rank(tmp_path: Path) -> None:
    # Issue 34's program: Megatron's own init on a default group of the program's, then
    # launch_from_torch + install() with the same layout, four layouts; rank 3 stopped for 0.5 s
    # as it enters each launch's init_process_group. Before the fix a faster rank destroyed the
    # default group while rank 3 still connected it ("Gloo connectFullMesh failed ... Connection
    # closed by peer"; 2 of 3 runs of this program at the release before).
    pytest.importorskip("megatron.core")
    _rounds(tmp_path)


@pytest.mark.faults
@pytest.mark.timeout(600)
def test_megatrons_init_then_gpc_with_groups_that_connect_as_made(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    _rounds(tmp_path, "eager")  # dist.gloo_lazy_init=False: every gloo group connects as made


@pytest.mark.faults
@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", [1, 2])
def test_no_rank_tears_down_a_group_a_late_peer_still_connects(tmp_path: Path, run: int) -> None:
    # dist.gloo_lazy_init=False, tensor 2 on 4 ranks: rank 1 stopped as it starts its tensor
    # group, launch then destroy at once, 6 rounds; without the wait at the end of the launch
    # rank 0 destroyed the group under rank 1 (1 of 2 runs of 3 rounds).
    proc = run_torchrun(4, ["tests/torchrun_eager_stall.py", str(tmp_path), "6"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(list(tmp_path.glob("rank-*.json"))) == 4
