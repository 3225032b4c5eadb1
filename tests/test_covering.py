"""The covering set (parallelctx.planning.covering): the default ranks of a partial dry-run
sweep hold every coordinate of every axis, stay about as small as the largest axis, include
rank 0 and the last rank, and are the same for the same layout."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from parallelctx.planning.covering import COVERED_MODES, covering_ranks
from parallelctx.planning.layout import Layout, LayoutError, ParallelMode, plan

DENSE_AXES = ("tensor", "context", "data", "pipeline", "gtp_remat")
EXPERT_AXES = ("expert_tensor", "expert", "expert_data", "pipeline", "expert_gtp_remat")


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    """Layouts with every axis: context, expert (with its own tensor size), HSDP replicate,
    gtp_remat on both grids, and orders that put any axis first."""
    tensor = draw(st.sampled_from([1, 2, 3, 4, 8]))
    pipeline = draw(st.sampled_from([1, 2, 3, 4, 5]))
    context = draw(st.sampled_from([1, 1, 2, 3]))
    gtp = draw(st.sampled_from([1, 1, 1, 2]))
    replicate = draw(st.sampled_from([1, 1, 2, 3]))
    data = replicate * draw(st.integers(1, 8))
    world = tensor * pipeline * context * gtp * data
    per_stage = world // pipeline
    expert = draw(st.sampled_from([d for d in range(1, per_stage + 1) if per_stage % d == 0]))
    rest = per_stage // expert
    expert_tensor = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
    egtp = draw(st.sampled_from([1, 1, 2]))
    order = draw(
        st.sampled_from(
            [
                "tp-cp-ep-dp-pp",
                "tp-pp-dp-cp-ep",
                "dp-tp-cp-ep-pp",
                "pp-tp-cp-ep-dp",
                "tp-cp-ep-dp-pp-gtp_remat",
                "gtp_remat-dp-tp-cp-ep-pp",
            ]
        )
    )
    try:
        return plan(world, tensor, pipeline, context, expert, expert_tensor, order, replicate, gtp, egtp)
    except LayoutError:  # the expert sizes do not fit this order: the dense layout alone
        return plan(
            world, tensor, pipeline, context, order="tp-cp-ep-dp-pp", replicate=replicate, gtp_remat=gtp
        )


def _local_ranks(layout: Layout, mode: ParallelMode, ranks: list[int]) -> set[int]:
    """The local ranks in ``mode`` that ``ranks`` hold (a middle stage holds no embedding rank)."""
    return {
        layout.local_rank(mode, r)
        for r in ranks
        if mode is not ParallelMode.EMBEDDING or layout.group_of(mode, r)
    }


def _sizes(layout: Layout, axes: tuple[str, ...]) -> list[int]:
    return [layout.size(mode) for mode in axes]


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_the_covering_set_holds_every_coordinate_of_every_axis_and_stays_small(layout: Layout) -> None:
    ranks = covering_ranks(layout)
    assert ranks == sorted(set(ranks))  # ascending, each once
    assert ranks[0] == 0 and ranks[-1] == layout.world_size - 1
    for mode in COVERED_MODES:
        assert _local_ranks(layout, mode, ranks) == set(range(layout.size(mode))), (mode, ranks)
    # the coordinates seen through coords() too, HSDP parts included
    seen = {axis: {layout.coords(r)[axis] for r in ranks} for axis in layout.coords(0)}
    for axis, values in seen.items():
        assert values == set(range(layout.axis_size(axis))), (axis, layout.describe())
    largest = max(_sizes(layout, DENSE_AXES) + _sizes(layout, EXPERT_AXES))
    assert largest <= len(ranks) <= max(_sizes(layout, DENSE_AXES)) + max(_sizes(layout, EXPERT_AXES)) + 2
    same_grids = (
        layout.expert == 1
        and layout.context == 1
        and layout.expert_tensor == layout.tensor
        and layout.expert_gtp_remat == layout.gtp_remat
    )
    if same_grids:
        assert len(ranks) <= largest + 1, (layout.describe(), ranks)
    # deterministic: the same set again, and for the same layout built anew
    again = plan(
        layout.world_size,
        layout.tensor,
        layout.pipeline,
        layout.context,
        layout.expert,
        layout.expert_tensor,
        layout.order,
        layout.replicate,
        layout.gtp_remat,
        layout.expert_gtp_remat,
    )
    assert covering_ranks(layout) == ranks == covering_ranks(again)


def test_tensor_2_pipeline_4_data_8_is_a_diagonal_of_8_ranks_not_their_product() -> None:
    layout = plan(64, tensor=2, pipeline=4)
    ranks = covering_ranks(layout)
    # rank = tensor + 2 * data + 16 * stage; rank i of the diagonal has data index i, tensor
    # index i mod 2 and stage i mod 4
    assert ranks == [0, 8, 19, 27, 36, 44, 55, 63]
    assert sorted(layout.local_rank("data", r) for r in ranks) == list(range(8))
    # what a covering set is not: every combination of two axes (the model mode: tensor x stage)
    assert len(_local_ranks(layout, ParallelMode.MODEL, ranks)) == 4 < layout.size("model")


def test_an_expert_layout_covers_both_grids() -> None:
    # the expert grid (expert 8, expert-data 2) cuts the world otherwise than the dense grid
    # (context 2, data 8)
    layout = plan(128, tensor=2, pipeline=4, context=2, expert=8)
    ranks = covering_ranks(layout)
    for mode in (ParallelMode.EXPERT, ParallelMode.EXPERT_DATA, ParallelMode.CONTEXT, ParallelMode.DATA):
        assert _local_ranks(layout, mode, ranks) == set(range(layout.size(mode))), mode
    assert len(ranks) <= 8 + 8 + 2


def test_a_large_world_is_covered_by_its_largest_axis() -> None:
    layout = plan(2**20, tensor=8, pipeline=16)  # data 8192
    ranks = covering_ranks(layout)
    assert len(ranks) == 8192 and ranks[-1] == 2**20 - 1
    assert {layout.coords(r)["dp"] for r in ranks} == set(range(8192))
    assert {layout.coords(r)["pp"] for r in ranks} == set(range(16))
