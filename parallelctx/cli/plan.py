"""``parallelctx plan``: the layout of a world as a table, JSON or a picture; no process started."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import IO, Any

from pydantic import ValidationError

from ..config import ParallelConfig, load_config, validation_error
from ..planning.layout import DEFAULT_ORDER, Layout, LayoutError
from ..planning.modules import ModulePlan
from .placement import (
    ModeSpan,
    PlacementWarning,
    layout_nodes,
    node_ids,
    node_spans,
    placement_warnings,
    uneven_nodes,
)
from .stderr import say

__all__ = ["JSON_FULL_LIMIT", "module_heading", "run", "run_modules"]


JSON_FULL_LIMIT = 16_384
"""Above this many ranks ``plan --json`` prints a summary unless ``--output FILE`` is given."""

_HEAD_GROUPS = 4


def _parallel(args: argparse.Namespace, par: ParallelConfig | None = None) -> ParallelConfig:
    """The ``parallel`` section from the flags, falling back to ``--config``'s (``par``, that
    section when already loaded), then to size 1."""
    sizes: dict[str, Any] = {"tensor": 1, "pipeline": 1, "context": 1, "expert": 1, "expert_tensor": None}
    sizes.update(gtp_remat=1, expert_gtp_remat=1)
    sizes["order"] = DEFAULT_ORDER
    data = None
    if par is None and args.config is not None:
        par = load_config(args.config).parallel
    if par is not None:
        sizes.update(
            tensor=par.tensor.size,
            pipeline=par.pipeline.size,
            context=par.context.size,
            expert=par.expert.size,
            expert_tensor=par.expert.tensor,
            order=par.order,
            gtp_remat=par.gtp_remat.size,
            expert_gtp_remat=par.expert.gtp_remat,
        )
        data = par.data.model_dump()
    for key in (
        "tensor",
        "pipeline",
        "context",
        "expert",
        "expert_tensor",
        "order",
        "gtp_remat",
        "expert_gtp_remat",
    ):
        value = getattr(args, key, None)
        if value is not None:
            sizes[key] = value
    for key in ("replicate", "shard"):  # HSDP split of the data axis
        value = getattr(args, key, None)
        if value is not None:
            data = {**(data or {}), key: value}
    try:
        return ParallelConfig.model_validate(
            {
                "tensor": sizes["tensor"],
                "pipeline": sizes["pipeline"],
                "context": sizes["context"],
                "expert": {
                    "size": sizes["expert"],
                    "tensor": sizes["expert_tensor"],
                    "gtp_remat": sizes["expert_gtp_remat"],
                },
                "order": sizes["order"],
                "data": data,
                "gtp_remat": sizes["gtp_remat"],
            }
        )
    except ValidationError as exc:  # the message alone, not pydantic's wrapper
        raise validation_error(exc, section="parallel") from None


def _world_size(args: argparse.Namespace) -> int:
    if args.world_size is not None:
        return int(args.world_size)
    if args.nodes is not None and args.nproc_per_node is not None:
        return int(args.nodes) * int(args.nproc_per_node)
    raise LayoutError("give --world-size N, or --nodes N with --nproc-per-node G (world = N x G)")


def _json_full(layout: Layout, extra: dict[str, Any], out: IO[str]) -> None:
    """Write ``{mode: groups, **extra}``, one mode at a time (no copy of the whole text in memory)."""
    out.write("{")
    for i, mode in enumerate(layout.modes()):
        out.write(("" if i == 0 else ", ") + json.dumps(mode.value) + ": ")
        out.write(json.dumps(layout.group_array(mode).tolist()))
    for key, value in extra.items():
        out.write(", " + json.dumps(key) + ": " + json.dumps(value))
    out.write("}\n")


def _mode_summary(layout: Layout) -> dict[str, Any]:
    """Per mode: the group size, the group count and the first few groups (cut to 16 ranks)."""
    groups = {}
    for mode in layout.modes():
        array = layout.group_array(mode)
        head = array[:_HEAD_GROUPS, : min(array.shape[1], 16)].tolist()
        groups[mode.value] = {"group_size": int(array.shape[1]), "groups": int(array.shape[0]), "first": head}
    return groups


def _json_summary(layout: Layout, extra: dict[str, Any]) -> dict[str, Any]:
    groups = _mode_summary(layout)
    return {
        "truncated": True,
        "world_size": layout.world_size,
        "layout": layout.describe(),
        "note": f"world_size > {JSON_FULL_LIMIT}: groups summarised; --output FILE writes every group",
        "summary": groups,
        **extra,
    }


def run(args: argparse.Namespace) -> int:
    """Run ``parallelctx plan`` with parsed ``args``; return the exit code (0 ok, 2 bad arguments).
    A config with ``parallel.modules`` prints each module's layout (:func:`run_modules`)."""
    try:
        par = load_config(args.config).parallel if args.config is not None else None
    except (LayoutError, ValueError, OSError) as exc:  # ConfigError and pydantic errors are ValueErrors
        say(f"parallelctx plan: {exc}")
        return 2
    if par is not None and par.modules:
        return run_modules(args, par)
    try:
        world = _world_size(args)
        layout = _parallel(args, par).to_layout(world)
        warnings: list[PlacementWarning] = []
        spans: list[ModeSpan] = []
        if args.nproc_per_node is not None:
            warnings = placement_warnings(layout, args.nproc_per_node)
            spans = node_spans(layout, node_ids(world, args.nproc_per_node))
    except (LayoutError, ValueError, OSError) as exc:  # ConfigError and pydantic errors are ValueErrors
        say(f"parallelctx plan: {exc}")
        return 2
    for warning in warnings:
        say(f"parallelctx plan: warning: {warning}")
    extra: dict[str, Any] = {}
    if args.nproc_per_node is not None:
        extra["placement"] = {
            "nproc_per_node": args.nproc_per_node,
            "nodes": -(-world // args.nproc_per_node),
            "modes": {span.mode: span.as_dict() for span in spans},
        }
        extra["warnings"] = [w.as_dict() for w in warnings]
    from .picture import draw

    done = _write_files(args, world, lambda path, fmt: draw(layout, args.nproc_per_node, path, fmt=fmt),
                        lambda out: _json_full(layout, extra, out), lambda: _json_summary(layout, extra))  # fmt: skip
    if done is not None:
        return done
    if args.output is None and not args.json and (not (args.png or args.svg) or args.text):
        from .tables import render

        sys.stdout.write(render(layout, spans=spans, nproc_per_node=args.nproc_per_node))
    return 0


# ------------------------------------------------------------------------------ parallel.modules
_LAYOUT_FLAGS = (
    "tensor",
    "pipeline",
    "context",
    "expert",
    "expert_tensor",
    "replicate",
    "shard",
    "order",
    "gtp_remat",
    "expert_gtp_remat",
)
"""The flags that give one layout's sizes; a config with ``parallel.modules`` gives them per module."""


def _module_plan(args: argparse.Namespace, par: ParallelConfig) -> ModulePlan:
    """The config's modules on ``--world-size`` (or ``--nodes`` x ``--nproc-per-node``) ranks,
    else on the ranks they cover together.

    Raises:
        LayoutError: a size flag beside the modules, or modules that do not fit the world.
    """
    names = ", ".join(par.modules or {})
    given = [f"--{key.replace('_', '-')}" for key in _LAYOUT_FLAGS if getattr(args, key, None) is not None]
    if given:
        raise LayoutError(
            f"{given[0]} sets the sizes of one layout, but {args.config} gives parallel.modules "
            f"({names}), each with its own sizes: set them in the config "
            f"(parallel.modules.<name>.{given[0][2:].replace('-', '_')}=...) and drop {', '.join(given)}"
        )
    if args.world_size is None and args.nodes is None:
        return par.module_plan()  # the world the modules cover
    return par.module_plan(_world_size(args))


def _colocated(plan: ModulePlan, name: str) -> list[str]:
    """The other modules on exactly ``name``'s ranks."""
    lay = plan.layouts[name]
    return [
        other
        for other, o in plan.layouts.items()
        if other != name and (o.offset, o.world_size) == (lay.offset, lay.world_size)
    ]


def module_heading(plan: ModulePlan, name: str) -> str:
    """Return ``"module vision: ranks 0-1 (2 ranks)"``, with ``", the language module"`` and
    ``", colocated with audio"`` where they hold.

    Raises:
        LayoutError: no module ``name``.
    """
    lay = plan.layouts[plan._known(name)]
    count = f"{lay.world_size} rank{'s' if lay.world_size != 1 else ''}"
    text = f"module {name}: ranks {lay.offset}-{lay.offset + lay.world_size - 1} ({count})"
    if name == plan.language:
        text += ", the language module"
    together = _colocated(plan, name)
    if together:
        text += ", colocated with " + ", ".join(together)
    return text


def _module_json(plan: ModulePlan, extra: dict[str, Any], out: IO[str]) -> None:
    """Write ``{"world_size", "language", "modules": {name: {ranks, layout, colocated_with,
    groups: {mode: groups}}}, **extra}``, one mode at a time."""
    out.write("{" + json.dumps("world_size") + ": " + json.dumps(plan.world_size))
    out.write(", " + json.dumps("language") + ": " + json.dumps(plan.language))
    out.write(", " + json.dumps("modules") + ": {")
    for i, (name, lay) in enumerate(plan.layouts.items()):
        head = {
            "ranks": [lay.offset, lay.offset + lay.world_size - 1],
            "layout": lay.describe(),
            "colocated_with": _colocated(plan, name),
        }
        out.write(("" if i == 0 else ", ") + json.dumps(name) + ": " + json.dumps(head)[:-1])
        out.write(", " + json.dumps("groups") + ": {")
        for j, mode in enumerate(lay.modes()):
            out.write(("" if j == 0 else ", ") + json.dumps(mode.value) + ": ")
            out.write(json.dumps(lay.group_array(mode).tolist()))
        out.write("}}")
    out.write("}")
    for key, value in extra.items():
        out.write(", " + json.dumps(key) + ": " + json.dumps(value))
    out.write("}\n")


def _module_summary(plan: ModulePlan, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "truncated": True,
        "world_size": plan.world_size,
        "language": plan.language,
        "note": f"world_size > {JSON_FULL_LIMIT}: groups summarised; --output FILE writes every group",
        "modules": {
            name: {
                "ranks": [lay.offset, lay.offset + lay.world_size - 1],
                "layout": lay.describe(),
                "colocated_with": _colocated(plan, name),
                "summary": _mode_summary(lay),
            }
            for name, lay in plan.layouts.items()
        },
        **extra,
    }


def run_modules(args: argparse.Namespace, par: ParallelConfig) -> int:
    """Run ``parallelctx plan`` for a config with ``parallel.modules`` (``par``, its parallel
    section): each module's ranks, sizes and groups (text: a heading and ``plan``'s table and
    grid per module; ``--json``: ``{"world_size", "language", "modules": {name: {"ranks":
    [first, last], "layout", "colocated_with", "groups": {mode: groups}}}}``; ``--png/--svg``:
    one row of panels per module). The world is ``--world-size`` (or ``--nodes`` x
    ``--nproc-per-node``), else the ranks the modules cover; the size flags are refused (the
    sizes are the modules'). Returns the exit code (0 ok, 2 bad arguments, the message on stderr)."""
    try:
        plan = _module_plan(args, par)
        world = plan.world_size
        warnings: list[tuple[str | None, PlacementWarning]] = []
        spans: dict[str, list[ModeSpan]] = {}
        if args.nproc_per_node is not None:
            uneven = uneven_nodes(world, args.nproc_per_node)
            warnings += [(None, uneven)] if uneven is not None else []
            for name, lay in plan.layouts.items():
                warnings += [(name, w) for w in placement_warnings(lay, args.nproc_per_node, whole_job=False)]
                spans[name] = node_spans(lay, layout_nodes(lay, args.nproc_per_node))
    except (LayoutError, ValueError, OSError) as exc:
        say(f"parallelctx plan: {exc}")
        return 2
    for module, warning in warnings:
        where = f"module {module}: " if module is not None else ""
        say(f"parallelctx plan: warning: {where}{warning}")
    extra: dict[str, Any] = {}
    if args.nproc_per_node is not None:
        extra["placement"] = {
            "nproc_per_node": args.nproc_per_node,
            "nodes": -(-world // args.nproc_per_node),
            "modules": {name: {s.mode: s.as_dict() for s in got} for name, got in spans.items()},
        }
        extra["warnings"] = [{**w.as_dict(), "module": module} for module, w in warnings]
    from .picture import draw_modules

    done = _write_files(args, world, lambda path, fmt: draw_modules(plan, args.nproc_per_node, path, fmt=fmt),
                        lambda out: _module_json(plan, extra, out), lambda: _module_summary(plan, extra))  # fmt: skip
    if done is not None:
        return done
    if args.output is None and not args.json and (not (args.png or args.svg) or args.text):
        from .tables import render

        lines = [f"parallelctx plan: {len(plan.names)} modules on {world} ranks (parallel.modules)"]
        lines += ["  " + line for line in plan.describe().splitlines()]
        sys.stdout.write("\n".join(lines) + "\n")
        for name, lay in plan.layouts.items():
            sys.stdout.write(f"\n{module_heading(plan, name)}\n")
            sys.stdout.write(
                render(lay, spans=spans.get(name), nproc_per_node=args.nproc_per_node, world_size=world)
            )
    return 0


def _write_files(
    args: argparse.Namespace,
    world: int,
    draw: Callable[[str, str], object],
    full: Callable[[IO[str]], None],
    summary: Callable[[], dict[str, Any]],
) -> int | None:
    """The picture files (``--png``/``--svg``, with ``draw(path, fmt)``), then ``--output FILE``
    (``full(file)``) or ``--json`` (``full(stdout)``; ``summary()`` above
    :data:`JSON_FULL_LIMIT` ranks). Returns 2 when a picture cannot be drawn (said on stderr),
    else None."""
    from .picture import PictureError

    for path, fmt in ((args.png, "png"), (args.svg, "svg")):
        if path is None:
            continue
        try:
            draw(path, fmt)
        except PictureError as exc:
            say(f"parallelctx plan: {exc}")
            return 2
        say(f"parallelctx plan: wrote {path}")
    if args.output is not None:
        with open(args.output, "w", encoding="utf-8") as out:
            full(out)
        say(f"parallelctx plan: wrote {args.output}")
    elif args.json:
        if world > JSON_FULL_LIMIT:
            json.dump(summary(), sys.stdout)
            sys.stdout.write("\n")
            say(f"parallelctx plan: {world} ranks: printed a summary; --output FILE writes every group")
        else:
            full(sys.stdout)
    return None
