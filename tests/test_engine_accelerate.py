"""Accelerate (make test-engines): gpc on the default group Accelerate made, under real torchrun.

tests/engine_accelerate_train.py (4 CPU ranks) lets Accelerate create the default group, launches gpc with
tensor=2 on it (adoption), trains the tensor-parallel MLP with Accelerate's optimizer wrapper and
backward and DDP over gpc's data group, compares with the serial run, destroys gpc and uses the
engine's group again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torchrun_helpers import run_torchrun

pytestmark = [pytest.mark.engines, pytest.mark.timeout(720)]  # a loaded machine: the run, not a hang
pytest.importorskip(
    "accelerate", reason="the accelerate extra is not installed (make test-engines installs it)"
)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's record, rank order."""
    out = tmp_path_factory.mktemp("accelerate")
    proc = run_torchrun(4, ["tests/engine_accelerate_train.py", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(4)]


def test_tensor_2_data_2_trains_equal_to_serial(records: list[dict[str, Any]]) -> None:
    for rank, rec in enumerate(records):
        assert rec["tensor"] == [rank % 2, 2] and rec["data"] == [rank // 2, 2]
        assert rec["worst"] <= 1e-6


def test_gpc_adopts_the_engines_group_and_leaves_it(records: list[dict[str, Any]]) -> None:
    for rank, rec in enumerate(records):
        assert rec["adopted"] and rec["accelerate_rank"] == rank
        assert rec["after_destroy"] == {"initialized": True, "world_sum": 4.0}


def test_the_engines_own_model_wrapper_cannot_hold_tensor_shards(records: list[dict[str, Any]]) -> None:
    # accelerator.prepare wraps in DDP over all 4 processes: its first broadcast overwrites
    # tensor rank 1's shard with rank 0's (docs/engines.md says why the tests wrap DDP themselves)
    assert [rec["engine_wrapper_copied_rank_0s_shard"] for rec in records] == [True] * 4
