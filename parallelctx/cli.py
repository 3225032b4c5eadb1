"""The ``parallelctx`` command (also ``python -m parallelctx``).

    parallelctx plan --world-size 16 --tensor 2 --pipeline 2 [--context N] [--expert N]
                     [--expert-tensor N] [--order S] [--json]
    parallelctx env [--json]     which launcher started this process and what it said
"""

from __future__ import annotations

import argparse
import json
import sys

from .layout import DEFAULT_ORDER, LayoutError, plan

__all__ = ["main"]


def _cmd_plan(args: argparse.Namespace) -> int:
    try:
        layout = plan(
            args.world_size,
            tensor=args.tensor,
            pipeline=args.pipeline,
            context=args.context,
            expert=args.expert,
            expert_tensor=args.expert_tensor,
            order=args.order,
        )
    except LayoutError as exc:
        print(f"parallelctx plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(layout.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        from .show import render

        sys.stdout.write(render(layout))
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
    variables = info.pop("variables")
    rows = [(key, "-" if value is None else str(value)) for key, value in info.items()]
    rows += [(name, value) for name, value in variables.items()]  # type: ignore[union-attr]
    width = max(len(key) for key, _ in rows)
    sys.stdout.write(f"{'field':<{width}}  value\n{'-' * width}  {'-' * 5}\n")
    for i, (key, value) in enumerate(rows):
        if i == len(info):
            sys.stdout.write(f"{'read from the environment':<{width}}\n")
        sys.stdout.write(f"{key:<{width}}  {value}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``parallelctx`` command."""
    parser = argparse.ArgumentParser(prog="parallelctx", description="parallelctx command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the rank layout of a world (no processes started)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--tensor", type=int, default=1)
    p.add_argument("--pipeline", type=int, default=1)
    p.add_argument("--context", type=int, default=1)
    p.add_argument("--expert", type=int, default=1)
    p.add_argument("--expert-tensor", type=int, default=None, help="default: the tensor size")
    p.add_argument("--order", default=DEFAULT_ORDER, help=f"fastest axis first (default {DEFAULT_ORDER})")
    p.add_argument("--json", action="store_true", help="print {mode: groups} as JSON")
    p.set_defaults(func=_cmd_plan)
    e = sub.add_parser("env", help="print which launcher started this process and what it said")
    e.add_argument("--json", action="store_true", help="print the fields as one JSON object")
    e.set_defaults(func=_cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit code (0 ok, 2 bad arguments)."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))
