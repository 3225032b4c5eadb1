"""Accelerate's and Lightning Fabric's own calls under gpc's tensor 2 × data 2 (make
test-engines): made right or refused by name (parallelctx.engines.guard), with the user-style
tensor-parallel MLP of tests/user_tp_model.py; one torchrun of 4 CPU ranks per engine
(tests/engine_guarded_train.py says what each rank does).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
from torchrun_helpers import run_torchrun

pytestmark = [pytest.mark.engines, pytest.mark.timeout(720)]  # a loaded machine: the run, not a hang

PACKAGES = {"accelerate": "accelerate", "fabric": "lightning"}
SAVE = r"parallelctx.engines.save\(path, model, optimizer\)"


@pytest.fixture(scope="module", params=sorted(PACKAGES))
def run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict[str, Any]]]:
    """``(engine, every rank's record in rank order)``, one torchrun per engine."""
    name = request.param
    if importlib.util.find_spec(PACKAGES[name]) is None:
        pytest.skip(f"the {PACKAGES[name]} extra is not installed (make test-engines installs it)")
    out = tmp_path_factory.mktemp(name)
    proc = run_torchrun(4, ["tests/engine_guarded_train.py", name, str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return name, [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(4)]


def test_clipping_through_the_engine_equals_the_serial_clipped_run(
    run: tuple[str, list[dict[str, Any]]],
) -> None:
    for rec in run[1]:
        assert min(rec["serial_norms"]) > 0.05, "every step clips"
        assert rec["norms"] == pytest.approx(rec["serial_norms"], rel=1e-5)
        # the engine's own clip would have measured this rank's shard alone: another norm
        assert all(abs(s - n) > 1e-2 * n for s, n in zip(rec["shard_norms"], rec["norms"], strict=True))
        assert rec["worst_vs_serial"] <= 1e-5
        assert rec["b2_equal_across_tensor"]


def test_save_and_resume_equal_continuing(run: tuple[str, list[dict[str, Any]]]) -> None:
    assert [rec["worst_resumed_vs_continued"] for rec in run[1]] == [0.0] * 4


def test_the_engines_own_save_and_load_are_refused_by_name(run: tuple[str, list[dict[str, Any]]]) -> None:
    name, records = run
    calls = {"accelerate": ("save_state", "load_state"), "fabric": ("save", "load")}[name]
    for rec in records:
        for call in calls:
            assert rec["own_save"][call], (call, "was not refused")
            assert "tensor=2" in rec["own_save"][call] and re.search(SAVE, rec["own_save"][call])


def test_the_wrappers_are_refused_or_made_right(run: tuple[str, list[dict[str, Any]]]) -> None:
    name, records = run
    for rank, rec in enumerate(records):
        assert rec["ddp_ranks"] == [rank % 2, rank % 2 + 2]
        if name == "accelerate":
            assert "Accelerator.prepare(model) under gpc's tensor=2" in rec["prepare_model"]
            assert "DistributedDataParallel(model, process_group=gpc.get_group" in rec["prepare_model"]
            assert "Accelerator.prepare_data_loader() under gpc's tensor=2" in rec["prepare_loader"]
        else:  # fabric.setup(model, opt) trained the run above: DDP over gpc's data group
            assert rec["fabric_ddp_ranks"] == rec["ddp_ranks"]
            assert "Fabric.setup_dataloaders() under gpc's tensor=2" in rec["setup_loader"]
            assert "use_distributed_sampler=False" in rec["setup_loader"]
            assert rec["setup_loader_without_sampler_rows"] == [1, 5, 9, 13]  # every row, unsharded


def test_the_engines_methods_are_their_own_again_after_destroy(run: tuple[str, list[dict[str, Any]]]) -> None:
    name, records = run
    expect = {
        "accelerate": ["clip_grad_norm_", "load_state", "prepare_data_loader", "prepare_model", "save_state"],
        "fabric": ["clip_gradients", "load", "save", "setup", "setup_dataloaders", "setup_module"],
    }[name]
    for rec in records:
        assert rec["guarded"] == expect
        assert rec["restored"] and rec["world_sum_after_destroy"] == 4.0
