"""Issue 35: every group's calls checked across the ranks of a dry-run sweep.

The scripts in examples/deadlocks/ are written as a user's training code (torch's own dist.*
calls on gpc's groups); each plants one bug behind a flag. A 256-rank sweep of each exits 1 and
names the bug's ranks, group and call site; the same script without the bug exits 0 (the
sweeps run under `make test-sweeps`; the checks on made-up reports run in `make test`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parallelctx.cli.sequences import (
    check_calls,
    check_group_sequences,
    check_point_to_point,
    check_wait_cycles,
)
from parallelctx.guard.ledger import CallLedger, describe

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "examples" / "deadlocks"


def site(script: str, text: str) -> str:
    """``examples/deadlocks/<script>:<line>`` of the line holding ``text``: :func:`sweep` runs
    the script by that path, relative to the repository, which the call site names."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"examples/deadlocks/{script}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def sweep(
    world: int, script: str, *args: str, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "parallelctx", "dry-run", "--world-size", str(world), "--ranks", "all"]
    cmd += ["--quiet", *extra, f"examples/deadlocks/{script}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


# ---------------------------------------------------------------- the checks on made-up reports
def report(rank: int, world: int, calls: list[dict], groups: dict, coords: dict | None = None) -> dict:
    ledger = CallLedger()
    keys = {}
    for name, members in groups.items():
        keys[name] = ledger.group_key(object(), lambda _, m=members: m)
    for call in calls:
        entry = dict(call)
        entry["group"] = keys[entry.pop("on")]
        entry.setdefault("shown", f"{entry['kind']}()")
        entry.setdefault("agree", entry["kind"])
        entry.setdefault("where", "train.py:1")
        ledger.note(entry)
    mine = {name: members for name, members in groups.items() if members is not None and rank in members}
    return {
        "rank": rank,
        "world_size": world,
        "calls": ledger.to_json(),
        "groups": mine,
        "coords": coords or {},
    }


def ar(on: str, where: str = "train.py:10", agree: str = "all_reduce float32[4]") -> dict:
    return {"kind": "all_reduce", "on": on, "where": where, "agree": agree, "shown": "all_reduce(float32[4])"}


def four_ranks(order: dict[int, list[str]]) -> dict[int, dict]:
    groups_of = {0: ("t01", "d02"), 1: ("t01", "d13"), 2: ("t23", "d02"), 3: ("t23", "d13")}
    every = {"t01": [0, 1], "t23": [2, 3], "d02": [0, 2], "d13": [1, 3]}
    reports = {}
    for rank, kinds in order.items():
        tensor, data = groups_of[rank]
        calls = [ar(tensor if k == "tensor" else data) for k in kinds]
        groups = {"tensor": every[tensor], "data": every[data]}
        reports[rank] = report(rank, 4, calls, {tensor: every[tensor], data: every[data]})
        reports[rank]["groups"] = groups
    return reports


def test_the_issues_wait_cycle_is_named_with_every_rank_of_it() -> None:
    # 4 ranks, tensor 2: ranks 0 and 3 tensor then data, ranks 1 and 2 data then tensor.
    reports = four_ranks(
        {0: ["tensor", "data"], 1: ["data", "tensor"], 2: ["data", "tensor"], 3: ["tensor", "data"]}
    )
    found = check_calls(reports)
    assert len(found) == 1, found
    assert found[0].startswith(
        "wait cycle of ranks [0, 1, 2, 3]: rank 0 waits in all_reduce(float32[4]) on tensor group [0, 1]"
    )
    assert "rank 1 waits in all_reduce(float32[4]) on data group [1, 3] (train.py:10) for rank 3" in found[0]


def test_one_rank_swapping_alone_only_serialises_and_is_no_finding() -> None:
    reports = four_ranks(
        {0: ["tensor", "data"], 1: ["data", "tensor"], 2: ["tensor", "data"], 3: ["tensor", "data"]}
    )
    assert check_calls(reports) == []


def test_an_asynchronous_call_does_not_block_the_play() -> None:
    reports = four_ranks(
        {0: ["tensor", "data"], 1: ["data", "tensor"], 2: ["data", "tensor"], 3: ["tensor", "data"]}
    )
    for rank in (0, 3):  # their first call is async: they go on to the data group
        reports[rank]["calls"]["entries"][0]["async"] = True
    assert check_wait_cycles(reports) == []


def test_a_call_more_on_one_member_is_named_with_both_call_sites() -> None:
    members = [5, 13, 21, 29]
    reports = {}
    for r in members:
        calls = [ar("d", "train.py:57"), ar("d", "train.py:57")]
        if r == 13:
            calls.insert(1, ar("d", "train.py:59"))
        reports[r] = report(r, 32, calls, {"d": members}, {"pipeline": 2, "data": members.index(r)})
        reports[r]["groups"] = {"data": members, "pipeline": [r - 1, r]}
    (found,) = check_group_sequences(reports)
    assert found.startswith(
        "data group [5, 13, 21, 29] (pipeline stage 2): call 2 is all_reduce(float32[4]) on ranks [5, 21, 29] (train.py:57)"
    ), found
    assert "rank 13 made all_reduce(float32[4]) twice here (train.py:59)" in found


def test_point_to_point_without_its_counterpart_either_way() -> None:
    send = {
        "kind": "send",
        "on": "w",
        "peer": 1,
        "tag": 0,
        "agree": "float32[4]",
        "shown": "send(float32[4] to rank 1)",
    }
    recv = {
        "kind": "recv",
        "on": "w",
        "peer": 0,
        "tag": 0,
        "agree": "float32[4]",
        "shown": "recv(float32[4] from rank 0)",
    }
    reports = {0: report(0, 2, [send, send], {"w": None}), 1: report(1, 2, [recv], {"w": None})}
    (found,) = check_point_to_point(reports)
    assert (
        "rank 0 sends 2 times to rank 1" in found
        and "send 2, send(float32[4] to rank 1) (train.py:1), has no receive" in found
    )
    reports = {0: report(0, 2, [send], {"w": None}), 1: report(1, 2, [recv, recv], {"w": None})}
    (found,) = check_point_to_point(reports)
    assert "rank 1 receives 2 times from rank 0" in found and "has no send" in found
    other = dict(recv, agree="float32[8]", shown="recv(float32[8] from rank 0)")
    reports = {0: report(0, 2, [send], {"w": None}), 1: report(1, 2, [other], {"w": None})}
    (found,) = check_point_to_point(reports)
    assert (
        "send 1 is send(float32[4] to rank 1) tag 0 (train.py:1) but its receive is recv(float32[8] from rank 0)"
        in found
    )
    # a receive from any source takes the send
    anyone = dict(recv, peer=None)
    assert check_calls({0: report(0, 2, [send], {"w": None}), 1: report(1, 2, [anyone], {"w": None})}) == []


def test_ten_thousand_identical_steps_keep_a_small_report() -> None:
    ledger = CallLedger()
    for _ in range(10_000):
        ledger.note({"kind": "all_reduce", "group": "world", "agree": "a", "shown": "s", "where": "x:1"})
        ledger.note({"kind": "broadcast", "group": "world", "agree": "b", "shown": "s", "where": "x:2"})
    kept = ledger.to_json()
    assert kept["counts"] == {"world": 20_000}
    assert len(kept["entries"]) == kept["window"] == 1000 and kept["kept"] == 1000
    assert len(json.dumps(kept)) < 200_000
    one = CallLedger()
    for _ in range(10_000):  # one call a step folds into one entry
        one.note({"kind": "all_reduce", "group": "world", "agree": "a", "shown": "s", "where": "x:1"})
    assert one.to_json()["entries"] == [
        {"kind": "all_reduce", "group": "world", "agree": "a", "shown": "s", "where": "x:1", "n": 1000}
    ]


def test_a_difference_after_the_window_is_still_found() -> None:
    reports = {}
    for r in (0, 1):
        ledger = CallLedger(window=10)
        for _ in range(50 + r):
            ledger.note({"kind": "all_reduce", "group": "world", "agree": "a", "shown": "s", "where": "x:1"})
        reports[r] = {"rank": r, "world_size": 2, "calls": ledger.to_json(), "groups": {}, "coords": {}}
    (found,) = check_calls(reports)
    assert "differ after the calls every report keeps in full (calls made: rank 0: 50, rank 1: 51)" in found


# ---------------------------------------------------------------- sweeps of the user's scripts
@pytest.mark.sweeps
@pytest.mark.parametrize("functional", [False, True], ids=["dist", "functional"])
def test_a_32_rank_sweep_names_the_cycle_and_passes_the_serialising_swap(functional: bool) -> None:
    # functional: torch's functional all-reduce, waited for at once, blocks as dist.all_reduce does
    how = ("--functional",) if functional else ()
    bad = sweep(32, "swapped_groups.py", "--bug", "cycle", *how)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "wait cycle of ranks [0, 1, 4, 5]" in bad.stdout, bad.stdout
    assert site("swapped_groups.py", "funcol.all_reduce" if functional else "dist.all_reduce") in bad.stdout
    for args in (("--bug", "serialise", *how), how):
        good = sweep(32, "swapped_groups.py", *args)
        assert good.returncode == 0 and "all checks passed" in good.stdout, good.stdout + good.stderr


@pytest.mark.sweeps
def test_calls_are_not_recorded_when_turned_off_and_a_script_without_collectives_sweeps() -> None:
    off = sweep(32, "swapped_groups.py", "--bug", "cycle", extra=("--no-record-calls",))
    assert off.returncode == 0, off.stdout + off.stderr  # nothing recorded, nothing checked
    quiet = sweep(4, "../../tests/dryrun_no_collectives.py")
    assert quiet.returncode == 0 and "all checks passed" in quiet.stdout, quiet.stdout + quiet.stderr


BUGS = [
    ("extra_allreduce.py", (), ["data group [128, 132, 136", "(pipeline stage 2, tensor rank 0): call 4 is broadcast(float32[4, 8], root 0) on ranks",
                                f"rank 148 made all_reduce(float32[4, 8]) twice here ({site('extra_allreduce.py', '        dist.all_reduce')})"]),
    ("gather_shape.py", (), ["tensor group [192, 193, 194, 195] (pipeline stage 3, data rank 0): call 1 is all_gather_into_tensor(float32[8, 16]) on ranks [192, 193, 194]",
                             f"rank 195 made all_gather_into_tensor(float32[8, 17]) here ({site('gather_shape.py', 'dist.all_gather')})"]),
    ("skipped_recv.py", (), ["rank 93 sends 3 times to rank 157 on their pipeline group", "rank 157 receives from it 2 times",
                             f"send(float32[4, 8] to rank 157) ({site('skipped_recv.py', 'dist.send')}), has no receive"]),
    ("swapped_groups.py", ("cycle",), ["wait cycle of ranks [0, 1, 4, 5]", "rank 0 waits in all_reduce(float32[4, 8]) on data group [0, 4, 8",
                                       f"({site('swapped_groups.py', 'dist.all_reduce')}) for rank 4"]),
    ("broadcast_root.py", (), ["(pipeline stage 2, tensor rank 1): call 1 is broadcast(float32[16], root 0)",
                               f"rank 133 made broadcast(float32[16], root 1) here ({site('broadcast_root.py', 'dist.broadcast')})"]),
]  # fmt: skip


@pytest.mark.sweeps
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("script", "bug", "expected"), BUGS, ids=[b[0] for b in BUGS])
def test_a_256_rank_sweep_names_each_planted_bug_and_passes_without_it(
    script: str, bug: tuple, expected: list
) -> None:
    bad = sweep(256, script, "--bug", *bug)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    for text in expected:
        assert text in bad.stdout, (text, bad.stdout[-3000:])
    args = ("--bug", "serialise") if script == "swapped_groups.py" else ()
    good = sweep(256, script, *args)
    assert good.returncode == 0 and "all checks passed" in good.stdout, (
        good.stdout[-3000:] + good.stderr[-3000:]
    )


