"""The pytest plugin fails a pooled test that leaves a process group unbalanced (a call some
members made that the others never matched) and gives the next test fresh processes; balanced
tests keep the pool's processes. The inner runs go through pytest's own ``pytester``, on pools of
2 ranks (gloo on CPU); :func:`parallelctx.testing.balance.unbalanced` is also checked directly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from parallelctx.testing.balance import ANY_SOURCE, unbalanced

pytest_plugins = ["pytester"]

HEADER = """
import json, os
from pathlib import Path
import pytest, torch, torch.distributed as dist
from parallelctx import gpc

def note(name, **values):
    Path(f"{name}-{dist.get_rank()}").write_text(json.dumps(dict(pid=os.getpid(), **values)))
"""


@pytest.fixture(autouse=True)
def _no_gpc_left_behind() -> Iterator[None]:
    """pytester runs the inner session in this process: leave no gpc for the next test here."""
    yield
    from parallelctx import ParallelMode, gpc

    if gpc.is_initialized(ParallelMode.GLOBAL):
        gpc.destroy()


def _notes(pytester: pytest.Pytester, name: str) -> dict[int, dict[str, Any]]:
    return {int(p.name.rsplit("-", 1)[1]): json.loads(p.read_text()) for p in pytester.path.glob(f"{name}-*")}


def _group(
    name: str, ranks: list[int], calls: dict[str, int] | None = None, **p2p: dict[int, int]
) -> dict[str, Any]:
    return {
        "name": name,
        "ranks": ranks,
        "what": f"the {name} group",
        "calls": calls or {},
        "sent": p2p.get("sent", {}),
        "received": p2p.get("received", {}),
    }


def test_unbalanced_names_the_group_the_ranks_and_their_counts() -> None:
    data02 = [0, 2]
    counts = {
        0: [_group("data", data02, {"all_reduce": 2}), _group("pipe", [0, 1], sent={1: 1})],
        1: [_group("pipe", [0, 1], received={0: 1})],
        2: [_group("data", data02, {"all_reduce": 1})],
        3: [],
    }
    assert unbalanced(counts) == [
        "the data group (ranks 0, 2): rank 0 made 2 collective calls on it (all_reduce x2); "
        "rank 2 made 1 collective call on it (all_reduce x1)"
    ]
    counts[2] = [_group("data", data02, {"all_reduce": 1, "broadcast": 1})]  # as many calls, other kinds
    assert unbalanced(counts) == [
        "the data group (ranks 0, 2): rank 0 made 2 collective calls on it (all_reduce x2); "
        "rank 2 made 2 collective calls on it (all_reduce x1, broadcast x1)"
    ]
    counts[2] = [_group("data", data02, {"all_reduce": 2})]
    assert unbalanced(counts) == []


def test_unbalanced_matches_sends_with_receives() -> None:
    ranks = [0, 1, 2]
    counts = {
        0: [_group("pipe", ranks, sent={1: 2})],
        1: [_group("pipe", ranks, received={0: 1}, sent={2: 1})],
        2: [_group("pipe", ranks)],
    }
    assert unbalanced(counts) == [
        "the pipe group (ranks 0, 1, 2): rank 0 sent 2 tensor(s) to rank 1, which received 1 from rank 0",
        "the pipe group (ranks 0, 1, 2): rank 1 sent 1 tensor(s) to rank 2, which received 0 from rank 1",
    ]
    # a receive from any source (recv without src) matches any sender: the totals are compared
    counts[1] = [_group("pipe", ranks, received={0: 1, ANY_SOURCE: 1}, sent={2: 1})]
    counts[2] = [_group("pipe", ranks, received={1: 1})]
    assert unbalanced(counts) == []
    counts[0] = [_group("pipe", ranks, sent={1: 3})]
    assert unbalanced(counts) == [
        "the pipe group (ranks 0, 1, 2): rank 1 received 2 tensor(s) (1 from any source), "
        "but its peers sent it 3 (3 from rank 0)"
    ]


def test_unbalanced_compares_nothing_without_every_rank_s_counts() -> None:
    assert unbalanced({0: [_group("data", [0, 1], {"all_reduce": 1})], 1: None}) == []
    assert unbalanced({}) == []


def test_an_unbalanced_test_fails_naming_the_extra_call_and_the_next_test_gets_the_right_answer(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        HEADER
        + """
