"""The hang report (dist.hang_report, gpc.on_hang, parallelctx/hang.py).

Quick checks here; the multi-rank runs under real torchrun (a rank that skips an all-reduce,
two ranks that call different collectives, calls whose shapes differ by rank, a healthy 200-step
loop) carry the faults marker."""

from __future__ import annotations

import json
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchrun_helpers import run_torchrun, run_torchrun_env

from parallelctx import ParallelMode, gpc, load_config
from parallelctx.guard.hang import _agreed_call
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
    assert cfg.dist.hang_report.store_wait == timedelta(seconds=10)
    assert load_config(
        {"dist": {"hang_report": {"after": 30, "store_wait": 2.5}}}
    ).dist.hang_report.store_wait == (timedelta(seconds=2.5))
    with pytest.raises(ValueError, match="dist.hang_report.store_wait=-1 must be positive"):
        load_config({"dist": {"hang_report": {"after": 30, "store_wait": -1}}})


def test_a_report_that_may_come_after_torchs_timeout_is_warned_of() -> None:
    with pytest.warns(UserWarning, match=r"after=10 s \+ 2 x store_wait=10 s is not below dist.timeout=25 s"):
        load_config({"dist": {"timeout": 25, "hang_report": {"after": 10}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config({"dist": {"timeout": 31, "hang_report": {"after": 10}}})
        load_config({"dist": {"timeout": 5, "hang_report": {"after": 1, "store_wait": 1.5}}})


def test_on_hang_refuses_what_it_cannot_call() -> None:
    with pytest.raises(TypeError, match="on_hang takes a function"):
        gpc.on_hang(3)  # type: ignore[arg-type]


def test_a_call_is_worded_with_its_dtypes_and_shapes() -> None:
    assert describe_call("all_reduce", ([torch.ones(4)], object())) == "all_reduce(float32[4])"
    two = [[torch.zeros(2, 3, dtype=torch.bfloat16)] * 2, [torch.zeros(2, 3, dtype=torch.bfloat16)]]
    assert describe_call("all_gather", tuple(two)) == "all_gather(2 x bfloat16[2, 3], bfloat16[2, 3])"
    assert describe_call("barrier", ()) == "barrier()"


def test_a_call_is_worded_from_the_arguments_torch_passes_with_its_root(tmp_path: Path) -> None:
    # Real torch calls on a gloo world of one, through a running watch: the wording reads the
    # arguments as torch 2.x hands them to the ProcessGroup methods (a change there fails here).
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        group = dist.group.WORLD
        watch = HangWatch(timedelta(seconds=60), 0, store, [(group, (ParallelMode.DATA,), False, (0, 1))], [])
        watch.start()
        try:
            slot = watch._slots[group]
            seen: list[tuple[str, str]] = []

            def worded() -> None:
                assert slot.call is not None
                seen.append(slot.worded(slot.call))

            dist.all_to_all_single(torch.empty(3, 4), torch.ones(3, 4), [3], [3])
            worded()
            dist.all_to_all_single(torch.empty(3, 4), torch.ones(3, 4))
            worded()
            dist.gather(torch.ones(2), [torch.empty(2)], dst=0)
            worded()
            dist.scatter(torch.empty(2), [torch.ones(2)], src=0)
            worded()
            dist.all_gather([torch.empty(2)], torch.ones(2))
            worded()
            dist.broadcast(torch.ones(4), src=0)
            worded()
            dist.all_reduce(torch.ones(4))
            worded()
        finally:
            watch.stop()
    finally:
        dist.destroy_process_group()
    assert seen == [
        ("all_to_all_single(float32[3, 4], float32[3, 4])", "all_to_all_single(float32[*, 4])"),  # splits
        ("all_to_all_single(float32[3, 4], float32[3, 4])", "all_to_all_single(float32[3, 4])"),  # even
        ("gather(float32[2], float32[2], dst=0)", "gather(float32[2], dst=0)"),
        ("scatter(float32[2], float32[2], src=0)", "scatter(float32[2], src=0)"),
        ("all_gather(float32[2], float32[2])", "all_gather(float32[2])"),
        ("broadcast(float32[4], src=0)", "broadcast(float32[4], src=0)"),
        ("all_reduce(float32[4])", "all_reduce(float32[4])"),
    ]


def _opts(kind: type, root: int) -> object:
    opts = kind()
    opts.rootRank = root
    return opts


def test_only_what_every_rank_must_give_alike_makes_calls_differ() -> None:
    # Each rank's arguments as torch's dist.* functions pass them to the ProcessGroup method
    # (group of 3, global ranks 4, 5, 6). Calls that differ only where the op allows per-rank
    # shapes are the same call; another shape where it must agree, another dtype or another
    # root is another call.
    ranks = (4, 5, 6)

    def same(op: str, *per_rank: tuple) -> bool:
        return len({_agreed_call(op, args, ranks) for args in per_rank}) == 1

    def rows(n: int, cols: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(n, cols, dtype=dtype)

    # all_to_all_single with rank-dependent splits (an MoE dispatch): output, input, splits
    a2a = [(rows(sum(o)), rows(sum(i)), o, i) for o, i in (([1, 2, 3], [1, 1, 2]), ([1, 4, 3], [2, 4, 1]))]
    assert same("all_to_all_single", *a2a)
    assert not same("all_to_all_single", a2a[0], (rows(7, 2), rows(5, 2), [1, 4, 2], [2, 2, 1]))
    assert not same(
        "all_to_all_single",
        a2a[0],
        (rows(6, dtype=torch.bfloat16), rows(4, dtype=torch.bfloat16), [1, 2, 3], [1, 1, 2]),
    )
    assert not same("all_to_all_single", (rows(6), rows(6), [], []), (rows(3), rows(3), [], []))
    # all_to_all (list): per-pair shapes
    assert same(
        "all_to_all", ([rows(1), rows(2)], [rows(3), rows(1)]), ([rows(5), rows(1)], [rows(2), rows(2)])
    )
    # gather to group rank 0: only the root passes its list; scatter likewise
    gather = dist.GatherOptions
    root = ([[torch.empty(2)] * 3], [torch.ones(2)], _opts(gather, 0))
    assert same("gather", root, ([], [torch.ones(2)], _opts(gather, 0)))
    assert not same("gather", root, ([], [torch.ones(3)], _opts(gather, 0)))
    assert not same("gather", root, ([], [torch.ones(2)], _opts(gather, 1)))
    scatter = dist.ScatterOptions
    assert same(
        "scatter",
        ([torch.empty(2)], [[torch.ones(2)] * 3], _opts(scatter, 2)),
        ([torch.empty(2)], [], _opts(scatter, 2)),
    )
    # an uneven all-gather: every rank's output list is [2], [3], [1]; its input is its entry
    uneven = [torch.empty(2), torch.empty(3), torch.empty(1)]
    assert len({describe_call("all_gather", ([uneven], [uneven[r]])) for r in range(3)}) == 3
    assert same("all_gather", *[([uneven], [uneven[r]]) for r in range(3)])
    assert not same(
        "all_gather", ([uneven], [uneven[0]]), ([[uneven[0], torch.empty(4), uneven[2]]], [uneven[0]])
    )
    # an uneven reduce-scatter: every rank's input list is the same, its output is its entry
    assert same("reduce_scatter", *[([uneven[r]], [uneven]) for r in range(3)])
    # shapes that must agree, and roots
    assert not same("all_reduce", ([torch.ones(4)],), ([torch.ones(8)],))
    assert not same("all_reduce", ([torch.ones(4)],), ([torch.ones(4, dtype=torch.float64)],))
    broadcast = dist.BroadcastOptions
    assert not same(
        "broadcast", ([torch.ones(4)], _opts(broadcast, 0)), ([torch.ones(4)], _opts(broadcast, 1))
    )
    assert (
        _agreed_call("broadcast", ([torch.ones(4)], _opts(broadcast, 1)), ranks)
        == "broadcast(float32[4], src=5)"
    )
    assert (
        describe_call("reduce", ([torch.ones(4)], _opts(dist.ReduceOptions, 2)))
        == "reduce(float32[4], group_dst=2)"
    )


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


def test_the_watch_counts_functional_collectives_and_holds_them_pending_only_while_waited_for(
    tmp_path: Path,
) -> None:
    import torch.distributed._functional_collectives as funcol

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        group = dist.group.WORLD
        watch = HangWatch(
            timedelta(seconds=60), 0, store, [(group, (ParallelMode.TENSOR,), False, (0, 1))], []
        )
        packet = torch.ops._c10d_functional.all_reduce
        watch.start()
        try:
            dist.all_reduce(torch.ones(2))
            result = funcol.all_reduce(torch.ones(4), "sum", group)
            slot = watch._slots[group]
            assert slot.count == 2 and slot.call is not None
            assert slot.worded(slot.call)[0] == "all_reduce(float32[4])"
            assert slot.oldest_pending() is None  # enqueued; this rank does not wait for it yet
            watch._waiting(result.elem, True)  # as wait_tensor does when the wait starts
            assert slot.oldest_pending() is slot.call
            watch._waiting(result.elem, False)
            assert slot.oldest_pending() is None
            assert result.wait().tolist() == [1.0] * 4
            gathered = funcol.all_gather_single(torch.ones(2, 3), 0, group)
            assert slot.worded(slot.call)[0] == "all_gather_into_tensor(float32[2, 3], float32[2, 3])"
            assert (gathered + 1).sum().item() == 12.0  # using the result waits for it
            halves = torch.ones(8)  # two in-place reduces of one storage, waited at once
            first = torch.ops._c10d_functional.all_reduce_(halves[:4], "sum", group.group_name)
            torch.ops._c10d_functional.all_reduce_(halves[4:], "sum", group.group_name)
            funcol.wait_tensor(first)
            assert slot.count == 5 and slot.oldest_pending() is None and not watch._waits
            # the namespace's ops stand for the ops themselves (Inductor keys its lowerings by them)
            watched = torch.ops._c10d_functional.all_reduce
            assert isinstance(watched, torch._ops.OpOverloadPacket) and watched.default is packet.default
        finally:
            watch.stop()
        assert torch.ops._c10d_functional.all_reduce is packet  # the op is put back
        assert funcol.all_reduce(torch.ones(1), "sum", group).wait().item() == 1.0
    finally:
        dist.destroy_process_group()


def torchrun_rows(
    tmp_path: Path, scenario: str, nproc: int = 8, env: dict[str, str] | None = None
) -> list[dict]:
    proc = run_torchrun_env(
        nproc, ["tests/torchrun_hang.py", str(tmp_path), scenario], env or {}, timeout=280
    )
    # On failure, the ranks' own lines first (timelines, reports, tracebacks' last lines), then the tail
    ours = "\n".join(line for line in proc.stderr.splitlines() if "timeline" in line or "parallelctx" in line)
    assert proc.returncode == 0, ours[-4000:] + "\n...\n" + proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(nproc)), ours[-4000:] + proc.stdout[-3000:]
    print(ours[-6000:])  # the ranks' own lines (store stalls, reports), shown when a test fails
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
            # after = 4 s; a slow store's report up to the read's wait (1 s) + store_wait (8 s) later
            assert report["after_entry_s"] < 4.0 + 1.0 + 8.0 + 3.0, report
            assert row["raised"] and row["ended_s"] < report["after_entry_s"] + 11.0 + 2.0, (
                row
            )  # the abort, 11 s on
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
        {"1": "broadcast(float32[3], src=1)"},
    ), r0["text"]
    assert (r1["op"], r1["missing"], r1["mismatched"]) == (
        "broadcast",
        [],
        {"0": "all_reduce(float32[4])"},
    ), r1["text"]
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


def shape_cycles(tmp_path: Path, scenario: str) -> dict[str, list[dict]]:
    """Run ``scenario`` of tests/torchrun_hang.py on 4 ranks; returns call -> each rank's row."""
    rows = torchrun_rows(tmp_path, scenario, nproc=4)
    assert all(not c["reports"] for c in rows[3]["cycles"].values()), rows[3]  # rank 3 slept
    return {call: [row["cycles"][call] for row in rows] for call in rows[0]["cycles"]}


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_ranks_whose_shapes_differ_where_the_call_allows_it_are_not_mismatched(tmp_path: Path) -> None:
    # Rank 3 sleeps; ranks 0-2 enter all_to_all_single with rank-dependent splits (an MoE
    # dispatch), then a gather and a scatter whose root alone passes a list. Every report names
    # rank 3 missing and nobody mismatched: a handler acting on `mismatched` must not act on
    # healthy ranks.
    cycles = shape_cycles(tmp_path, "per_rank_shapes")
    a2a = cycles["all_to_all_single"]
    assert [len(row["reports"]) for row in a2a[:3]] == [1, 1, 1], a2a  # every sender waits for rank 3
    calls = {row["reports"][0]["call"] for row in a2a[:3]}
    assert len(calls) == 3, calls  # three different shapes ...
    for call, per_rank in cycles.items():
        if call != "all_to_all_single":  # the root waits for rank 3 (the others may be done)
            assert len(per_rank[0]["reports"]) == 1, (call, per_rank[0])
        for rank, row in enumerate(per_rank[:3]):
            for report in row["reports"]:
                assert (report["op"], report["missing"], report["mismatched"]) == (call, [3], {}), (
                    rank,
                    report,
                )
                assert report["text"].endswith(
                    "call 2 on the global group (ranks 0, 1, 2, 3): rank 3 never entered it"
                )
    assert cycles["gather"][0]["reports"][0]["call"] == "gather(4 x float32[2], float32[2], dst=0)"


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_ranks_that_entered_another_shape_or_root_are_still_mismatched(tmp_path: Path) -> None:
    # Rank 3 sleeps; ranks 0 and 1 all-reduce float32[4], rank 2 float32[8]; then ranks 0 and 1
    # broadcast from rank 0, rank 2 from rank 1.
    cycles = shape_cycles(tmp_path, "shape_mismatch")
    for call, mine, theirs in (
        ("all_reduce", "all_reduce(float32[4])", "all_reduce(float32[8])"),
        ("broadcast", "broadcast(float32[4], src=0)", "broadcast(float32[4], src=1)"),
    ):
        per_rank = cycles[call]
        assert len(per_rank[0]["reports"]) == 1, (call, per_rank)
        for rank, row in enumerate(per_rank[:3]):
            for report in row["reports"]:
                expected = {"0": mine, "1": mine} if rank == 2 else {"2": theirs}
                assert (report["call"], report["missing"]) == (theirs if rank == 2 else mine, [3]), report
                assert report["mismatched"] == expected, (rank, report)
                assert "rank 3 never entered it" in report["text"], report
                for other, entered in expected.items():
                    assert f"rank {other} entered a different call: {entered} (mismatch)" in report["text"]


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_a_dtensor_gather_that_one_rank_never_makes_is_named_with_functional_calls_counted(
    tmp_path: Path,
) -> None:
    rows = torchrun_rows(tmp_path, "functional", nproc=4)
    for row in rows:  # the functional and the torch.distributed all-reduce give the same sums
        pair = (1, 2) if row["rank"] < 2 else (3, 4)
        assert row["sums"] == [[float(sum(pair))] * 4] * 2, row
        # On a loaded machine the first call on a fresh gloo group (it connects then) can take
        # longer than `after`: reported as slow ("every rank entered it"), never as missing.
        slow = [r for r in row["reports"] if not r["missing"] and not r["mismatched"]]
        assert all(r["count"] == 1 and "it is slow, not missing" in r["text"] for r in slow), slow
        row["reports"] = [r for r in row["reports"] if r not in slow]
    (report,) = rows[1]["reports"]
    assert (report["mode"], report["op"], report["count"], report["missing"]) == (
        "tensor",
        "all_gather_into_tensor",
        4,  # after the functional all-reduce, dist.all_reduce and distribute_tensor's scatter
        [0],
    ), report
    assert report["call"] == "all_gather_into_tensor(float32[8, 8], float32[4, 8])", report
    assert report["mismatched"] == {} and report["after_entry_s"] < 2.0 + 5.0, report
    print(report["text"])
    assert "raised" in rows[1], rows[1]  # the handler's abort ended the functional wait
    for row in rows[2:]:  # the other tensor group gathered the weight and reported nothing
        assert row["reports"] == [] and row["gathered"] is True, row
    assert rows[0]["reports"] == []


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_no_report_on_a_healthy_200_step_loop(tmp_path: Path) -> None:
    rows = torchrun_rows(tmp_path, "healthy")
    assert all(row["steps"] == 200 for row in rows), rows
    # On a loaded machine (8 ranks on 2 cores) a healthy all-reduce can outlast `after` (full
    # faults runs here saw it at 1 s and 3 s; the loop watches at 8 s): a report that every rank
    # entered it and it is slow is right then. Never missing, never mismatched; and none for a
    # call left pending while the ranks idle past `after` at the end.
    wrong = [
        r
        for row in rows
        for r in row["reports"]
        if r["missing"] or r["mismatched"] or "it is slow, not missing" not in r["text"]
    ]
    assert wrong == [], wrong


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_a_pipeline_stage_that_skips_a_recv_is_named_with_the_pair(tmp_path: Path) -> None:
    proc = run_torchrun(8, ["tests/torchrun_pipeline_hang.py", str(tmp_path)], timeout=240)
    # each rank's own error lines first: torchrun's summary fills the tail
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("[rank")]
    assert proc.returncode == 0, "\n".join(said[-60:]) + proc.stderr[-2000:]
    rows = {r["rank"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json"))}
    assert sorted(rows) == list(range(8)), proc.stdout[-3000:]
    (skipper,) = [r for r in rows.values() if r["skips"]]
    upstream, who = skipper["prev"], skipper["rank"]
    hung = [r for r in rows.values() if r["reports"]]
    assert [r["rank"] for r in hung] == [upstream], hung  # gloo: the third send waits for its receive
    (report,) = rows[upstream]["reports"]
    assert (report["op"], report["peer"], report["missing"], report["count"]) == ("send", who, [who], 3), (
        report
    )
    assert report["mode"] == "global" and report["peer_count"] == 2, report  # dist.send without group=
    assert report["after_entry_s"] < 5.0 + 5.0, report
    text = report["text"]
    assert f"rank {upstream} (pipeline stage 1, tensor rank 0) has waited" in text, text
    assert f"in send(float32[4, 8] to rank {who}), send 3 to rank {who} on the global group" in text, text
    assert (
        f"rank {who} (pipeline stage 2, tensor rank 0) never received it (it received 2 times from rank {upstream}"
        in text
    )
    assert f"its last calls on this group: send(float32[4, 8] to rank {skipper['next']})" in text, text


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_a_torch_pipelining_stage_that_stops_early_is_named_by_both_neighbours(tmp_path: Path) -> None:
    proc = run_torchrun(4, ["tests/torchrun_pipelining_hang.py", str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["rank"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json"))}
    assert sorted(rows) == [0, 1, 2, 3] and rows[2].get("stopped"), rows
    assert all(rows[r].get("step0") for r in (0, 1, 3)), rows  # the first step ran everywhere
    # ScheduleGPipe's point-to-point calls: stage 1 waits to send stage 2 an activation, stage 3
    # to receive one from it; both name stage 2's rank as the one that never made the call.
    (before,) = rows[1]["reports"]
    (after,) = rows[3]["reports"]
    assert (before["op"], before["peer"], before["missing"]) == ("send", 2, [2]), before
    assert (after["op"], after["peer"], after["missing"]) == ("recv", 2, [2]), after
    assert "rank 2 (pipeline stage 2) never received it" in before["text"], before["text"]
    assert "rank 2 (pipeline stage 2) never sent it" in after["text"], after["text"]
    for report in (before, after):
        assert report["after_entry_s"] < 5.0 + 5.0, report
    assert rows[2]["reports"] == []


def test_a_receive_that_waits_names_the_skipped_receive_one_stage_up() -> None:
    # The report's wording for the other side: this rank waits in a receive from rank 4, which
    # never sent, because rank 4 skipped a receive from rank 2 (as on a backend whose sends
    # complete without their receives).
    report = HangReport(
        mode=ParallelMode.PIPELINE, modes=(ParallelMode.PIPELINE,), cpu=False, op="recv",
        call="recv(float32[4, 8] from rank 4)", count=3, rank=6, ranks=(0, 2, 4, 6), missing=(4,),
        peer=4, peer_count=2, peer_last=("send(float32[4, 8] to rank 6)",),
        where={6: "pipeline stage 3", 4: "pipeline stage 2", 2: "pipeline stage 1"}, skipped=((2, 4, 3, 2),),
    )  # fmt: skip
    assert str(report) == (
        "rank 6 (pipeline stage 3) has waited 0.0 s in recv(float32[4, 8] from rank 4), receive 3 from rank 4 "
        "on the pipeline group (ranks 0, 2, 4, 6): rank 4 (pipeline stage 2) never sent it (it sent 2 times to "
        "rank 6; its last calls on this group: send(float32[4, 8] to rank 6)); rank 2 (pipeline stage 1) sent 3 "
        "times to rank 4, which received 2: rank 4 skipped a receive from rank 2"
    )


def _enter_a_pending_all_reduce(watch: HangWatch) -> None:
    """Make ``watch`` count one all-reduce on the world group that this rank entered and that
    never completes (as its wrapper would)."""
    slot = watch._slots[dist.group.WORLD]
    slot.count = 1
    slot.call = [1, "all_reduce", ([torch.ones(4)],), time.monotonic(), None]  # pending
    slot.calls.append(slot.call)


class _StalledStore:
    """A launch store whose server hangs: every request blocks until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def _stall(self) -> None:
        self.release.wait(60)

    def set(self, key: str, value: Any) -> None:
        self._stall()

    def get(self, key: str) -> bytes:
        self._stall()
        return b"{}"

    def check(self, keys: list[str]) -> bool:
        self._stall()
        return False


def test_a_stalled_store_does_not_silence_the_report_and_is_named(tmp_path: Path, caplog: Any) -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "s"), 1))
    store = _StalledStore()
    try:
        reports: list[HangReport] = []
        watch = HangWatch(
            timedelta(seconds=0.4),
            0,
            store,
            [(dist.group.WORLD, (ParallelMode.DATA,), False, (0, 1))],
            [reports.append],
            store_wait=timedelta(seconds=1.5),
        )
        watch.start()
        try:
            _enter_a_pending_all_reduce(watch)
            begin = time.monotonic()
            with caplog.at_level("WARNING", logger="parallelctx"):
                while not reports and time.monotonic() - begin < 10:
                    time.sleep(0.05)
            at = time.monotonic() - begin
        finally:
            store.release.set()
            watch.stop()
        (report,) = reports
        # after (0.4 s), the first read's own wait (1 s), then store_wait (1.5 s) of reading again
        assert at >= 0.4 + 1.5, f"the report came at {at:.2f} s: it did not read again for store_wait"
        assert at < 0.4 + 1 + 1.5 + 2, f"the report came at {at:.2f} s: it waited for the stalled store"
        assert not report.progress_known and report.store_stalled and report.missing == ()
        assert "could not be read from the launch's store (it did not answer in time" in str(report)
        assert "the launch's store did not answer within 1 s" in caplog.text
    finally:
        dist.destroy_process_group()


class _SlowOnceStore:
    """A launch store on a loaded host: the first read of another rank's progress (a report's)
    takes 1.5 s, every other request answers at once; rank 1 has posted no progress (it never
    entered a call)."""

    def __init__(self) -> None:
        self.reads = 0

    def set(self, key: str, value: Any) -> None:
        pass

    def get(self, key: str) -> bytes:
        return b"{}"

    def check(self, keys: list[str]) -> bool:
        self.reads += 1
        if self.reads == 1:
            time.sleep(1.5)
        return True


@pytest.mark.faults
@pytest.mark.timeout(400)
def test_with_the_flight_recorder_on_the_report_uses_its_sequence_numbers(tmp_path: Path) -> None:
    rows = torchrun_rows(tmp_path, "skip", env={"TORCH_FR_BUFFER_SIZE": "2000"})  # rank 3 skips
    for row in rows:
        if row["rank"] in (1, 5, 7):
            (report,) = row["reports"]
            assert report["missing"] == [3], report
            recorded = report["flight_recorder"]
            assert sorted(recorded) == ["1", "3", "5", "7"], report  # the data group {1, 3, 5, 7}
            assert all(recorded[r][0] > recorded["3"][0] for r in ("1", "5", "7")), recorded
            assert "by torch's flight recorder, TORCH_FR_BUFFER_SIZE" in report["text"], report["text"]
        else:
            assert row["reports"] == [], row


# A read of the progress the store does not answer in time, read again (HangWatch._patiently)


class _GoneStore:
    """A launch store whose server is gone: every request fails at once (connection refused or
    reset), as a TCPStore client does once the process that served it has exited."""

    def set(self, key: str, value: Any) -> None:
        raise RuntimeError("Connection reset by peer")

    def get(self, key: str) -> bytes:
        raise RuntimeError("Connection reset by peer")

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer")


class _Work:
    """A call's ``Work`` that completes at ``done_at`` (never when None)."""

    def __init__(self, done_at: float | None = None) -> None:
        self.done_at = done_at

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at


@pytest.fixture
def world(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "s"), 1))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _watch(
    after: float, store: Any, groups: list[Any] | None = None
) -> tuple[HangWatch, list[tuple[HangReport, float]]]:
    reports: list[tuple[HangReport, float]] = []
    watch = HangWatch(
        timedelta(seconds=after), 0, store,
        [(g, (ParallelMode.DATA,), False, (0, 1)) for g in groups or [dist.group.WORLD]],
        [lambda r: reports.append((r, time.monotonic()))], log=False,
    )  # fmt: skip
    watch.start()
    return watch, reports


def _enter(watch: HangWatch, group: Any = None, work: Any = None) -> list[Any]:
    """A collective this rank entered on ``group`` that completes when ``work`` says."""
    slot = watch._slots[group or dist.group.WORLD]
    slot.count += 1
    slot.call = [slot.count, "all_reduce", ([torch.ones(4)],), time.monotonic(), work]
    slot.calls.append(slot.call)
    return slot.call


def _enter_recv(watch: HangWatch) -> list[Any]:
    """A receive from group rank 1 that this rank entered and that never completes."""
    slot = watch._slots[dist.group.WORLD]
    slot.order = (0, 1)
    slot.p2p["recv 1"] = count = slot.p2p.get("recv 1", 0) + 1
    slot.p2p_last = call = [count, "recv", ([torch.ones(2)], 1, 0), time.monotonic(), None, 1]
    slot.p2p_calls.append(call)
    return call


def _wait_for(reports: list[Any], n: int, limit: float) -> None:
    begin = time.monotonic()
    while len(reports) < n and time.monotonic() - begin < limit:
        time.sleep(0.02)


def test_a_report_whose_store_is_gone_is_not_held_back(world: None) -> None:
    # A store that refuses every request is gone, not slow: reading again cannot help, so the
    # report comes at `after` (+ ticks), as before the re-read; and a second group's report is
    # not held back behind the first one's reads.
    g2 = dist.new_group([0])
    watch, reports = _watch(2.0, _GoneStore(), [dist.group.WORLD, g2])
    try:
        entered = _enter(watch)[3]
        _enter(watch, g2)
        _wait_for(reports, 2, 12)
    finally:
        watch.stop()
    assert len(reports) == 2, reports
    late = [round(t - entered, 2) for _, t in reports]
    assert all(not r.progress_known and not r.store_stalled for r, _ in reports), reports
    assert max(late) < 2.0 + 1.5, f"reports at {late} s after entry (after = 2 s): held back by re-reads"


def test_a_report_after_a_slow_read_comes_once_with_the_time_it_waited(world: None) -> None:
    watch, reports = _watch(1.0, _SlowOnceStore())
    try:
        entered = _enter(watch)[3]
        _wait_for(reports, 1, 10)
        time.sleep(3.5)  # several `after`s more: the same call is not reported again
    finally:
        watch.stop()
    assert len(reports) == 1, [str(r) for r, _ in reports]
    report, at = reports[0]
    assert report.progress_known and report.missing == (1,), str(report)
    assert report.waited >= at - entered - 0.3, (report.waited, at - entered)


def test_a_receive_after_a_slow_read_names_the_peer_once_with_the_time_it_waited(world: None) -> None:
    watch, reports = _watch(1.0, _SlowOnceStore())
    try:
        entered = _enter_recv(watch)[3]
        _wait_for(reports, 1, 10)
        time.sleep(3.5)
    finally:
        watch.stop()
    assert len(reports) == 1, [str(r) for r, _ in reports]
    report, at = reports[0]
    assert (report.op, report.peer, report.missing, report.progress_known) == ("recv", 1, (1,), True), str(
        report
    )
    assert report.waited >= at - entered - 0.3, (report.waited, at - entered)


def test_stop_ends_a_report_that_waits_for_the_store_at_once_and_makes_none(world: None) -> None:
    store = _StalledStore()
    watch, reports = _watch(4.0, store)  # a tick of 1 s, store requests awaited 2 s
    try:
        _enter(watch)
        time.sleep(7.0)  # the report began at 4-5 s and reads again each tick
        assert reports == [], "the report did not wait for the stalled store"
        begin = time.monotonic()
        watch.stop()
        took = time.monotonic() - begin
        alive = [t for t in threading.enumerate() if t.name == "parallelctx-hang-report" and t.is_alive()]
        time.sleep(1.0)
    finally:
        store.release.set()
        watch.stop()
    assert took < 1.5 and not alive, (took, alive)  # re-reading, it would wait `after`
    assert reports == [] and not watch._slots, reports


def test_a_call_that_completes_while_the_store_stalls_is_not_reported_and_the_next_one_is(
    world: None,
) -> None:
    store = _StalledStore()
    watch, reports = _watch(1.0, store)
    try:
        _enter(watch, work=_Work(time.monotonic() + 1.8))  # slow: it completes during the re-reads
        time.sleep(3.0)
        second = _enter(watch)  # the next call hangs; the store answers again
        store.release.set()
        _wait_for(reports, 1, 8)
    finally:
        store.release.set()
        watch.stop()
    assert [r.count for r, _ in reports] == [2], [str(r) for r, _ in reports]
    assert reports[0][1] - second[3] < 1.0 + 2.0, reports


class _SlowClone:
    """A launch's store whose new connection takes ``delay`` s (a reverse DNS lookup waiting
    out the resolver, docs/performance.md); counts the requests made on the launch's own one."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay, self.direct = inner, delay, 0

    def clone(self) -> Any:
        time.sleep(self.delay)
        return self.inner

    def __getattr__(self, name: str) -> Any:
        self.direct += 1
        return getattr(self.inner, name)


def test_arming_the_hang_report_never_waits_for_its_store_connection(tmp_path: Path) -> None:
    # CI saw two ranks return from their launch 5 s after the others: the watch's new store
    # connection, made in the launch. It is made in the watch's own thread now; the progress is
    # posted on it once it is up, never on the launch's connection.
    from parallelctx.guard.core import Guard

    store = dist.FileStore(str(tmp_path / "s"), 1)
    slow, guard = _SlowClone(store, 1.5), Guard()
    began = time.monotonic()
    guard.watch(timedelta(seconds=0.2), False, 0, slow, {})
    armed = time.monotonic() - began
    try:
        assert armed < 0.5, armed
        deadline = time.monotonic() + 10
        while not store.check(["hang/0"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.monotonic() - began >= 1.5, "posted before its connection was made"
        assert json.loads(store.get("hang/0")) == {}  # no call entered yet
        assert slow.direct == 0  # nothing went over the launch's own connection
    finally:
        guard.unwatch()
