"""Showing a layout to people: a table of every mode's groups and a picture of the rank grid."""

from __future__ import annotations

import io

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from .layout import Layout, ParallelMode

__all__ = ["layout_picture", "layout_table", "render"]

_MAX_GROUPS = 8


def _fmt_groups(groups: list[list[int]], limit: int = _MAX_GROUPS) -> str:
    def one(g: list[int]) -> str:
        if len(g) > 12:
            return "[" + ",".join(map(str, g[:5])) + ",...," + ",".join(map(str, g[-2:])) + "]"
        return "[" + ",".join(map(str, g)) + "]"

    shown = " ".join(one(g) for g in groups[:limit])
    if len(groups) > limit:
        shown += f" ... (+{len(groups) - limit} more)"
    return shown


def layout_table(layout: Layout, modes: list[ParallelMode] | None = None) -> Table:
    """Return a rich Table: one row per mode with its group size, group count and groups.

    Groups are computed with numpy; for large worlds only the first few are listed.
    """
    table = Table(title=f"parallelctx layout: {layout.describe()}", show_lines=False)
    table.add_column("mode", style="bold")
    table.add_column("size", justify="right")
    table.add_column("groups", justify="right")
    table.add_column("members")
    for mode in modes or layout.modes():
        array = layout.group_array(mode)
        head = array[:_MAX_GROUPS].tolist()
        shown = _fmt_groups(head, _MAX_GROUPS)
        if array.shape[0] > _MAX_GROUPS:
            shown += f" ... (+{array.shape[0] - _MAX_GROUPS} more)"
        table.add_row(mode.value, str(array.shape[1]), str(array.shape[0]), shown)
    return table


def layout_picture(layout: Layout, max_ranks: int = 256) -> Text:
    """Return a picture of the dense grid: one block per pipeline stage, a row per data
    coordinate, a column per (context, tensor) coordinate, each cell a global rank.

    Worlds larger than ``max_ranks`` get a one-line note instead.
    """
    if layout.world_size > max_ranks:
        return Text(f"(grid picture omitted: {layout.world_size} ranks > {max_ranks})")
    strides = layout.strides("dense")
    width = len(str(layout.world_size - 1))
    lines: list[str] = []
    for pp in range(layout.pipeline):
        lines.append(f"pipeline stage {pp}:  columns = (cp, tp), rows = dp")
        header = " " * 8 + " ".join(
            f"{f'{cp},{tp}':>{max(width, 3)}}" for cp in range(layout.context) for tp in range(layout.tensor)
        )
        lines.append(header)
        for dp in range(layout.data):
            cells = []
            for cp in range(layout.context):
                for tp in range(layout.tensor):
                    rank = pp * strides["pp"] + dp * strides["dp"] + cp * strides["cp"] + tp * strides["tp"]
                    cells.append(f"{rank:>{max(width, 3)}}")
            lines.append(f"  dp {dp:<3}" + " ".join(cells))
    return Text("\n".join(lines))


def render(layout: Layout, modes: list[ParallelMode] | None = None) -> str:
    """Return the table and the picture as plain text (no colour codes)."""
    console = Console(width=120, record=True, color_system=None, file=io.StringIO())
    console.print(Group(layout_table(layout, modes), layout_picture(layout)))
    return console.export_text()
