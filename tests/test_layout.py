"""The pure layout maths: worked examples, invariants over many shapes, errors, scale."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelctx import LayoutError, ParallelMode, plan
from parallelctx.layout import MAX_WORLD_SIZE, parse_order

LATTICE_MODES = [m for m in ParallelMode if m is not ParallelMode.EMBEDDING]


# --------------------------------------------------------------------------- worked examples
def test_design_example_default_order() -> None:
    layout = plan(8, tensor=2, pipeline=2)
    assert layout.data == 2
    assert layout.groups(ParallelMode.TENSOR) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups(ParallelMode.DATA) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups(ParallelMode.PIPELINE) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups(ParallelMode.MODEL) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.groups(ParallelMode.EMBEDDING) == layout.groups(ParallelMode.PIPELINE)
    assert layout.groups(ParallelMode.GLOBAL) == [list(range(8))]


def test_design_example_internlm_order() -> None:
    layout = plan(8, tensor=2, pipeline=2, order="tp-pp-dp")
    assert layout.groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("pipeline") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("data") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_default_order_is_reshape_of_arange() -> None:
    # docs/layout.md: the default order is arange(W).reshape(P, D, C, T)
    layout = plan(48, tensor=2, pipeline=3, context=2)
    cube = np.arange(48).reshape(3, layout.data, 2, 2)
    for pp, dp, cp, tp in itertools.product(range(3), range(layout.data), range(2), range(2)):
        rank = int(cube[pp, dp, cp, tp])
        c = layout.coords(rank)
        assert (c["pp"], c["dp"], c["cp"], c["tp"]) == (pp, dp, cp, tp)


def test_embedding_with_long_pipeline() -> None:
    layout = plan(8, pipeline=4)
    assert layout.groups(ParallelMode.EMBEDDING) == [[0, 6], [1, 7]]
    assert layout.group_of(ParallelMode.EMBEDDING, 2) == []
    assert layout.group_of(ParallelMode.EMBEDDING, 7) == [1, 7]
    with pytest.raises(LayoutError, match="belongs to no embedding group"):
        layout.local_rank(ParallelMode.EMBEDDING, 4)


def test_context_and_data_context() -> None:
    layout = plan(16, tensor=2, context=2, pipeline=2)
    assert layout.data == 2
    assert layout.group_of("context", 0) == [0, 2]
    assert layout.group_of("data", 0) == [0, 4]
    assert layout.group_of("data_context", 0) == [0, 2, 4, 6]


def test_strings_and_members_are_interchangeable() -> None:
    layout = plan(8, tensor=2)
    assert layout.groups("tensor") == layout.groups(ParallelMode.TENSOR)
    assert {ParallelMode.TENSOR: 1}["tensor"] == 1
    with pytest.raises(LayoutError, match="unknown parallel mode 'tensr'"):
        layout.groups("tensr")


# --------------------------------------------------------------------------- invariants
@st.composite
def layouts(draw: st.DrawFn):
    tensor = draw(st.sampled_from([1, 2, 3, 4, 8]))
    pipeline = draw(st.sampled_from([1, 2, 3, 4]))
    context = draw(st.sampled_from([1, 2]))
    expert = draw(st.sampled_from([1, 2, 4]))
    expert_tensor = draw(st.sampled_from([1, tensor]))
    data = draw(st.integers(1, 6))
    world = tensor * pipeline * context * data
    order = draw(
        st.sampled_from(
            ["tp-cp-ep-dp-pp", "tp-pp-dp-cp-ep", "tp-cp-ep-pp-dp", "dp-tp-cp-ep-pp", "pp-tp-cp-ep-dp"]
        )
    )
    try:
        return plan(world, tensor, pipeline, context, expert, expert_tensor, order)
    except LayoutError:
        return plan(
            world, tensor, pipeline, context, order=order if order.endswith("pp") else "tp-cp-ep-dp-pp"
        )


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_invariants(layout) -> None:
    world = layout.world_size
    for mode in LATTICE_MODES:
        array = layout.group_array(mode)
        # partition of the world, equal sizes, ascending members, rows sorted by first member
        assert sorted(array.ravel().tolist()) == list(range(world)), mode
        assert array.shape[1] == layout.size(mode)
        assert (np.diff(array, axis=1) > 0).all()
        assert (np.diff(array[:, 0]) > 0).all()
        # group_of (O(group)) agrees with the whole-world array, and local ranks are indices
        for row in array[:: max(1, len(array) // 5)].tolist():
            for r in row[:3]:
                assert layout.group_of(mode, r) == row
                assert layout.local_rank(mode, r) == row.index(r)
    # orthogonality: a tensor group and a data group (or pipeline group) share at most one rank
    pairs = [
        (ParallelMode.TENSOR, ParallelMode.DATA),
        (ParallelMode.TENSOR, ParallelMode.PIPELINE),
        (ParallelMode.DATA, ParallelMode.PIPELINE),
        (ParallelMode.CONTEXT, ParallelMode.DATA),
        (ParallelMode.EXPERT, ParallelMode.EXPERT_DATA),
    ]
    for a, b in pairs:
        for r in range(0, world, max(1, world // 7)):
            assert len(set(layout.group_of(a, r)) & set(layout.group_of(b, r))) == 1
    # rank = sum(coordinate * stride) in both grids
    dense, expert = layout.strides("dense"), layout.strides("expert")
    for r in range(world):
        c = layout.coords(r)
        assert r == sum(c[t] * dense[t] for t in ("tp", "cp", "dp", "pp"))
        assert (
            r
            == c["etp"] * expert["tp"]
            + c["ep"] * expert["ep"]
            + c["edp"] * expert["dp"]
            + c["pp"] * expert["pp"]
        )
    # the expert grid reuses the dense pipeline groups
    assert layout.groups("pipeline") == layout.group_array("pipeline").tolist()
    # identical signatures mean identical groups
    for a, b in itertools.combinations(LATTICE_MODES, 2):
        same = np.array_equal(layout.group_array(a), layout.group_array(b))
        assert same == (layout.signature(a) == layout.signature(b)), (a, b)


def test_model_is_tensor_times_pipeline() -> None:
    layout = plan(24, tensor=2, pipeline=3)
    for r in range(24):
        t = set(layout.group_of("tensor", r))
        p = set(layout.group_of("pipeline", r))
        model = set(layout.group_of("model", r))
        assert t | p <= model and len(model) == 6


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(world_size=8, tensor=3), "tensor=3 x pipeline=1 x context=1 = 3 does not divide world_size=8"),
        (dict(world_size=8, tensor=0), "tensor=0 must be a positive integer"),
        (dict(world_size=8, pipeline=-2), "pipeline=-2 must be a positive integer"),
        (dict(world_size=8, tensor=True), "tensor=True must be a positive integer"),
        (dict(world_size=0), "world_size=0 must be a positive integer"),
        (dict(world_size=8, order="tp-xp-dp"), "unknown token 'xp'"),
        (dict(world_size=8, order="tp-dp-tp"), "repeats tp"),
        (dict(world_size=8, order=""), "must be a string"),
        (dict(world_size=8, context=2, order="tp-pp-dp"), "leaves out 'cp' but the context size is 2"),
        (
            dict(world_size=8, expert=3),
            "expert_tensor=1 x expert=3 x pipeline=1 = 3 does not divide world_size=8",
        ),
        (
            dict(world_size=16, tensor=2, pipeline=2, expert=4, expert_tensor=1, order="tp-cp-ep-pp-dp"),
            "does not end with 'pp'",
        ),
    ],
)
def test_errors_name_the_values(kwargs, message) -> None:
    with pytest.raises(LayoutError) as info:
        plan(**kwargs)
    assert message in str(info.value)


def test_parse_order() -> None:
    assert parse_order("TP-cp-EP-dp-PP") == ("tp", "cp", "ep", "dp", "pp")
    with pytest.raises(LayoutError):
        parse_order("tp--dp")


def test_rank_out_of_range() -> None:
    layout = plan(4, tensor=2)
    with pytest.raises(LayoutError, match=r"rank=4 is outside \[0, world_size=4\)"):
        layout.group_of("tensor", 4)
    with pytest.raises(LayoutError):
        layout.coords(-1)


# --------------------------------------------------------------------------- scale
@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "pp-dp-tp-cp-ep", "dp-tp-cp-ep-pp"])
def test_small_and_large_groups_are_listed_alike(order: str) -> None:
    # group_of lists a group of up to 256 members in Python and a larger one with numpy: both
    # must give the whole-world array's row (here data groups of 300, 128 and 257 members)
    for world, tensor, pipeline in ((600, 2, 1), (1024, 2, 4), (1028, 2, 2)):
        layout = plan(world, tensor=tensor, pipeline=pipeline, order=order)
        for mode in LATTICE_MODES:
            array = layout.group_array(mode).tolist()
            for row in (array[0], array[len(array) // 2], array[-1]):
                assert layout.group_of(mode, row[-1]) == row, (mode, world)
                assert layout.local_rank(mode, row[-1]) == len(row) - 1
                # plain ints whichever way it was listed, for a numpy rank too (json, pickle)
                assert {type(m) for m in layout.group_of(mode, np.int64(row[0]))} == {int}


def test_one_million_ranks() -> None:
    world = 1_048_576
    layout = plan(world, tensor=8, pipeline=16)
    assert layout.data == world // 128
    for mode in LATTICE_MODES:
        array = layout.group_array(mode)
        assert array.shape[0] * array.shape[1] == world
        assert np.array_equal(np.sort(array.ravel()), np.arange(world))
    last = world - 1
    assert layout.group_of("tensor", last) == list(range(world - 8, world))
    assert layout.group_of("pipeline", 5) == [5 + i * (world // 16) for i in range(16)]
    assert len(layout.groups("data")) == 128


# --------------------------------------------------------------------------- limits
@pytest.mark.parametrize("world", [MAX_WORLD_SIZE + 1, 2**31, 2**32, 2**63, 2**64, 10**30])
def test_worlds_beyond_the_maximum_are_refused(world: int) -> None:
    # 2**31 and more used to fail in numpy (MemoryError, "array is too big"), 2**63 gave wrong groups
    with pytest.raises(LayoutError, match=rf"world_size={world} is larger than .*MAX_WORLD_SIZE=16777216"):
        plan(world)
    with pytest.raises(LayoutError, match="MAX_WORLD_SIZE"):
        plan(world, tensor=2)


def test_largest_world_plans_and_answers_queries() -> None:
    layout = plan(MAX_WORLD_SIZE, tensor=8, pipeline=16)
    last = MAX_WORLD_SIZE - 1
    assert layout.group_of("tensor", last) == list(range(MAX_WORLD_SIZE - 8, MAX_WORLD_SIZE))
    assert layout.local_rank("pipeline", last) == 15
    assert layout.group_of("pipeline", 0)[-1] == 15 * (MAX_WORLD_SIZE // 16)