# ---------------------------------------------------------------- asynchronous point-to-point
def p2p(kind: str, peer: int | None, asynchronous: bool = False) -> dict:
    entry = {"kind": kind, "on": "world", "peer": peer, "tag": 0, "agree": "float32[4]"}
    entry["shown"] = f"{kind}(float32[4])"
    if asynchronous:
        entry["async"] = True
    return entry


def two_ranks(calls: dict[int, list[dict]]) -> dict[int, dict]:
    return {rank: report(rank, 2, own, {"world": None}) for rank, own in calls.items()}


@pytest.mark.sweeps
def test_a_dtensor_model_s_functional_collectives_are_in_the_sweep() -> None:
    # DTensor's forward, backward and full_tensor() reach the group through torch's functional
    # collectives, parallelize_module's distribute_tensor through the scatters and broadcasts
    # DTensor imported by name (4 of the 5 calls before); a gather that only tensor rank 0
    # makes is named with the user's line.
    bug = sweep(8, "dtensor_log.py", "--bug")
    assert bug.returncode == 1, bug.stdout[-3000:] + bug.stderr[-3000:]
    assert (
        "tensor group [4, 5, 6, 7] (pipeline stage 1): call 6 is not made on ranks [5, 6, 7] (they "
        "made 5 calls on it); rank 4 made all_gather_into_tensor(float32[4, 8]) in "
        f"addition here ({site('dtensor_log.py', 'full_tensor().norm')})"
    ) in bug.stdout, bug.stdout[-3000:]
    assert bug.stdout.count("tensor group [") == 2  # one finding per tensor group
    clean = sweep(8, "dtensor_log.py")
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]


