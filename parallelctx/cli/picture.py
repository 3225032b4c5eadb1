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
from ..planning.modules import ModulePlan
from .placement import node_ids, span_of_groups

__all__ = [
    "MAX_RANKS",
    "NO_GROUP",
    "OUTSIDE",
    "PictureError",
    "cell_groups",
    "draw",
    "draw_modules",
    "module_panels",
    "picture_modes",
]

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


OUTSIDE = -2
""":func:`cell_groups`'s value for a rank outside the layout (another module's rank)."""

NO_GROUP = -1
""":func:`cell_groups`'s value for a rank of the layout in no group of the mode (the embedding's
middle stages)."""


def cell_groups(layout: Layout, mode: ParallelMode, world_size: int | None = None) -> np.ndarray:
    """Return what each cell of a panel shows: for every rank of a ``world_size``-rank job
    (default the layout's ranks from 0), the index of its group of ``mode`` in
    ``layout.group_array(mode)`` (a colour each), :data:`NO_GROUP` for a rank of the layout in no
    group of the mode, :data:`OUTSIDE` for a rank outside the layout (a module's panel shows
    the whole job).

    Raises:
        PictureError: the layout's ranks go past ``world_size``.
    """
    world = layout.offset + layout.world_size if world_size is None else int(world_size)
    if layout.offset + layout.world_size > world:
        raise PictureError(
            f"the layout holds ranks {layout.offset}-{layout.offset + layout.world_size - 1}, past "
            f"world_size={world}: draw it on a world that holds its ranks"
        )
    groups = layout.group_array(mode)
    colour_of = np.full(world, OUTSIDE, dtype=np.int64)
    colour_of[layout.offset : layout.offset + layout.world_size] = NO_GROUP
    colour_of[groups] = np.arange(groups.shape[0])[:, None]
    return colour_of


