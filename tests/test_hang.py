"""The hang report (dist.hang_report, gpc.on_hang, parallelctx/hang.py).

Quick checks here; the multi-rank runs under real torchrun (a rank that skips an all-reduce,
two ranks that call different collectives, a healthy 200-step loop) carry the faults marker."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrun_helpers import run_torchrun

from parallelctx import ParallelMode, gpc, load_config
from parallelctx.hang import HangReport, HangWatch, describe_call


def test_hang_report_is_off_by_default_and_checked() -> None:
    assert load_config({}).dist.hang_report is None
    cfg = load_config({"dist": {"hang_report": {"after": 30}}})
    assert cfg.dist.hang_report is not None and cfg.dist.hang_report.after == timedelta(seconds=30)
    with pytest.raises(ValueError, match="unknown key 'aftr'; did you mean 'after'"):
        load_config({"dist": {"hang_report": {"aftr": 30}}})
    with pytest.raises(
        ValueError, match=r"dist.hang_report=30 is of type int; give a dict such as dict\(after=60\)"
    ):
        load_config({"dist": {"hang_report": 30}})
    with pytest.raises(ValueError, match="dist.hang_report.after=0 must be positive"):
        load_config({"dist": {"hang_report": {"after": 0}}})


def test_on_hang_refuses_what_it_cannot_call() -> None:
    with pytest.raises(TypeError, match="on_hang takes a function"):
        gpc.on_hang(3)  # type: ignore[arg-type]


def test_a_call_is_worded_with_its_dtypes_and_shapes() -> None:
    assert describe_call("all_reduce", ([torch.ones(4)], object())) == "all_reduce(float32[4])"
    two = [[torch.zeros(2, 3, dtype=torch.bfloat16)] * 2, [torch.zeros(2, 3, dtype=torch.bfloat16)]]
    assert describe_call("all_gather", tuple(two)) == "all_gather(2 x bfloat16[2, 3], bfloat16[2, 3])"
    assert describe_call("barrier", ()) == "barrier()"


def test_the_watch_counts_calls_posts_progress_and_names_the_missing(tmp_path: Path) -> None:
    # One process, gloo: a call counts itself on the hot path without any store call; the
    # thread posts the progress; a call left pending is reported with the members behind it.
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        group = dist.group.WORLD
        reports: list[HangReport] = []
        watch = HangWatch(
            timedelta(seconds=0.2),
            0,
            store,
            [(group, (ParallelMode.DATA,), False, (0, 1, 2))],
            [reports.append],
        )
        original = vars(dist.ProcessGroup)["allreduce"]
        watch.start()
        try:
            for _ in range(3):
                dist.all_reduce(torch.ones(4))
            slot = watch._slots[group]
            assert slot.count == 3 and slot.call is not None and slot.call[1] == "all_reduce"
            deadline = time.monotonic() + 10
            while not store.check(["hang/0"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert json.loads(store.get("hang/0"))[group.group_name] == [3, "all_reduce(float32[4])"]
            # rank 1 posted 3 calls (behind this one), rank 2 the 4th call but another one
            store.set("hang/1", json.dumps({group.group_name: [3, "all_reduce(float32[4])"]}))
            store.set("hang/2", json.dumps({group.group_name: [4, "broadcast(float32[4])"]}))
            slot.count = 4
            slot.call = [4, "all_reduce", ([torch.ones(4)],), time.monotonic(), None]  # pending
            slot.calls.append(slot.call)
            while not reports and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            watch.stop()
        assert vars(dist.ProcessGroup)["allreduce"] is original  # the methods are restored ...
        x = torch.ones(2)
        dist.all_reduce(x)  # ... and still work
        assert x.tolist() == [1.0, 1.0]
        (report,) = reports
        assert (report.mode, report.op, report.missing) == (ParallelMode.DATA, "all_reduce", (1,))
        assert report.mismatched == {2: "broadcast(float32[4])"} and report.count == 4
        assert "rank 1 never entered it" in str(report) and "rank 2 entered a different call" in str(report)
    finally:
        dist.destroy_process_group()


def torchrun_rows(tmp_path: Path, scenario: str, nproc: int = 8) -> list[dict]:
    proc = run_torchrun(nproc, ["tests/torchrun_hang.py", str(tmp_path), scenario], timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(nproc)), proc.stdout[-3000:]
    return rows


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_a_rank_that_skips_an_all_reduce_on_the_data_group_is_named_by_every_waiting_rank(
    tmp_path: Path,
) -> None:
    rows = torchrun_rows(tmp_path, "skip")  # data groups {0,2,4,6}, {1,3,5,7}; rank 3 skips
    for row in rows:
        if row["rank"] in (1, 5, 7):
            (report,) = row["reports"]  # one report per waiting rank
            assert (report["mode"], report["op"], report["missing"]) == ("data", "all_reduce", [3]), report
            assert report["call"] == "all_reduce(float32[4])" and report["mismatched"] == {}
            assert report["after_entry_s"] < 2.0 + 5.0, report  # dist.hang_report.after = 2 s
            assert row["raised"] and row["ended_s"] < 2.0 + 5.0 + 2.0, row  # the handler's abort, 2 s later
        else:
            assert row["reports"] == [], row
        assert row["relaunch_sum"] == row["relaunch_expected"], row
    print("named after", max(r["reports"][0]["after_entry_s"] for r in rows if r["reports"]), "s")


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_two_ranks_that_call_different_collectives_are_named_as_a_mismatch(tmp_path: Path) -> None:
    rows = torchrun_rows(tmp_path, "mismatch")  # tensor group {0, 1}
    (r0,) = rows[0]["reports"]
    (r1,) = rows[1]["reports"]
    assert (r0["mode"], r0["op"], r0["missing"], r0["mismatched"]) == (
        "tensor",
        "all_reduce",
        [],
        {"1": "broadcast(float32[3])"},
    )
    assert (r1["op"], r1["missing"], r1["mismatched"]) == ("broadcast", [], {"0": "all_reduce(float32[4])"})
    assert all(row["reports"] == [] for row in rows[2:])
    assert all(row["relaunch_sum"] == row["relaunch_expected"] for row in rows)


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_a_slow_rank_that_arrived_is_never_named_missing(tmp_path: Path) -> None:
    # Global group of 4: rank 1 enters 0.98 s late with after = 1 s, rank 2 never; 6 cycles.
    # Rank 1 arrived before anyone had waited `after`, so no report may name it, however the
    # report's read of the progress falls against rank 1's watch posting it.
    rows = torchrun_rows(tmp_path, "slow", nproc=4)
    for row in rows:
        for cycle in row["cycles"]:
            if row["rank"] == 2:
                assert cycle["reports"] == [], row
                continue
            (report,) = cycle["reports"]
            assert (report["mode"], report["missing"]) == ("global", [2]), (row["rank"], report)


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_with_async_calls_the_report_is_about_the_oldest_pending_call(tmp_path: Path) -> None:
    # Rank 0 has two async all-reduces pending on the global group; ranks 2 and 3 wait in the
    # first; rank 1 never comes. Ranks 2 and 3 entered the first call: naming them missing (from
    # the second call) or rank 0 mismatched (it went past) would send a watchdog after the
    # wrong ranks.
    rows = torchrun_rows(tmp_path, "async", nproc=4)
    assert rows[1]["reports"] == []
    for row in (rows[0], rows[2], rows[3]):
        for report in row["reports"]:
            assert (report["count"], report["call"]) == (2, "all_reduce(float32[4])"), (row["rank"], report)
            assert (report["missing"], report["mismatched"]) == ([1], {}), (row["rank"], report)
    assert any(row["reports"] for row in rows), rows


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_no_report_on_a_healthy_200_step_loop(tmp_path: Path) -> None:
    rows = torchrun_rows(tmp_path, "healthy")
    assert all(row["reports"] == [] and row["steps"] == 200 for row in rows), rows