@pytest.mark.parallel(world_size=2, timeout=60)
def test_rank_0_leaves_an_all_reduce():
    note("first")
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never waited; rank 1 never makes it

@pytest.mark.parallel(world_size=2, timeout=60)
def test_rank_0_leaves_an_isend_on_its_own_group():
    group = dist.new_group([0, 1])
    dist.barrier(group=group)
    if dist.get_rank() == 0:
        dist.isend(torch.ones(1), dst=1, group=group)  # rank 1 never receives it

@pytest.mark.parallel(world_size=2, timeout=60)
def test_rank_1_leaves_a_functional_all_reduce():
    import torch.distributed._functional_collectives as funcol

    if dist.get_rank() == 1:  # a DTensor-style call that reaches the group in C++
        funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD)

@pytest.mark.parallel(world_size=2, timeout=60)
def test_correct():
    x = torch.ones(1)
    dist.all_reduce(x)
    note("correct", value=x.item())
    assert x.item() == 2.0
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*_ test_rank_0_leaves_an_all_reduce _*",
            "every rank passed, but the test left calls unmatched on a process group: *",
            "  the default group (*) (ranks 0, 1): rank 0 made 1 collective call on it (all_reduce x1); "
            "rank 1 made none",
            "Have every member of a group make the same collectives, wait for each async_op=True call*",
            "*_ test_rank_0_leaves_an_isend_on_its_own_group _*",
            "every rank passed, but the test left calls unmatched on a process group: *",
            "  group '*' (not one of gpc's) (ranks 0, 1): rank 0 sent 1 tensor(s) to rank 1, "
            "which received 0 from rank 0",
            "*_ test_rank_1_leaves_a_functional_all_reduce _*",
            "  the default group (*) (ranks 0, 1): rank 0 made none; "
            "rank 1 made 1 collective call on it (all_reduce x1)",
        ]
    )
    first, correct = _notes(pytester, "first"), _notes(pytester, "correct")
    assert {r: n["value"] for r, n in correct.items()} == {0: 2.0, 1: 2.0}
    assert not {n["pid"] for n in first.values()} & {n["pid"] for n in correct.values()}, (
        "the test after an unbalanced one runs on fresh session processes"
    )


def test_balanced_tests_pass_on_the_same_processes_and_a_later_unbalanced_one_is_caught(
    pytester: pytest.Pytester,
) -> None:
    # the hang report wraps the same ProcessGroup methods over the plugin's counting: both work
    pytester.makepyfile(
        HEADER
        + """
CONFIG = {"dist": {"hang_report": {"after": 60}}}

@pytest.mark.parallel(world_size=2, tensor=2, config=CONFIG, timeout=60)
def test_balanced_a():
    group = gpc.get_group("tensor")
    x = torch.ones(2)
    dist.all_reduce(x, group=group)
    work = dist.all_reduce(torch.ones(1), async_op=True)
    out = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(out, x, group=group)
    buf = torch.zeros(1)
    peer = 1 - dist.get_rank()
    ops = [dist.P2POp(dist.isend, torch.ones(1), peer), dist.P2POp(dist.irecv, buf, peer)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    work.wait()
    import torch.distributed._functional_collectives as funcol
    assert funcol.all_reduce(torch.ones(1), "sum", group).wait().item() == 2.0  # counted on both
    note("a")

@pytest.mark.parallel(world_size=2, tensor=2, config=CONFIG, timeout=60)
def test_balanced_b():
    x = torch.ones(1)
    if dist.get_rank() == 0:
        dist.send(x, dst=1)
    else:
        dist.recv(x)  # from any source
    dist.all_reduce(x)
    note("b", value=x.item())

@pytest.mark.parallel(world_size=2, tensor=2, config=CONFIG, timeout=60)
def test_rank_1_leaves_a_broadcast():
    if dist.get_rank() == 1:
        dist.broadcast(torch.ones(1), src=0, group=gpc.get_group("tensor"), async_op=True)
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*_ test_rank_1_leaves_a_broadcast _*",
            "  the default group (*) (ranks 0, 1): rank 0 made none; "
            "rank 1 made 1 collective call on it (broadcast x1)",
        ]
    )
    a, b = _notes(pytester, "a"), _notes(pytester, "b")
    assert {r: n["value"] for r, n in b.items()} == {0: 2.0, 1: 2.0}
    assert {r: n["pid"] for r, n in a.items()} == {r: n["pid"] for r, n in b.items()}, (
        "balanced tests run on the same session processes"
    )
