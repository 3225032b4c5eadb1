"""DeepSpeed's PipelineModule on gpc's layout (make test-engines): tensor 2 × pipeline 2 × data 2
in the order "tp-pp-dp", one torchrun of 8 CPU ranks (tests/engine_deepspeed_pipe.py says what
each rank does).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
from torchrun_helpers import run_torchrun_env

pytestmark = [pytest.mark.engines, pytest.mark.timeout(720)]


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's record, in rank order."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the deepspeed extra is not installed (make test-engines installs it)")
    out = tmp_path_factory.mktemp("pipe")
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = run_torchrun_env(8, ["tests/engine_deepspeed_pipe.py", str(out)], env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(8)]


def test_pipe_topology_gives_deepspeed_gpcs_groups(records: list[dict[str, Any]]) -> None:
    for rec in records:
        assert rec["axes"] == ["data", "pipe", "model"]  # "tp-pp-dp" reversed
        assert rec["deepspeed"]["stage"] == rec["pipeline"] and rec["deepspeed"]["data"] == rec["data"]
        assert rec["deepspeed"]["dp_group"] == rec["gpc"]["dp_group"]
        assert rec["deepspeed"]["pp_group"] == rec["gpc"]["pp_group"]


def test_the_pipeline_trains_equal_to_serial(records: list[dict[str, Any]]) -> None:
    for rec in records:
        assert rec["worst"] <= 1e-6, rec["worst"]
        assert rec["moved"] > 1e-2  # it trained
        assert rec["losses"] == pytest.approx(rec["serial_losses"], rel=1e-5)


def test_deepspeeds_own_topologies_are_refused_by_name(records: list[dict[str, Any]]) -> None:
    for rec in records:
        for key in ("default_refused", "megatron_topology_refused"):
            assert "puts rank 2 at pipe rank 0, but gpc's layout" in rec[key], rec[key]
            assert (
                "order=tp-pp-dp" in rec[key] and "topology=parallelctx.deepspeed.pipe_topology()" in rec[key]
            )
