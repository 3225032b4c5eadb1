"""Relaunches stay in step under real torchrun after a refused launch and after a restart.

Each rank answers a launch prefix once, ever (parallelctx.runtime.rendezvous): a relaunch that
finds an earlier launch's prefix still posted waits for rank 0's new one instead of answering the
old one again. Before, a rank relaunching right after a refusal answered the refused prefix while
rank 0 was still telling the refusal, was refused again with it, and from then on paired each
launch with the other ranks' previous one (a bad launch ran, a good one was refused); and after a
torchrun restart a rank took attempt 0's launch count and timed out at its second launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun_helpers import run_torchrun

ROUNDS = 6


@pytest.mark.timeout(200)
def test_a_launch_after_a_refused_one_is_never_refused_with_it(tmp_path: Path) -> None:
    proc = run_torchrun(4, ["tests/torchrun_refusal_relaunch.py", str(tmp_path), str(ROUNDS)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3], proc.stderr[-3000:]
    for row in rows:
        bad = "LayoutError" if row["rank"] == 2 else "RendezvousError"
        expected = [
            [i, kind, bad if kind == "bad" else 10.0] for i in range(ROUNDS) for kind in ("bad", "good")
        ]
        assert row["launches"] == expected, row


@pytest.mark.timeout(200)
def test_every_launch_after_a_torchrun_restart_pairs_with_rank_0s(tmp_path: Path) -> None:
    proc = run_torchrun(
        4, ["--max-restarts", "1", "tests/torchrun_restart_relaunch.py", str(tmp_path)], timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = [json.loads((tmp_path / f"rank-{r}-a0.json").read_text()) for r in range(4)]
    second = [json.loads((tmp_path / f"rank-{r}-a1.json").read_text()) for r in range(4)]
    assert first == [[10.0] * 4] * 4, first
    assert second == [[10.0] * 3] * 4, second


@pytest.mark.faults
@pytest.mark.timeout(200)
def test_a_restart_after_a_rank_died_before_launching_pairs_with_the_new_rank_0(tmp_path: Path) -> None:
    # The new rank 3's first launch finds the old rank 0's later launch on the agent's store; its
    # slot is free (its predecessor never launched), so only the attempt posted with the prefix
    # tells that rank 0 is of the dead attempt: rank 3 waits for the new one. With the world
    # size alone as the sign, it stopped at once naming the old rank 0's count (skeptic, 6 of 6).
    proc = run_torchrun(
        4, ["--max-restarts", "1", "tests/torchrun_restart_after_early_death.py", str(tmp_path)], timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    for rank, row in enumerate(rows):
        assert row[0::2] == [10.0, 10.0], (rank, row)
        assert max(row[1::2]) < 8.0, (rank, row)  # met, not timed out
