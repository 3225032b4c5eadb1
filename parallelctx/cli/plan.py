"""``parallelctx plan``: the layout of a world as a table, JSON or a picture; no process started."""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO, Any

from pydantic import ValidationError

from ..config import ParallelConfig, load_config, validation_error
from ..planning.layout import DEFAULT_ORDER, Layout, LayoutError
from .placement import ModeSpan, PlacementWarning, node_ids, node_spans, placement_warnings

__all__ = ["JSON_FULL_LIMIT", "run"]


JSON_FULL_LIMIT = 16_384
"""Above this many ranks ``plan --json`` prints a summary unless ``--output FILE`` is given."""

_HEAD_GROUPS = 4


def _parallel(args: argparse.Namespace) -> ParallelConfig:
    """The ``parallel`` section from the flags, falling back to ``--config``'s, then to size 1."""
    sizes: dict[str, Any] = {"tensor": 1, "pipeline": 1, "context": 1, "expert": 1, "expert_tensor": None}
    sizes.update(gtp_remat=1, expert_gtp_remat=1)
    sizes["order"] = DEFAULT_ORDER
    data = None
    if args.config is not None:
        par = load_config(args.config).parallel
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


def _json_summary(layout: Layout, extra: dict[str, Any]) -> dict[str, Any]:
    groups = {}
    for mode in layout.modes():
        array = layout.group_array(mode)
        head = array[:_HEAD_GROUPS, : min(array.shape[1], 16)].tolist()
        groups[mode.value] = {"group_size": int(array.shape[1]), "groups": int(array.shape[0]), "first": head}
    return {
        "truncated": True,
        "world_size": layout.world_size,
        "layout": layout.describe(),
        "note": f"world_size > {JSON_FULL_LIMIT}: groups summarised; --output FILE writes every group",
        "summary": groups,
        **extra,
    }


def run(args: argparse.Namespace) -> int:
    """Run ``parallelctx plan`` with parsed ``args``; return the exit code (0 ok, 2 bad arguments)."""
    try:
        world = _world_size(args)
        layout = _parallel(args).to_layout(world)
        warnings: list[PlacementWarning] = []
        spans: list[ModeSpan] = []
        if args.nproc_per_node is not None:
            warnings = placement_warnings(layout, args.nproc_per_node)
            spans = node_spans(layout, node_ids(world, args.nproc_per_node))
    except (LayoutError, ValueError, OSError) as exc:  # ConfigError and pydantic errors are ValueErrors
        print(f"parallelctx plan: {exc}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"parallelctx plan: warning: {warning}", file=sys.stderr)
    extra: dict[str, Any] = {}
    if args.nproc_per_node is not None:
        extra["placement"] = {
            "nproc_per_node": args.nproc_per_node,
            "nodes": -(-world // args.nproc_per_node),
            "modes": {span.mode: span.as_dict() for span in spans},
        }
        extra["warnings"] = [w.as_dict() for w in warnings]
    for path, fmt in ((args.png, "png"), (args.svg, "svg")):
        if path is None:
            continue
        from .picture import PictureError, draw

        try:
            draw(layout, args.nproc_per_node, path, fmt=fmt)
        except PictureError as exc:
            print(f"parallelctx plan: {exc}", file=sys.stderr)
            return 2
        print(f"parallelctx plan: wrote {path}", file=sys.stderr)
    if args.output is not None:
        with open(args.output, "w", encoding="utf-8") as out:
            _json_full(layout, extra, out)
        print(f"parallelctx plan: wrote {args.output}", file=sys.stderr)
    elif args.json:
        if world > JSON_FULL_LIMIT:
            json.dump(_json_summary(layout, extra), sys.stdout)
            sys.stdout.write("\n")
            print(
                f"parallelctx plan: {world} ranks: printed a summary; --output FILE writes every group",
                file=sys.stderr,
            )
        else:
            _json_full(layout, extra, sys.stdout)
    elif not (args.png or args.svg) or args.text:
        from .tables import render

        sys.stdout.write(render(layout, spans=spans, nproc_per_node=args.nproc_per_node))
    return 0
