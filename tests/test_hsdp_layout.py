"""HSDP data axes (pure): data = replicate (outer) × shard (inner), in the dense and expert grids,
the config that asks for them, and their seed streams."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from pydantic import ValidationError

from parallelctx import Config, ParallelMode, plan
from parallelctx.layout import LayoutError
from parallelctx.seed import mode_seed

M = ParallelMode
NEW = (M.DATA_SHARD, M.DATA_REPLICATE, M.DATA_SHARD_CONTEXT, M.EXPERT_DATA_SHARD, M.EXPERT_DATA_REPLICATE)
OLD = [m for m in ParallelMode if m not in NEW]


def test_worked_example_8_ranks() -> None:
    layout = plan(8, tensor=2, replicate=2)
    assert (layout.data, layout.replicate, layout.shard) == (4, 2, 2)
    assert layout.groups(M.DATA) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups(M.DATA_SHARD) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups(M.DATA_REPLICATE) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.describe() == "world=8 tp=2 cp=1 dp=4 pp=1 dp_replicate=2 dp_shard=2 order=tp-cp-ep-dp-pp"


def test_default_order_is_torchtitans_mesh() -> None:
    # torchtitan: arange(W).reshape(pp, dp_replicate, dp_shard, cp, tp)
    P, R, S, C, T = 2, 2, 3, 2, 2
    layout = plan(P * R * S * C * T, tensor=T, pipeline=P, context=C, replicate=R)
    cube = np.arange(layout.world_size).reshape(P, R, S, C, T)
    for pp, r, s, cp, tp in itertools.product(range(P), range(R), range(S), range(C), range(T)):
        c = layout.coords(int(cube[pp, r, s, cp, tp]))
        assert (c["pp"], c["dp_replicate"], c["dp_shard"], c["cp"], c["tp"]) == (pp, r, s, cp, tp)
        assert c["dp"] == r * S + s
    assert layout.group_of(M.DATA_SHARD_CONTEXT, 0) == sorted(cube[0, 0, :, :, 0].ravel().tolist())


def _shapes() -> list[dict]:
    out = []
    for world, order in itertools.product((8, 16, 24), ("tp-cp-ep-dp-pp", "tp-pp-dp", "tp-cp-ep-pp-dp")):
        for tp, pp, cp, ep, etp, rep in itertools.product(
            (1, 2), (1, 2), (1, 2), (1, 2, 4), (1, 2), (1, 2, 3)
        ):
            kw = dict(
                tensor=tp, pipeline=pp, context=cp, expert=ep, expert_tensor=etp, order=order, replicate=rep
            )
            try:
                plan(world, **kw)
            except LayoutError:
                continue
            out.append(dict(world_size=world, **kw))
    return out


SHAPES = _shapes()


def test_enough_shapes() -> None:
    assert len(SHAPES) > 200
    assert sum(s["replicate"] > 1 and s["expert"] > 1 for s in SHAPES) > 30


@pytest.mark.parametrize("kw", SHAPES[::3], ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_split_invariants(kw: dict) -> None:
    layout = plan(**kw)
    base = plan(**{**kw, "replicate": 1})
    rep = layout.replicate
    # replicate changes no existing mode's groups, so Megatron parity holds for every layout
    for mode in OLD:
        assert layout.groups(mode) == base.groups(mode), mode
    for whole, shard, replica in (
        (M.DATA, M.DATA_SHARD, M.DATA_REPLICATE),
        (M.EXPERT_DATA, M.EXPERT_DATA_SHARD, M.EXPERT_DATA_REPLICATE),
    ):
        assert layout.size(shard) * layout.size(replica) == layout.size(whole)
        assert layout.size(replica) == rep
        for mode in (shard, replica):
            flat = sorted(r for g in layout.groups(mode) for r in g)
            assert flat == list(range(layout.world_size)), "the groups partition the world"
        for r in range(0, layout.world_size, 5):
            members = layout.group_of(whole, r)
            # shard is the inner part: each shard group is a run of consecutive data-group members
            k = members.index(r) // layout.size(shard)
            assert layout.group_of(shard, r) == members[k * layout.size(shard) : (k + 1) * layout.size(shard)]
            # replicate is the outer part: every shard-th member
            assert (
                layout.group_of(replica, r)
                == members[members.index(r) % layout.size(shard) :: layout.size(shard)]
            )
            assert len(set(layout.group_of(shard, r)) & set(layout.group_of(replica, r))) == 1
    for r in range(0, layout.world_size, 3):
        expect = sorted(
            set(layout.group_of(M.DATA_SHARD, r))
            | set(layout.group_of(M.CONTEXT, r))
            | {a + b - r for a in layout.group_of(M.DATA_SHARD, r) for b in layout.group_of(M.CONTEXT, r)}
        )
        assert layout.group_of(M.DATA_SHARD_CONTEXT, r) == expect
    for mode in NEW:
        assert (layout.signature(mode) == layout.signature(M.DATA)) == (
            layout.groups(mode) == layout.groups(M.DATA)
        )


def test_replicate_one_is_todays_layout() -> None:
    layout = plan(16, tensor=2, context=2)
    assert layout.groups(M.DATA_SHARD) == layout.groups(M.DATA)
    assert layout.groups(M.DATA_SHARD_CONTEXT) == layout.groups(M.DATA_CONTEXT)
    assert layout.size(M.DATA_REPLICATE) == layout.size(M.EXPERT_DATA_REPLICATE) == 1
    assert layout.signature(M.DATA_SHARD) == layout.signature(M.DATA)


def test_refusals_name_the_numbers() -> None:
    with pytest.raises(LayoutError, match=r"replicate=3 does not divide the data size 4"):
        plan(8, tensor=2, replicate=3)
    with pytest.raises(LayoutError, match=r"replicate=4 does not divide the expert-data size 2"):
        plan(8, expert=4, replicate=4, expert_tensor=1, tensor=1, context=2)
    with pytest.raises(LayoutError, match=r"replicate=0 must be a positive integer"):
        plan(8, replicate=0)


@pytest.mark.parametrize(
    ("data", "world", "expect"),
    [
        (dict(replicate=2), 8, (4, 2, 2)),
        (dict(replicate=2, shard=2), 8, (4, 2, 2)),
        (dict(shard=4), 8, (4, 1, 4)),
        (dict(size=4, replicate=4), 8, (4, 4, 1)),
        (4, 8, (4, 1, 4)),
        (None, 8, (4, 1, 4)),
    ],
)
def test_config_data_forms(data: object, world: int, expect: tuple) -> None:
    cfg = Config({"parallel": {"tensor": 2, "data": data}})
    layout = cfg.parallel.to_layout(world)
    assert (layout.data, layout.replicate, layout.shard) == expect


@pytest.mark.parametrize(
    ("data", "error", "text"),
    [
        (dict(replicate=2, shard=3), LayoutError, r"parallel.data.shard=3 but .* = 2; drop shard"),
        (dict(replicate=3), LayoutError, r"replicate=3 does not divide the data size 4"),
        (dict(size=2), LayoutError, r"parallel.data=2 but world_size=8"),
        (dict(replicate=2, shrad=2), ValidationError, r"unknown key 'shrad'; did you mean 'shard'\?"),
        (dict(replicate=True), ValidationError, r"replicate=True is of type bool"),
        (dict(replicate=0), ValidationError, r"replicate=0 must be greater than 0"),
        (dict(size=4, replicate=2, shard=4), ValidationError, r"size=4 is not replicate=2 x shard=4 = 8"),
        ("4", ValidationError, r"data='4' is of type str"),
    ],
)
def test_config_refusals(data: object, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        Config({"parallel": {"tensor": 2, "data": data}}).parallel.to_layout(8)


def test_seed_streams_of_the_new_modes() -> None:
    layout = plan(48, tensor=2, pipeline=3, replicate=2, expert=2, expert_tensor=1)
    seeds = {r: {m: mode_seed(layout, r, m, 99) for m in ParallelMode} for r in range(48)}
    for per_mode in seeds.values():
        assert len(set(per_mode.values())) == len(ParallelMode), "modes never share a seed on a rank"
    for mode in NEW:
        for group in layout.groups(mode):
            assert len({seeds[r][mode] for r in group}) == 1, "one stream across the group, like DATA"
        for group in layout.groups(M.PIPELINE):
            assert len({seeds[r][mode] for r in group}) == len(group), "one stream per stage"


def test_mesh_names_are_mode_aliases() -> None:
    assert ParallelMode.parse("dp_shard") is M.DATA_SHARD
    assert ParallelMode.parse("DP_REPLICATE") is M.DATA_REPLICATE
    assert ParallelMode.parse("efsdp") is M.EXPERT_DATA_SHARD
    assert ParallelMode.parse("fsdp") is M.DATA_SHARD_CONTEXT


def test_plan_command_takes_the_split(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from parallelctx.cli.main import main

    assert main(["plan", "--world-size", "8", "--tensor", "2", "--replicate", "2", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)
    assert groups["data_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["data_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert main(["plan", "--world-size", "8", "--tensor", "2", "--replicate", "2", "--shard", "4"]) == 2
    assert "parallel.data.shard=4 but" in capsys.readouterr().err
