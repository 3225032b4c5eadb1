"""Accelerate and Lightning Fabric (make test-engines): gpc on the default group the engine made,
under real torchrun, and the engine's own everyday calls under gpc's tensor 2 × data 2 made right
or refused (parallelctx.engines.guard), with a tensor-parallel model written as a user writes one
(tests/engine_user_model.py).

tests/engine_<name>_train.py (one torchrun of 4 CPU ranks per engine; its docstring says what
each rank does) lets the engine create the default group and launches gpc with tensor=2 on it;
each rank writes a record. Each engine is skipped when its extra is not installed.
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

# engine: (the package its extra installs, the record key of the engine's own rank)
ENGINES = {"accelerate": ("accelerate", "accelerate_rank"), "lightning": ("lightning", "fabric_rank")}
MAX_NORM = 0.05  # tests/engine_user_model.py's
SAVE = "parallelctx.engines.save(path, model, optimizer)"

Run = tuple[str, list[dict[str, Any]]]


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``(engine name, every rank's record in rank order)``, one torchrun per engine."""
    name = request.param
    package, _ = ENGINES[name]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the {name} extra is not installed (make test-engines installs it)")
    out = tmp_path_factory.mktemp(name)
    proc = run_torchrun(4, [f"tests/engine_{name}_train.py", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return name, [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(4)]


def test_tensor_2_data_2_trains_equal_to_serial(engine: Run) -> None:
    for rank, rec in enumerate(engine[1]):
        assert rec["tensor"] == [rank % 2, 2] and rec["data"] == [rank // 2, 2]
        assert rec["worst"] <= 1e-6


def test_gpc_adopts_the_engines_group_and_leaves_it(engine: Run) -> None:
    name, records = engine
    for rank, rec in enumerate(records):
        assert rec["adopted"] and rec[ENGINES[name][1]] == rank
        assert rec["after_destroy"] == {"initialized": True, "world_sum": 4.0}


def test_resume_from_parallelctx_engines_save_equals_continuing(engine: Run) -> None:
    # every rank's own shard and its SGD momentum, after the fresh model (other weights) loaded
    # the checkpoint taken after 2 of 4 steps and trained the last 2
    for rec in engine[1]:
        assert rec["resumed_vs_continued"]["params"] <= 1e-6
        assert rec["resumed_vs_continued"]["momentum"] <= 1e-6


def test_clipping_through_the_engines_own_call_equals_the_serial_clipped_run(engine: Run) -> None:
    name, records = engine
    for rec in records:
        assert min(rec["serial_norms"]) > 2 * MAX_NORM, "every step clips"
        # the engine's call returns the whole model's norm, torch's on the serial model
        assert rec["norms"] == pytest.approx(rec["serial_norms"], rel=1e-5)
        # which is not this rank's shard norm (what the engine's own clip measures)
        assert all(abs(s - n) > 0.05 * n for s, n in zip(rec["shard_norms"], rec["norms"], strict=True))
        # Fabric's setup(model) made right: its DDP trained this run (the 1e-6 of an unclipped run)
        assert rec["worst_vs_serial"] <= (1e-6 if name == "lightning" else 1e-5)
        assert rec["b2_equal_across_tensor"], "b2 gathered over the tensor group differs"
        # the control, clipped by the engine's own call as it was before the guard
        assert rec["unguarded_clip"]["worst_vs_serial"] > 1e-3
        assert not rec["unguarded_clip"]["b2_equal_across_tensor"]


def test_the_engines_own_save_and_load_are_refused_by_name(engine: Run) -> None:
    name, records = engine
    calls = {
        "accelerate": ("Accelerator.save_state()", "Accelerator.load_state()", "Accelerator.save_model()"),
        "lightning": ("Fabric.save()", "Fabric.load()"),
    }[name]
    for rec in records:
        assert len(rec["own_save"]) == len(calls)
        for call in calls:
            text = rec["own_save"][call.split(".")[1][:-2]]
            assert text.startswith(f"{call} under gpc's tensor=2:"), text
            assert SAVE in text


def test_the_wrappers_are_refused_or_made_right(engine: Run) -> None:
    name, records = engine
    for rank, rec in enumerate(records):
        assert rec["data_context_ranks"] == [rank % 2, rank % 2 + 2]
        if name == "accelerate":
            assert rec["prepare_model"].startswith("Accelerator.prepare(model) under gpc's tensor=2:")
            assert "DistributedDataParallel(model, process_group=gpc.get_group" in rec["prepare_model"]
            assert rec["prepare_loader"].startswith("Accelerator.prepare_data_loader() under gpc's tensor=2:")
            assert "DistributedSampler(dataset, num_replicas=gpc.data.size" in rec["prepare_loader"]
            continue
        # fabric.setup(model, optimizer) (DDP strategy): DDP over gpc's data × context group
        assert rec["fabric_ddp_ranks"] == rec["data_context_ranks"]
        assert rec["setup_loader"].startswith("Fabric.setup_dataloaders() under gpc's tensor=2:")
        assert "use_distributed_sampler=False" in rec["setup_loader"]
        assert rec["unsharded_batches"] == 8, "use_distributed_sampler=False: every row, unsharded"
        # the recipe's own DistributedSampler over gpc's data group: kept by Fabric and the guard
        assert rec["sampler_kept"] == {"num_replicas": 2, "rank": rec["data"][0], "batches": 4}
        assert re.search(
            r"DDPStrategy\(process_group=\.\.\.\) has ranks \[0, 1, 2, 3\]", rec["setup_world_group"]
        )
        assert "gpc.get_group(ParallelMode.DATA_CONTEXT)" in rec["setup_world_group"]
        assert rec["setup_deepspeed"].startswith(
            "Fabric.setup under gpc's tensor=2 with the DeepSpeedStrategy:"
        )


def test_an_engine_imported_after_the_launch_is_guarded(engine: Run) -> None:
    name, records = engine
    if name != "lightning":
        pytest.skip("the Fabric run imports Accelerate after the launch")
    for rec in records:
        assert rec["accelerate_imported_before"] is False
        assert rec["late_prepare_model"].startswith("Accelerator.prepare(model) under gpc's tensor=2:")
        assert rec["late_restored"], "Accelerate's prepare_model is its own again after gpc.destroy()"


def test_the_engines_methods_are_their_own_again_after_destroy(engine: Run) -> None:
    name, records = engine
    expect = {
        "accelerate": [
            "clip_grad_norm_",
            "load_state",
            "prepare_data_loader",
            "prepare_model",
            "save_model",
            "save_state",
        ],
        "lightning": ["clip_gradients", "load", "save", "setup", "setup_dataloaders", "setup_module"],
    }[name]
    for rec in records:
        assert rec["guarded"] == expect
        assert rec["restored"] == expect