def test_the_ledger_and_the_hang_report_agree_on_which_shapes_may_differ() -> None:
    # One policy (ledger.AGREED): the dry run compares what the hang report compares.
    import torch

    from parallelctx.guard.hang import _agreed_call

    def agree(kind: str, **given: object) -> str:
        return describe(kind, given, lambda r: 0 if r is None else r)[0]

    rows = [torch.empty(n, 4) for n in (3, 5)]
    # a gather's input must agree on every rank (the root's list is its own)
    assert agree("gather", tensor=torch.ones(2), gather_list=[torch.ones(2)] * 2) == agree(
        "gather", tensor=torch.ones(2)
    )
    assert agree("gather", tensor=torch.ones(2)) != agree("gather", tensor=torch.ones(3))
    assert _agreed_call("gather", ([], [torch.ones(2)])) != _agreed_call("gather", ([], [torch.ones(3)]))
    # all_to_all_single with splits: rows per rank, the rest alike
    a, b = ({"output": r, "input": r, "input_split_sizes": [1, 2]} for r in rows)
    assert agree("all_to_all_single", **a) == agree("all_to_all_single", **b)
    assert agree("all_to_all_single", **a) != agree(
        "all_to_all_single", output=torch.empty(3, 2), input=torch.empty(3, 2), input_split_sizes=[1, 2]
    )
    assert _agreed_call("all_to_all_single", (rows[0], rows[0], [1, 2], [2, 1])) == _agreed_call(
        "all_to_all_single", (rows[1], rows[1], [2, 3], [4, 1])
    )


