"""gpc.reform()'s plan and agreement, without processes: which ranks leave, how the survivors are
renumbered (checked against a fresh layout of the smaller world, group by group), what is
refused, and the survivors' agreement on a store (threads standing in for the ranks)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallelctx.config import load_config
from parallelctx.planning.layout import Layout, LayoutError
from parallelctx.planning.reform import shrink
from parallelctx.runtime.reform import ReformError, agree_exclusion

MODES = ("tensor", "pipeline", "context", "data", "expert", "expert_data", "data_shard", "data_replicate")


@pytest.mark.parametrize(
    ("sizes", "exclude", "rule", "leaving"),
    [
        (dict(tensor=2), [5], "data", [4, 5]),
        (dict(tensor=2, pipeline=2), [5], "data", [0, 1, 4, 5]),  # a replica holds every stage
        (dict(tensor=2, pipeline=2, order="tp-dp-pp"), [3, 7], "data", [2, 3, 6, 7]),
        (dict(tensor=2, context=2, order="dp-tp-cp"), [0], "data", [0, 4, 8, 12]),
        (dict(tensor=2, replicate=2), [9], "replicate", [8, 9, 10, 11, 12, 13, 14, 15]),
        (dict(tensor=2, expert=2, expert_tensor=1), [1], "data", [0, 1]),
    ],
)
def test_survivors_are_a_fresh_layout_of_the_smaller_world(
    sizes: dict, exclude: list[int], rule: str, leaving: list[int]
) -> None:
    world = 16 if sizes.get("replicate") or sizes.get("context") else 8
    old = Layout(world, **sizes)
    shrunk = shrink(old, exclude, rule)
    assert list(shrunk.leaving) == leaving
    assert list(shrunk.survivors) == [r for r in range(world) if r not in leaving]
    fresh = Layout(len(shrunk.survivors), **{k: v for k, v in sizes.items() if k != "replicate"},
                   replicate=shrunk.replicate)  # fmt: skip
    assert shrunk.layout == fresh
    for mode in MODES:
        if mode not in [m.value for m in fresh.modes()]:
            continue
        # every survivor's old group, minus the ranks that left and renumbered, is its new group
        for old_rank in shrunk.survivors:
            before = [shrunk.new_rank(r) for r in old.group_of(mode, old_rank) if r in shrunk.survivors]
            assert before == fresh.group_of(mode, shrunk.new_rank(old_rank)), (mode, old_rank)


def test_what_cannot_shrink_is_refused_by_name() -> None:
    with pytest.raises(LayoutError, match=r"none survives"):
        shrink(Layout(4, tensor=2, pipeline=2), [0], "data")
    with pytest.raises(LayoutError, match=r"parallel.reform='off'.*set parallel.reform='data'"):
        shrink(Layout(8, tensor=2), [3], "off")
    with pytest.raises(LayoutError, match=r"would leave data=7 on 7 ranks.*'replicate' may fit"):
        shrink(Layout(8, tensor=1, replicate=2), [3], "data")  # data 7 that replicate=2 does not divide
    with pytest.raises(LayoutError, match=r"rank 9 is outside the world of 8"):
        shrink(Layout(8), [9])
    with pytest.raises(LayoutError, match=r"names no rank"):
        shrink(Layout(8), [])
    with pytest.raises(LayoutError, match=r"would leave.*expert"):
        shrink(Layout(8, expert=8), [3], "data")  # expert=8 does not divide 7 ranks


def test_the_rule_is_a_config_key() -> None:
    assert load_config({}).parallel.reform == "data"
    assert load_config({"parallel": {"reform": "replicate"}}).parallel.reform == "replicate"
    with pytest.raises(ValueError, match=r"parallel.reform"):
        load_config({"parallel": {"reform": "tensor"}})


def _agree(
    views: dict[int, list[int]], stay: list[int], timeout: float = 5.0
) -> dict[int, BaseException | None]:
    store = dist.HashStore()
    results: dict[int, BaseException | None] = {}

    def run(rank: int) -> None:
        try:
            agree_exclusion(store, rank, views[rank], stay, timedelta(seconds=timeout))
            results[rank] = None
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in views]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_survivors_that_agree_go_on() -> None:
    results = _agree({r: [5] for r in (0, 1, 2, 3, 4, 6, 7)}, stay=[0, 1, 2, 3, 6, 7])
    assert results == {r: None for r in (0, 1, 2, 3, 4, 6, 7)}


def test_a_rank_excluded_by_some_and_not_others_is_refused_on_every_rank_that_stays() -> None:
    views = {0: [5], 1: [5], 2: [5, 6], 3: [5], 6: [5], 7: [5]}
    results = _agree(views, stay=[0, 1, 2, 3, 6, 7])
    for rank in (0, 1, 2, 3, 7):  # 6 is waited for only by ranks that keep it; all see rank 2's view in time
        assert isinstance(results[rank], ReformError), (rank, results[rank])
        assert "rank 6 is excluded by rank 2 but not by" in str(results[rank])


def test_a_rank_that_never_comes_is_named_with_the_fix() -> None:
    results = _agree({r: [5] for r in (0, 1, 2)}, stay=[0, 1, 2, 3], timeout=1.0)
    assert all(isinstance(e, ReformError) for e in results.values())
    assert "rank 3 did not come to reform within 1 s" in str(results[0])
    assert "exclude=[3, 5]" in str(results[0])
