"""A picture of a layout on its nodes: ranks as cells, one row per node, one panel per mode.

Needs matplotlib, the optional ``plot`` extra (``pip install 'parallelctx[plot]'``); it is
imported only when a picture is drawn, with the Agg backend (no display needed). Nothing here
imports torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..planning.layout import Layout, ParallelMode
from .placement import node_ids, span_of_groups

__all__ = ["MAX_RANKS", "PictureError", "draw", "picture_modes"]

MAX_RANKS = 4096
"""The largest world :func:`draw` pictures; beyond it the cells would be too small to read."""

_COLUMNS = 4


class PictureError(ValueError):
    """A picture that cannot be drawn: matplotlib missing, no per-node count, a world too large,
    or an unknown file format."""


def picture_modes(layout: Layout) -> list[ParallelMode]:
    """Return the modes that get a panel: every mode with groups of more than one rank, except
    GLOBAL (one group of everything, which a panel would paint in a single colour), and the HSDP
    parts when there is no replication (:meth:`Layout.shown_modes`)."""
    return [m for m in layout.shown_modes() if m is not ParallelMode.GLOBAL and layout.size(m) > 1]


def _shade(index: int) -> int:
    """Index into tab20 so that neighbouring groups get different hues, not a pale twin."""
    step = (2 * int(index)) % 40
    return step if step < 20 else step - 19


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PictureError(
            "drawing the layout needs matplotlib, which is not installed: "
            "`pip install 'parallelctx[plot]'` (or `pip install 'matplotlib>=3.8'`)"
        ) from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _panel(ax: Any, layout: Layout, mode: ParallelMode, per_node: int, cmap: Any) -> None:
    world = layout.world_size
    nodes = -(-world // per_node)
    groups = layout.group_array(mode)
    colour_of = np.full(world, -1, dtype=np.int64)  # -1: in no group (EMBEDDING middle stages)
    colour_of[groups] = np.arange(groups.shape[0])[:, None]
    rgba = np.ones((nodes, per_node, 4))
    for rank in range(world):
        index = colour_of[rank]
        rgba[rank // per_node, rank % per_node] = (
            (0.85, 0.85, 0.85, 1.0) if index < 0 else cmap(_shade(index))
        )
    ax.imshow(rgba, aspect="equal", interpolation="nearest")
    label = world <= 256
    for rank in range(world if label else 0):
        ax.text(rank % per_node, rank // per_node, str(rank), ha="center", va="center", fontsize=7)
    for edge in np.arange(-0.5, per_node, 1.0):
        ax.axvline(edge, color="white", linewidth=0.6)
    for edge in np.arange(-0.5, nodes, 1.0):
        ax.axhline(edge, color="black", linewidth=1.6)
    _, widest, crossing = span_of_groups(groups, node_ids(world, per_node))
    where = "inside one node" if widest <= 1 else f"{crossing} group(s) span up to {widest} nodes"
    ax.set_title(
        f"{mode.value}: {groups.shape[0]} groups of {groups.shape[1]}\n{where}",
        fontsize=9,
        color="black" if widest <= 1 else "firebrick",
    )
    ax.set_yticks(range(nodes), [f"node {n}" for n in range(nodes)] if nodes <= 64 else None)
    ax.set_xticks([])
    ax.set_gid(f"panel-{mode.value}")


def draw(layout: Layout, nproc_per_node: int | None, path: str | Path, fmt: str | None = None) -> list[str]:
    """Draw ``layout`` with ``nproc_per_node`` ranks per node (node = rank // G) to ``path``.

    One panel per mode of :func:`picture_modes`; each row of a panel is a node, each cell a
    rank, each group its own colour (ranks in no group are grey); the figure title gives the
    sizes and the order. The panel names are stored in the file's metadata (``Description``).

    Returns:
        The names of the modes drawn, in panel order.

    Raises:
        PictureError: matplotlib is missing (install the ``plot`` extra), ``nproc_per_node`` is
            not a positive integer, the world has more than :data:`MAX_RANKS` ranks, or ``fmt``
            (default: the file suffix) is neither ``png`` nor ``svg``.
    """
    if nproc_per_node is None or isinstance(nproc_per_node, bool) or int(nproc_per_node) < 1:
        raise PictureError(
            f"nproc_per_node={nproc_per_node!r}: a picture groups ranks by node; "
            "pass --nproc-per-node G (the processes each node runs)"
        )
    if layout.world_size > MAX_RANKS:
        raise PictureError(
            f"world_size={layout.world_size} is above {MAX_RANKS} ranks, too many cells to read; "
            "draw a smaller world with the same sizes per node, or use the text view"
        )
    fmt = (fmt or Path(path).suffix.lstrip(".")).lower()
    if fmt not in ("png", "svg"):
        raise PictureError(f"format {fmt!r} of {str(path)!r} is not supported; use a .png or .svg file")
    plt = _pyplot()
    modes = picture_modes(layout) or [ParallelMode.GLOBAL]
    per_node = int(nproc_per_node)
    nodes = -(-layout.world_size // per_node)
    cols = min(_COLUMNS, len(modes))
    rows = math.ceil(len(modes) / cols)
    cell = 0.32 if layout.world_size <= 256 else 0.12
    width = max(3.2, per_node * cell + 1.2) * cols
    height = max(1.8, nodes * cell + 1.0) * rows + 0.8
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    cmap = plt.get_cmap("tab20")
    try:
        for ax, mode in zip(axes.flat, modes):
            _panel(ax, layout, mode, per_node, cmap)
        for ax in list(axes.flat)[len(modes) :]:
            ax.set_visible(False)
        fig.suptitle(f"{layout.describe()}, {per_node} ranks per node", fontsize=11)
        fig.tight_layout()
        names = [m.value for m in modes]
        metadata = {"Description": "panels: " + ",".join(names)}
        fig.savefig(path, format=fmt, dpi=110, metadata=metadata)
    finally:
        plt.close(fig)
    return names