def test_an_isend_then_a_blocking_recv_on_both_ranks_is_no_cycle() -> None:
    # req = dist.isend(out, peer); dist.recv(inp, peer); req.wait(): the isend is posted first.
    reports = two_ranks(
        {0: [p2p("isend", 1, True), p2p("recv", 1)], 1: [p2p("isend", 0, True), p2p("recv", 0)]}
    )
    assert check_calls(reports) == []


def test_an_irecv_posted_before_a_blocking_send_takes_it() -> None:
    reports = two_ranks(
        {0: [p2p("irecv", 1, True), p2p("send", 1)], 1: [p2p("irecv", 0, True), p2p("send", 0)]}
    )
    assert check_calls(reports) == []
    # one side blocking-sends first and the other posted its irecv: still fine
    reports = two_ranks({0: [p2p("send", 1), p2p("recv", 1)], 1: [p2p("irecv", 0, True), p2p("send", 0)]})
    assert check_calls(reports) == []


def test_both_ranks_blocking_send_first_is_still_a_cycle() -> None:
    # gloo's send waits for its receive, even for 4 floats: a real hang.
    reports = two_ranks({0: [p2p("send", 1), p2p("recv", 1)], 1: [p2p("send", 0), p2p("recv", 0)]})
    found = check_wait_cycles(reports)
    assert len(found) == 1 and found[0].startswith("wait cycle of ranks [0, 1]"), found


