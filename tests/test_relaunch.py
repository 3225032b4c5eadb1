"""Relaunch in the same processes under real torchrun, and size-1 groups that are real groups.

One torchrun job of 8 ranks (tests/torchrun_relaunch.py) launches with ``launch_from_torch``,
then destroys and launches again 20 times with changing layouts on the launcher's own store
and port, proving every group of every cycle with collectives.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_helpers import relaunch_rows

ROOT = Path(__file__).resolve().parent.parent
CYCLES = 20


@pytest.fixture(scope="module")
def torchrun_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("relaunch")
    return relaunch_rows(out, 8, CYCLES, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_twenty_relaunches_under_torchrun_each_proven(torchrun_rows: list[dict]) -> None:
    for row in torchrun_rows:
        assert len(row["cycles"]) == CYCLES + 1
        for cycle in row["cycles"]:
            assert cycle["errors"] == [], (row["rank"], cycle)
    layouts = [c["layout"] for c in torchrun_rows[0]["cycles"]]
    assert len(set(layouts)) >= 6  # the layout really changed between launches
    median = sorted(r["median_relaunch_s"] for r in torchrun_rows)[4]
    print(f"median destroy + launch_from_torch over {CYCLES} cycles, 8 ranks: {median:.3f} s")


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_size_one_groups_are_no_ops_under_torchrun(torchrun_rows: list[dict]) -> None:
    # tensor=1, context=1, expert=1: all-reduce over each mode's group (and its CPU group) is a
    # no-op on the value; with group=None it would have summed all 8 ranks.
    for row in torchrun_rows:
        sums = row["size_one"]
        assert {"tensor", "context", "expert"} <= set(sums)
        assert all(value == [1.0, 1.0] for value in sums.values()), (row["rank"], sums)
