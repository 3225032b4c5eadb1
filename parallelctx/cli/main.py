"""The ``parallelctx`` command (also ``python -m parallelctx``): argument parsing and dispatch.

parallelctx plan --world-size 16 --tensor 2 --pipeline 2 [--context N] [--expert N]
                 [--expert-tensor N] [--replicate R] [--shard S] [--order S]
                 [--gtp-remat N] [--expert-gtp-remat N]
                 [--config FILE] [--nproc-per-node G]
                 [--nodes N] [--json] [--output FILE] [--png FILE] [--svg FILE]
parallelctx check [--config FILE] [--sizes 4KiB,1MiB,16MiB] [--json]   under a launcher
parallelctx env [--json]     which launcher started this process and what it said
parallelctx dry-run --world-size W [--rank R | --ranks all|cover|0,17|sample:N] script.py [args...]
                             run a script as rank R of a W-rank job on torch's fake backend

Each command lives in its own module of this package and is imported only when it runs, so
``plan`` and ``env`` never load torch.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..planning.layout import DEFAULT_ORDER

__all__ = ["build_parser", "check_arguments", "main"]


def _cmd_plan(args: argparse.Namespace) -> int:
    from .plan import run

    return run(args)


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import run

    return run(args)


def _cmd_check(args: argparse.Namespace) -> int:
    from .check import run  # imports torch: only the check command pays for it

    return run(args)


def _cmd_dry_run(args: argparse.Namespace) -> int:
    from .dry_run import run  # imports torch when the script runs

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
    p.add_argument(
        "--config",
        default=None,
        help="take sizes and order from this config's parallel section (parallel.modules: each module's layout)",
    )
    p.add_argument("--tensor", type=int, default=None)
    p.add_argument("--pipeline", type=int, default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--expert", type=int, default=None)
    p.add_argument("--expert-tensor", type=int, default=None, help="default: the tensor size")
    p.add_argument("--replicate", type=int, default=None, help="HSDP: replicas of the data axis (outer part)")
    p.add_argument(
        "--shard", type=int, default=None, help="HSDP: shard size of the data axis (default: derived)"
    )
    p.add_argument("--order", default=None, help=f"fastest axis first (default {DEFAULT_ORDER})")
    p.add_argument("--gtp-remat", type=int, default=None, help="Megatron-core 0.19's GTP size (dense)")
    p.add_argument(
        "--expert-gtp-remat", type=int, default=None, help="Megatron-core 0.19's GTP size (experts)"
    )
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
    from .dry_run import add_arguments  # torch-free at import

    d = sub.add_parser(
        "dry-run", help="run a script as any rank of a big job on one machine (torch's fake backend)"
    )
    add_arguments(d)
    d.set_defaults(func=_cmd_dry_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit code (0 ok, 2 bad arguments, 141 when the reader of
    its output closed the pipe)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (``parallelctx plan --json | head``): stop quietly, as Unix tools
        # do, and keep Python from complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe
