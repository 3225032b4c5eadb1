"""Showing a layout to people: a table of every mode's groups and a picture of the rank grid."""

from __future__ import annotations

import io

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ..planning.layout import Layout, ParallelMode
from .placement import ModeSpan

__all__ = ["layout_picture", "layout_table", "placement_table", "render"]

_MAX_GROUPS = 8


_WIDTH = 70


def _fmt_group(g: list[int]) -> str:
    if len(g) > 12:
        return "[" + ",".join(map(str, g[:5])) + ",...," + ",".join(map(str, g[-2:])) + "]"
    return "[" + ",".join(map(str, g)) + "]"


def _fmt_groups(groups: list[list[int]], total: int, width: int = _WIDTH) -> str:
    """The first groups that fit in ``width`` characters, then ``... (+N more)``."""
    shown: list[str] = []
    used = 0
    for g in groups:
        text = _fmt_group(g)
        if shown and used + 1 + len(text) > width - 16:
            break
        shown.append(text)
        used += 1 + len(text)
    line = " ".join(shown)
    if total > len(shown):
        line += f" ... (+{total - len(shown)} more)"
    return line


def layout_table(layout: Layout, modes: list[ParallelMode] | None = None) -> Table:
    """Return a rich Table: one row per mode with its group size, group count and groups.

    Groups are computed with numpy; for large worlds only the first few are listed.
    """
    table = Table(title=f"parallelctx layout: {layout.describe()}", show_lines=False)
    table.add_column("mode", style="bold")
    table.add_column("size", justify="right")
    table.add_column("groups", justify="right")
    table.add_column("members")
    for mode in modes or layout.shown_modes():
        array = layout.group_array(mode)
        shown = _fmt_groups(array[:_MAX_GROUPS].tolist(), int(array.shape[0]))
        table.add_row(mode.value, str(array.shape[1]), str(array.shape[0]), shown)
    return table


def layout_picture(layout: Layout, max_ranks: int = 256) -> Text:
    """Return a picture of the dense grid: one block per pipeline stage, a row per data
    coordinate, a column per (context, tensor) coordinate (per (context, gtp_remat, tensor)
    coordinate when the gtp_remat size is above 1), each cell a global rank (from the layout's
    offset for a module's layout).

    Worlds larger than ``max_ranks`` get a one-line note instead.
    """
    if layout.world_size > max_ranks:
        return Text(f"(grid picture omitted: {layout.world_size} ranks > {max_ranks})")
    strides = layout.strides("dense")
    width = len(str(layout.offset + layout.world_size - 1))
    gtp = layout.gtp_remat
    columns = [(cp, g, tp) for cp in range(layout.context) for g in range(gtp) for tp in range(layout.tensor)]

    def label(cp: int, g: int, tp: int) -> str:
        return f"{cp},{g},{tp}" if gtp > 1 else f"{cp},{tp}"

    cell = max(width, 5 if gtp > 1 else 3)
    names = "(cp, gtp_remat, tp)" if gtp > 1 else "(cp, tp)"
    lines: list[str] = []
    for pp in range(layout.pipeline):
        lines.append(f"pipeline stage {pp}:  columns = {names}, rows = dp")
        lines.append(" " * 8 + " ".join(f"{label(*c):>{cell}}" for c in columns))
        for dp in range(layout.data):
            cells = []
            for cp, g, tp in columns:
                rank = pp * strides["pp"] + dp * strides["dp"] + cp * strides["cp"] + tp * strides["tp"]
                rank += g * strides["gtp_remat"] + layout.offset
                cells.append(f"{rank:>{cell}}")
            lines.append(f"  dp {dp:<3}" + " ".join(cells))
    return Text("\n".join(lines))


def placement_table(spans: list[ModeSpan], world_size: int, nproc_per_node: int) -> Table:
    """Return a rich Table: one row per mode with groups of size > 1, saying whether its groups
    stay inside one node or span several (node = rank // ``nproc_per_node``)."""
    nodes = -(-world_size // nproc_per_node)
    table = Table(title=f"on {nodes} node(s) of {nproc_per_node} ranks (node = rank // {nproc_per_node})")
    table.add_column("mode", style="bold")
    table.add_column("groups", justify="right")
    table.add_column("placement")
    table.add_column("groups crossing nodes", justify="right")
    for span in spans:
        if span.group_size > 1:
            table.add_row(
                span.mode, f"{span.groups} x {span.group_size}", span.describe(), str(span.crossing)
            )
    return table


def render(
    layout: Layout,
    modes: list[ParallelMode] | None = None,
    spans: list[ModeSpan] | None = None,
    nproc_per_node: int | None = None,
    world_size: int | None = None,
) -> str:
    """Return the table, the node placement (when ``spans`` and ``nproc_per_node`` are given;
    the nodes of a ``world_size``-rank job, default the layout's: a module's job is larger) and
    the picture as plain text (no colour codes)."""
    console = Console(width=120, record=True, color_system=None, file=io.StringIO())
    parts: list[Table | Text] = [layout_table(layout, modes)]
    if spans and nproc_per_node:
        parts.append(placement_table(spans, world_size or layout.world_size, nproc_per_node))
    parts.append(layout_picture(layout))
    console.print(Group(*parts))
    return console.export_text()
