"""A gloo pair left with data for a receive that was dropped (its step raised before ``wait()``)
must not make ``gpc.destroy()`` hang forever, with or without a ``gpc.abort()`` first, nor leave
a core busy after it (tests/torchrun_stuck_recv.py has the scenario; without parallelctx's
quieting the destroy hangs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from torchrun_helpers import run_torchrun

pytestmark = [
    pytest.mark.faults,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


def stuck_record(tmp_path: Path, variant: str, nproc: int) -> dict:
    proc = run_torchrun(nproc, ["tests/torchrun_stuck_recv.py", str(tmp_path), variant], timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "rank-0.json").read_text())
    assert record["stuck"] and record["stuck"][0] >= 20, f"the scenario did not leave a loop busy: {record}"
    return record


@pytest.mark.timeout(200)
def test_destroy_after_a_dropped_receive_returns_and_leaves_no_busy_loop(tmp_path: Path) -> None:
    record = stuck_record(tmp_path, "destroy", 4)
    assert record["destroy_s"] != "hung" and record["destroy_s"] < 5.0, record
    assert all(ticks < 20 for ticks in record["end"]), record  # a spinning loop takes ~100 a second


@pytest.mark.timeout(200)
def test_destroy_after_an_abort_and_a_dropped_receive_returns_and_leaves_no_busy_loop(tmp_path: Path) -> None:
    record = stuck_record(tmp_path, "abort", 2)
    assert record["destroy_s"] != "hung" and record["destroy_s"] < 5.0, record
    assert all(ticks < 20 for ticks in record["end"]), record
