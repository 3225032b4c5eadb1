"""Which node each rank lands on, and which groups cross a node boundary; pure, numpy only.

Launchers fill nodes in rank order: torchrun gives node ``n`` the ranks
``n*G .. n*G+G-1`` for ``--nproc-per-node G``, and ``srun`` with a block distribution does the
same, so the node of a rank is ``rank // G``. :func:`node_spans` measures, for every mode, how
many nodes its groups touch; :func:`placement_warnings` names the bad placements (a tensor,
context or expert-tensor group that crosses nodes, or ``G`` that does not divide the world)
with the order or sizes that would fix them. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..planning.layout import Layout, LayoutError, ParallelMode, plan

__all__ = [
    "INTRA_NODE_MODES",
    "ModeSpan",
    "PlacementWarning",
    "layout_nodes",
    "node_ids",
    "node_spans",
    "placement_warnings",
    "span_of_groups",
    "uneven_nodes",
]

INTRA_NODE_MODES: tuple[ParallelMode, ...] = (
    ParallelMode.TENSOR,
    ParallelMode.CONTEXT,
    ParallelMode.EXPERT_TENSOR,
)
"""Modes whose collectives sit on the critical path of every layer: they belong inside a node."""

# The order-string token of each intra-node mode (expert-tensor is 'tp' in the expert grid).
_TOKEN = {ParallelMode.TENSOR: "tp", ParallelMode.CONTEXT: "cp", ParallelMode.EXPERT_TENSOR: "tp"}


@dataclass(frozen=True)
class ModeSpan:
    """How the groups of one mode sit on the nodes.

    ``min_nodes`` / ``max_nodes`` are the fewest and most distinct nodes one group touches,
    ``crossing`` the number of groups that touch more than one node.
    """

    mode: str
    group_size: int
    groups: int
    min_nodes: int
    max_nodes: int
    crossing: int

    @property
    def inside_one_node(self) -> bool:
        """True when every group of the mode lies inside one node."""
        return self.max_nodes <= 1

    def describe(self) -> str:
        """Return ``"inside one node"``, ``"spans 2 nodes"`` or ``"spans 2-4 nodes"``."""
        if self.inside_one_node:
            return "inside one node"
        if self.min_nodes == self.max_nodes:
            return f"spans {self.max_nodes} nodes"
        return f"spans {self.min_nodes}-{self.max_nodes} nodes"

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict (plus ``placement``, the :meth:`describe` text)."""
        return {**asdict(self), "placement": self.describe()}


@dataclass(frozen=True)
class PlacementWarning:
    """One bad placement: ``kind`` is ``"uneven_nodes"`` or ``"crosses_nodes"``; ``mode`` the
    mode concerned (None for ``uneven_nodes``); ``message`` what is wrong; ``suggestion`` the fix."""

    kind: str
    mode: str | None
    message: str
    suggestion: str

    def __str__(self) -> str:
        return f"{self.message}; {self.suggestion}"

    def as_dict(self) -> dict[str, Any]:
        """Return the fields as a JSON-ready dict."""
        return asdict(self)


def _check_nproc(nproc_per_node: int) -> int:
    if (
        isinstance(nproc_per_node, bool)
        or not isinstance(nproc_per_node, (int, np.integer))
        or nproc_per_node < 1
    ):
        raise LayoutError(
            f"nproc_per_node={nproc_per_node!r} must be a positive integer (the processes each node runs)"
        )
    return int(nproc_per_node)


def node_ids(world_size: int, nproc_per_node: int) -> np.ndarray:
    """Return the node index of every rank, ``arange(world_size) // nproc_per_node``.

    Raises:
        LayoutError: ``nproc_per_node`` is not a positive integer.
    """
    return np.arange(world_size, dtype=np.int64) // _check_nproc(nproc_per_node)


def span_of_groups(groups: np.ndarray, nodes: np.ndarray) -> tuple[int, int, int]:
    """Count the distinct nodes each group (a row of ``groups``) touches.

    ``nodes[r]`` is the node of rank ``r`` (any integer labels, e.g. from real host names).

    Returns:
        ``(min_nodes, max_nodes, crossing)``: the fewest and most nodes one group touches and
        how many groups touch more than one. ``(0, 0, 0)`` for no groups.
    """
    if groups.size == 0:
        return 0, 0, 0
    per_rank = np.sort(nodes[groups], axis=1)
    distinct = 1 + np.count_nonzero(np.diff(per_rank, axis=1), axis=1)
    return int(distinct.min()), int(distinct.max()), int(np.count_nonzero(distinct > 1))


def node_spans(layout: Layout, nodes: np.ndarray) -> list[ModeSpan]:
    """Measure every mode of ``layout`` on the nodes ``nodes`` (one node label per rank of the
    layout, in order: ``nodes[i]`` is the node of global rank ``layout.offset + i``; see
    :func:`node_ids` for a launcher's placement, :func:`layout_nodes` for a module's ranks).

    Returns:
        One :class:`ModeSpan` per mode, in :meth:`Layout.modes` order.

    Raises:
        LayoutError: ``nodes`` does not hold one label per rank.
    """
    nodes = np.asarray(nodes)
    if nodes.shape != (layout.world_size,):
        raise LayoutError(
            f"nodes has shape {nodes.shape}, expected ({layout.world_size},): one node per rank"
        )
    out = []
    for mode in layout.modes():
        groups = layout.group_array(mode)
        lo, hi, crossing = span_of_groups(groups - layout.offset if layout.offset else groups, nodes)
        out.append(ModeSpan(mode.value, int(groups.shape[1]), int(groups.shape[0]), lo, hi, crossing))
    return out


