"""The main demo: the layout, then ``parallelctx check`` on the demo config.

    torchrun --standalone --nproc-per-node 8 -m parallelctx.cli.demo --config configs/demo_3d.py

Rank 0 prints the layout table and picture and the launch summary; then every rank runs the
check of :mod:`parallelctx.cli.check` (membership proven by collectives, all-reduce times per
group, seed properties) and rank 0 prints its table. The exit code is 1 on every rank when any
check fails. Takes the options of ``parallelctx check``.
"""

from __future__ import annotations

import argparse
import sys

from ..context import ParallelContext
from .check import run
from .main import check_arguments
from .tables import render


def main(argv: list[str] | None = None) -> int:
    """Run the demo in this process; return 0 when every check passed, else 1 (2: bad options)."""
    parser = argparse.ArgumentParser(description=__doc__)
    check_arguments(parser)
    parser.set_defaults(config="configs/demo_3d.py")
    args = parser.parse_args(argv)

    def intro(ctx: ParallelContext) -> None:
        if ctx.get_global_rank() == 0 and not args.json:
            print(render(ctx.layout))
            print(ctx.summary())
            print(f"processes on this node: {ctx.num_processes_on_current_node}, nodes: {ctx.num_nodes}")

    return run(args, prepare=intro)


if __name__ == "__main__":
    sys.exit(main())
