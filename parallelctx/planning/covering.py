"""A covering set of ranks: few ranks that together hold every coordinate of every axis of a
layout; torch-free.

A dry run of a few ranks (``@pytest.mark.parallel(simulate=True)``, ``parallelctx dry-run
--ranks cover``) sees a rank-dependent bug only on the ranks it runs. A bug that depends on one
coordinate (``if data_rank == 5``, ``if stage == 2``, ``if expert_rank == 3``) shows on every rank
with that coordinate, so a set that holds every value of every axis finds each of them. The set
is a *diagonal* of the rank grid: its i-th rank has coordinate ``i mod size`` on every axis at
once, so it has about as many ranks as the largest axis, not the product of the axes.

The axes are those of the dense grid (tensor, context, data, pipeline, gtp_remat) and of the
expert grid (expert-tensor, expert, expert-data, pipeline, expert gtp_remat); the data axes are
walked whole (every data index, hence every HSDP shard and replicate index). Modes spanning
several axes (model, data-context, expert-model, ..., the world) are covered axis by axis, not
in every combination.
"""

from __future__ import annotations

from .layout import Layout, ParallelMode

__all__ = ["COVERED_MODES", "covering_ranks"]

COVERED_MODES: tuple[ParallelMode, ...] = (
    ParallelMode.TENSOR,
    ParallelMode.PIPELINE,
    ParallelMode.DATA,
    ParallelMode.CONTEXT,
    ParallelMode.EMBEDDING,
    ParallelMode.EXPERT,
    ParallelMode.EXPERT_TENSOR,
    ParallelMode.EXPERT_DATA,
    ParallelMode.DATA_SHARD,
    ParallelMode.DATA_REPLICATE,
    ParallelMode.EXPERT_DATA_SHARD,
    ParallelMode.EXPERT_DATA_REPLICATE,
    ParallelMode.GTP_REMAT,
    ParallelMode.EXPERT_GTP_REMAT,
)
"""The modes whose every local rank :func:`covering_ranks` holds: the modes of one axis (and
the embedding, the first and last pipeline stage). The other modes span several axes."""

# Per grid: (the order-string token whose stride Layout.strides gives, the axis_size key).
_GRID_AXES: dict[str, tuple[tuple[str, str], ...]] = {
    "dense": (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("gtp_remat", "gtp_remat")),
    "expert": (("tp", "etp"), ("ep", "ep"), ("dp", "edp"), ("pp", "pp"), ("gtp_remat", "egtp_remat")),
}

Axes = tuple[tuple[int, int], ...]
"""(stride, size) of each axis of size > 1 of one grid."""


def _grid_axes(layout: Layout, grid: str) -> Axes:
    """The (stride, size) of the axes of ``grid`` that have more than one coordinate."""
    strides = layout.strides(grid)
    axes = ((strides[token], layout.axis_size(size_key)) for token, size_key in _GRID_AXES[grid])
    return tuple((stride, size) for stride, size in axes if size > 1)


def _longest(axes: Axes) -> int:
    """The size of the largest axis (1 for a grid of one rank)."""
    return max((size for _, size in axes), default=1)


def _diagonal(axes: Axes, i: int) -> int:
    """The rank whose coordinate is ``i mod size`` on every axis."""
    return sum((i % size) * stride for stride, size in axes)


def _coords(axes: Axes, rank: int) -> tuple[int, ...]:
    """The coordinates of ``rank`` on ``axes``."""
    return tuple((rank // stride) % size for stride, size in axes)


def covering_ranks(layout: Layout) -> list[int]:
    """Return a small set of ranks that holds every local rank of every mode of
    :data:`COVERED_MODES`, rank 0 and the last rank, ascending; the same set for the same layout.

    The ranks are the diagonal of the grid (dense or expert) whose largest axis is larger: its
    i-th rank has coordinate ``i mod size`` on each of its axes. Where those ranks miss a
    coordinate of the other grid, ranks of that grid's diagonal that hold a missing one are added.
    The set has at least as many ranks as the largest axis (no smaller set can cover it) and at
    most the largest axis of each grid together plus two. Where the expert grid has the dense
    grid's coordinates (``expert = context = 1``, ``expert_tensor = tensor``,
    ``expert_gtp_remat = gtp_remat``) it is the largest axis, plus the last rank where the
    diagonal misses it.

    A module's layout (``offset > 0``) gives its own global ranks.

    Raises:
        Nothing: every :class:`~parallelctx.planning.layout.Layout` is valid by construction.
    """
    dense, expert = _grid_axes(layout, "dense"), _grid_axes(layout, "expert")
    first, second = (expert, dense) if _longest(expert) > _longest(dense) else (dense, expert)
    chosen = {_diagonal(first, i) for i in range(_longest(first))}
    missing = [set(range(size)) for _, size in second]
    for rank in chosen:
        for seen, value in zip(missing, _coords(second, rank)):
            seen.discard(value)
    i = 0
    while any(missing):
        rank = _diagonal(second, i)
        values = _coords(second, rank)
        if any(value in seen for seen, value in zip(missing, values)):
            chosen.add(rank)
            for seen, value in zip(missing, values):
                seen.discard(value)
        i += 1
    chosen.update((0, layout.world_size - 1))
    return sorted(rank + layout.offset for rank in chosen)  # a module's layout: global ranks