def test_a_member_without_any_call_on_a_group_is_named_not_a_crash() -> None:
    # ranks 0 and 1 all_reduce on the world, rank 2 makes no call at all (its only one skipped)
    reports = {rank: report(rank, 3, [ar("world")] if rank < 2 else [], {"world": None}) for rank in range(3)}
    found = check_group_sequences(reports)
    assert len(found) == 1 and "rank 2 made no call 1 here (it made 0)" in found[0], found


@pytest.mark.sweeps
@pytest.mark.parametrize(
    "pattern", ["isend_then_recv", "irecv_then_send", "p2pop", "anysrc", "uneven_all_gather"]
)
def test_correct_point_to_point_patterns_pass_a_sweep(pattern: str) -> None:
    cmd = [sys.executable, "-m", "parallelctx", "dry-run", "--world-size", "4", "--ranks", "all", "--quiet"]
    cmd += [str(ROOT / "tests" / "dryrun_p2p_patterns.py"), pattern]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "all checks passed" in done.stdout + done.stderr


def test_two_members_differing_only_in_the_reduce_op_are_shown_apart() -> None:
    from parallelctx.guard.ledger import describe

    _, shown_sum = describe("all_reduce", {"tensor": None}, lambda r: r)
    _, shown_max = describe("all_reduce", {"tensor": None, "op": "ReduceOp.MAX"}, lambda r: r)
    assert shown_sum == "all_reduce()" and shown_max == "all_reduce(op MAX)"
    # two variants whose calls read alike are still told apart by what they must agree on
    calls = {
        0: [ar("world", agree="all_reduce float32[4] SUM")],
        1: [ar("world", agree="all_reduce float32[4] MAX")],
    }
    found = check_group_sequences({r: report(r, 2, own, {"world": None}) for r, own in calls.items()})
    assert len(found) == 1, found
    assert "ranks [0] made all_reduce(float32[4]) (train.py:10) [all_reduce float32[4] SUM]" in found[0]
    assert "ranks [1] made all_reduce(float32[4]) (train.py:10) [all_reduce float32[4] MAX]" in found[0]


def test_a_receive_skipped_after_the_window_is_still_found() -> None:
    # rank 0 sends 1,500 times to rank 1, which receives 1,499 times: past the 1,000 kept calls
    calls = {0: [p2p("send", 1)] * 1500, 1: [p2p("recv", 0)] * 1499}
    reports = two_ranks(calls)
    found = check_point_to_point(reports)
    assert found == [
        "rank 0 -> rank 1: after the calls every report keeps in full, rank 0 sends 1500 times to rank 1 "
        "and rank 1 receives 1499 times from it; run fewer steps in the dry run to see where"
    ], found
    assert check_point_to_point(two_ranks({0: [p2p("send", 1)] * 1500, 1: [p2p("recv", 0)] * 1500})) == []
