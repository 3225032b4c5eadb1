"""The ``parallelctx`` command (also ``python -m parallelctx``).

parallelctx plan --world-size 16 --tensor 2 --pipeline 2 [--context N] [--expert N]
                 [--expert-tensor N] [--order S] [--config FILE] [--nproc-per-node G]
                 [--nodes N] [--json] [--output FILE] [--png FILE] [--svg FILE]
parallelctx check [--config FILE] [--sizes 4KiB,1MiB,16MiB] [--json]   under a launcher
parallelctx env [--json]     which launcher started this process and what it said
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO, Any

from .config import ParallelConfig, load_config
from .layout import DEFAULT_ORDER, Layout, LayoutError
from .placement import ModeSpan, PlacementWarning, node_ids, node_spans, placement_warnings

__all__ = ["build_parser", "check_arguments", "main"]


JSON_FULL_LIMIT = 16_384
"""Above this many ranks ``plan --json`` prints a summary unless ``--output FILE`` is given."""

_HEAD_GROUPS = 4


def _parallel(args: argparse.Namespace) -> ParallelConfig:
    """The ``parallel`` section from the flags, falling back to ``--config``'s, then to size 1."""
    sizes: dict[str, Any] = {"tensor": 1, "pipeline": 1, "context": 1, "expert": 1, "expert_tensor": None}
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
        )
        data = par.data
    for key in ("tensor", "pipeline", "context", "expert", "expert_tensor", "order"):
        value = getattr(args, key)
        if value is not None:
            sizes[key] = value
    return ParallelConfig.model_validate(
        {
            "tensor": sizes["tensor"],
            "pipeline": sizes["pipeline"],
            "context": sizes["context"],
            "expert": {"size": sizes["expert"], "tensor": sizes["expert_tensor"]},
            "order": sizes["order"],
            "data": data,
        }
    )


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


def _cmd_plan(args: argparse.Namespace) -> int:
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
        from .show import render

        sys.stdout.write(render(layout, spans=spans, nproc_per_node=args.nproc_per_node))
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import LaunchEnvError, detect

    try:
        found = detect()
    except LaunchEnvError as exc:
        print(f"parallelctx env: {exc}", file=sys.stderr)
        return 2
    info = found.as_dict()
    if args.json:
        json.dump(info, sys.stdout)
        sys.stdout.write("\n")
        return 0
    info.pop("variables")
    rows = [(key, "-" if value is None else str(value)) for key, value in info.items()]
    rows += list(found.variables)
    width = max(len(key) for key, _ in rows)
    sys.stdout.write(f"{'field':<{width}}  value\n{'-' * width}  {'-' * 5}\n")
    for i, (key, value) in enumerate(rows):
        if i == len(info):
            sys.stdout.write(f"{'read from the environment':<{width}}\n")
        sys.stdout.write(f"{key:<{width}}  {value}\n")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .checkcmd import run  # imports torch: only the check command pays for it

    return run(args)


def check_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``parallelctx check`` to ``parser`` (shared with the demo); returns None."""
    parser.add_argument(
        "--config", default=None, help="config file (.py/.json/.toml/.yaml); default: all sizes 1"
    )
    parser.add_argument(
        "--sizes", default="4KiB,1MiB,16MiB", help="all-reduce message sizes (default %(default)s)"
    )
    parser.add_argument(
        "--iters", type=int, default=5, help="timed all-reduces per size and group (default 5)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed all-reduces first (default 1)")
    parser.add_argument(
        "--slow-factor",
        type=float,
        default=2.0,
        help="flag groups slower than this times their peers' median (default 2)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on rank 0")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``parallelctx`` command."""
    parser = argparse.ArgumentParser(prog="parallelctx", description="parallelctx command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the rank layout of a world (no processes started)")
    p.add_argument("--world-size", type=int, default=None, help="ranks in the job (or --nodes with G)")
    p.add_argument("--nodes", type=int, default=None, help="nodes; world = nodes x --nproc-per-node")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="G",
        help="ranks per node: node = rank // G, as torchrun and srun place them",
    )
    p.add_argument("--config", default=None, help="take sizes and order from this config's parallel section")
    p.add_argument("--tensor", type=int, default=None)
    p.add_argument("--pipeline", type=int, default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--expert", type=int, default=None)
    p.add_argument("--expert-tensor", type=int, default=None, help="default: the tensor size")
    p.add_argument("--order", default=None, help=f"fastest axis first (default {DEFAULT_ORDER})")
    p.add_argument("--json", action="store_true", help="print {mode: groups} as JSON")
    p.add_argument("--output", default=None, metavar="FILE", help="write the full JSON to FILE")
    p.add_argument("--png", default=None, metavar="FILE", help="draw the ranks on their nodes (needs [plot])")
    p.add_argument("--svg", default=None, metavar="FILE", help="the same picture as SVG")
    p.add_argument("--text", action="store_true", help="print the table too when drawing a picture")
    p.set_defaults(func=_cmd_plan)
    c = sub.add_parser("check", help="under a launcher: prove and time every group, check the seeds")
    check_arguments(c)
    c.set_defaults(func=_cmd_check)
    e = sub.add_parser("env", help="print which launcher started this process and what it said")
    e.add_argument("--json", action="store_true", help="print the fields as one JSON object")
    e.set_defaults(func=_cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit code (0 ok, 2 bad arguments)."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))