def _panel(
    ax: Any,
    layout: Layout,
    mode: ParallelMode,
    per_node: int,
    cmap: Any,
    world_size: int | None = None,
    module: str | None = None,
) -> None:
    colour_of = cell_groups(layout, mode, world_size)
    world = len(colour_of)
    nodes = -(-world // per_node)
    groups = layout.group_array(mode)
    rgba = np.ones((nodes, per_node, 4))
    for rank in range(world):
        index = colour_of[rank]
        if index == OUTSIDE:
            continue  # white: another module's rank
        rgba[rank // per_node, rank % per_node] = (
            (0.85, 0.85, 0.85, 1.0) if index < 0 else cmap(_shade(index))
        )
    ax.imshow(rgba, aspect="equal", interpolation="nearest")
    label = world <= 256
    for rank in range(world if label else 0):
        shown = colour_of[rank] != OUTSIDE
        ax.text(
            rank % per_node,
            rank // per_node,
            str(rank),
            ha="center",
            va="center",
            fontsize=7,
            color="black" if shown else "0.75",
        )
    for edge in np.arange(-0.5, per_node, 1.0):
        ax.axvline(edge, color="white" if module is None else "0.9", linewidth=0.6)
    for edge in np.arange(-0.5, nodes, 1.0):
        ax.axhline(edge, color="black", linewidth=1.6)
    _, widest, crossing = span_of_groups(groups, node_ids(world, per_node))
    where = "inside one node" if widest <= 1 else f"{crossing} group(s) span up to {widest} nodes"
    title = f"{mode.value if module is None else module + ' ' + mode.value}: {groups.shape[0]} groups of {groups.shape[1]}"
    if module is not None and mode is ParallelMode.GLOBAL:  # the module's ranks, on the job's nodes
        first, last = layout.offset, layout.offset + layout.world_size - 1
        title = f"module {module}: ranks {first}-{last} ({layout.world_size} ranks)"
        where, widest = f"on {last // per_node - first // per_node + 1} node(s)", 1
    ax.set_title(f"{title}\n{where}", fontsize=9, color="black" if widest <= 1 else "firebrick")
    ax.set_yticks(range(nodes), [f"node {n}" for n in range(nodes)] if nodes <= 64 else None)
    ax.set_xticks([])
    ax.set_gid(f"panel-{mode.value}" if module is None else f"panel-{module}-{mode.value}")


def _checked(
    world_size: int, nproc_per_node: int | None, path: str | Path, fmt: str | None
) -> tuple[int, str]:
    """The per-node count and the format of a picture, checked; raises PictureError as :func:`draw`."""
    if nproc_per_node is None or isinstance(nproc_per_node, bool) or int(nproc_per_node) < 1:
        raise PictureError(
            f"nproc_per_node={nproc_per_node!r}: a picture groups ranks by node; "
            "pass --nproc-per-node G (the processes each node runs)"
        )
    if world_size > MAX_RANKS:
        raise PictureError(
            f"world_size={world_size} is above {MAX_RANKS} ranks, too many cells to read; "
            "draw a smaller world with the same sizes per node, or use the text view"
        )
    fmt = (fmt or Path(path).suffix.lstrip(".")).lower()
    if fmt not in ("png", "svg"):
        raise PictureError(f"format {fmt!r} of {str(path)!r} is not supported; use a .png or .svg file")
    return int(nproc_per_node), fmt


def module_panels(plan: ModulePlan) -> dict[str, list[ParallelMode]]:
    """Return the panels :func:`draw_modules` draws for each module, in the config's order: the
    module's ranks (GLOBAL: its one group, in the job's grid) first, then
    :func:`picture_modes` of its layout."""
    return {name: [ParallelMode.GLOBAL, *picture_modes(lay)] for name, lay in plan.layouts.items()}


def draw_modules(
    plan: ModulePlan, nproc_per_node: int | None, path: str | Path, fmt: str | None = None
) -> list[str]:
    """Draw a job with ``parallel.modules`` (``plan``) with ``nproc_per_node`` ranks per node to
    ``path``: one block of panels per module (:func:`module_panels`), each panel the whole job's
    ranks on their nodes with the module's ranks coloured by group and the other modules' ranks
    left white; the first panel of a block names the module and its ranks, the figure title
    gives every module's ranks and layout (colocated modules get blocks of their own, on the
    same ranks, and the title says ``colocated with``). The panel names (``module:mode``) are
    stored in the file's metadata (``Description``).

    Returns:
        The names of the panels drawn, ``"vision:global"``, ``"vision:data"``, ..., in order.

    Raises:
        PictureError: as :func:`draw`, for the job's world size.
    """
    world = plan.world_size
    per_node, fmt = _checked(world, nproc_per_node, path, fmt)
    plt = _pyplot()
    panels = module_panels(plan)
    nodes = -(-world // per_node)
    cols = min(_COLUMNS, max(len(modes) for modes in panels.values()))
    rows_of = {name: math.ceil(len(modes) / cols) for name, modes in panels.items()}
    rows = sum(rows_of.values())
    cell = 0.32 if world <= 256 else 0.12
    width = max(3.2, per_node * cell + 1.2) * cols
    height = max(1.8, nodes * cell + 1.0) * rows + 0.5 + 0.25 * len(panels)
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    cmap = plt.get_cmap("tab20")
    names: list[str] = []
    try:
        row = 0
        for name, modes in panels.items():
            block = list(axes[row : row + rows_of[name]].flat)
            for ax, mode in zip(block, modes):
                _panel(ax, plan.layouts[name], mode, per_node, cmap, world, module=name)
                names.append(f"{name}:{mode.value}")
            for ax in block[len(modes) :]:
                ax.set_visible(False)
            row += rows_of[name]
        lines = []
        for name, lay in plan.layouts.items():
            together = [
                o
                for o, other in plan.layouts.items()
                if o != name and (other.offset, other.world_size) == (lay.offset, lay.world_size)
            ]
            extra = f", colocated with {', '.join(together)}" if together else ""
            lines.append(
                f"{name}: ranks {lay.offset}-{lay.offset + lay.world_size - 1}{extra}: {lay.describe()}"
            )
        fig.suptitle(
            f"{len(panels)} modules on {world} ranks, {per_node} ranks per node\n" + "\n".join(lines),
            fontsize=10,
        )
        fig.tight_layout()
        metadata = {"Description": "panels: " + ",".join(names)}
        fig.savefig(path, format=fmt, dpi=110, metadata=metadata)
    finally:
        plt.close(fig)
    return names


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
    per_node, fmt = _checked(layout.world_size, nproc_per_node, path, fmt)
    plt = _pyplot()
    modes = picture_modes(layout) or [ParallelMode.GLOBAL]
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