def layout_nodes(layout: Layout, nproc_per_node: int) -> np.ndarray:
    """Return the node of each rank of ``layout``, in order: ``(offset + i) // nproc_per_node``
    for its i-th rank (a module's layout lies on global ranks from its offset; for a layout
    without offset it is :func:`node_ids`).

    Raises:
        LayoutError: ``nproc_per_node`` is not a positive integer.
    """
    g = _check_nproc(nproc_per_node)
    return (np.arange(layout.world_size, dtype=np.int64) + layout.offset) // g


def _local_groups(layout: Layout, mode: ParallelMode) -> np.ndarray:
    """The groups of ``mode`` in the layout's own rank numbers (``- offset``), to index
    :func:`layout_nodes`."""
    groups = layout.group_array(mode)
    return groups - layout.offset if layout.offset else groups


def _fast_first(order: str, first: tuple[str, ...]) -> str:
    tokens = [t.strip().lower() for t in order.split("-")]
    return "-".join(list(first) + [t for t in tokens if t not in first])


def _crossing_modes(layout: Layout, nproc_per_node: int) -> list[ParallelMode]:
    nodes = layout_nodes(layout, nproc_per_node)
    return [
        mode
        for mode in INTRA_NODE_MODES
        if layout.size(mode) > 1 and span_of_groups(_local_groups(layout, mode), nodes)[2] > 0
    ]


def _suggest(layout: Layout, mode: ParallelMode, nproc_per_node: int) -> str:
    """A fix for a crossing mode: an order that keeps every intra-node mode inside a node, or sizes."""
    size = layout.size(mode)
    if size > nproc_per_node:
        return (
            f"a {mode.value} size of at most nproc_per_node={nproc_per_node} (and dividing it) keeps "
            f"each {mode.value} group inside one node"
        )
    candidates = [_fast_first(layout.order, ("tp", "cp")), _fast_first(layout.order, ("cp", "tp"))]
    for order in candidates:
        if order == layout.order:
            continue
        try:
            other = plan(
                layout.world_size,
                tensor=layout.tensor,
                pipeline=layout.pipeline,
                context=layout.context,
                expert=layout.expert,
                expert_tensor=layout.axis_size("etp"),
                order=order,
            )
            if layout.offset:  # a module: the same sizes on its own ranks
                other = dataclasses.replace(other, offset=layout.offset)
        except LayoutError:
            continue
        if not _crossing_modes(other, nproc_per_node):
            return f"order={order!r} keeps every tensor, context and expert-tensor group inside one node"
    inner = (
        layout.tensor * layout.context if mode is not ParallelMode.EXPERT_TENSOR else layout.axis_size("etp")
    )
    return (
        f"put {_TOKEN[mode]!r} first in the order and choose sizes whose product "
        f"(here {inner}) divides nproc_per_node={nproc_per_node}"
    )


def uneven_nodes(world_size: int, nproc_per_node: int) -> PlacementWarning | None:
    """The warning for ``nproc_per_node`` not dividing ``world_size`` (a last node only partly
    filled), with the counts that would fill every node; None when it divides.

    Raises:
        LayoutError: ``nproc_per_node`` is not a positive integer.
    """
    g = _check_nproc(nproc_per_node)
    if not world_size % g:
        return None
    full, rest = divmod(world_size, g)
    below = max(d for d in range(1, g) if world_size % d == 0)
    return PlacementWarning(
        "uneven_nodes",
        None,
        f"nproc_per_node={g} does not divide world_size={world_size}: {full} full node(s) and one "
        f"node with {rest} rank(s)",
        f"run a multiple of {g} ranks (e.g. {(full + 1) * g}) or a per-node count that divides "
        f"{world_size} (e.g. {below})",
    )


def placement_warnings(layout: Layout, nproc_per_node: int, whole_job: bool = True) -> list[PlacementWarning]:
    """Name the bad placements of ``layout`` with ``nproc_per_node`` ranks per node.

    A warning is raised for ``nproc_per_node`` not dividing the world size (:func:`uneven_nodes`;
    not with ``whole_job=False``, for one module's layout, whose job is warned about once), and
    for each of TENSOR, CONTEXT and EXPERT_TENSOR whose groups touch more than one node
    (``rank // G``, global ranks for a module's layout).

    Returns:
        The warnings, uneven nodes first, then the modes in :data:`INTRA_NODE_MODES` order;
        empty when the placement is fine.

    Raises:
        LayoutError: ``nproc_per_node`` is not a positive integer.
    """
    g = _check_nproc(nproc_per_node)
    out: list[PlacementWarning] = []
    uneven = uneven_nodes(layout.world_size, g) if whole_job else None
    if uneven is not None:
        out.append(uneven)
    nodes = layout_nodes(layout, g)
    for mode in INTRA_NODE_MODES:
        if layout.size(mode) <= 1:
            continue
        _, hi, crossing = span_of_groups(_local_groups(layout, mode), nodes)
        if crossing == 0:
            continue
        groups = layout.group_array(mode).shape[0]
        out.append(
            PlacementWarning(
                "crosses_nodes",
                mode.value,
                f"{crossing} of {groups} {mode.value} groups (size {layout.size(mode)}) span up to {hi} "
                f"nodes with {g} ranks per node and order={layout.order!r}",
                _suggest(layout, mode, g),
            )
        )
    return out
