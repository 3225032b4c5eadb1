"""Test-only: ``parallelctx check`` with a tampered group table, run under torchrun.

    torchrun --standalone --nproc-per-node 8 tests/check_tamper.py OUT_DIR [check options]

After launch and before the checks, every rank's TENSOR group (and its CPU group) is swapped
for its DATA group, as a bug in group creation would; the check must fail and name ``tensor``.
Each rank writes its exit code to ``OUT_DIR/rank-<R>.rc``. Not part of the package.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from parallelctx import ParallelMode
from parallelctx.cli import build_parser
from parallelctx.cli.check import run
from parallelctx.context import ParallelContext


def tamper(ctx: ParallelContext) -> None:
    ctx._groups[ParallelMode.TENSOR] = ctx._groups[ParallelMode.DATA]
    ctx._cpu_groups[ParallelMode.TENSOR] = ctx._cpu_groups[ParallelMode.DATA]


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    code = run(build_parser().parse_args(["check", *sys.argv[2:]]), prepare=tamper)
    (out_dir / f"rank-{os.environ['RANK']}.rc").write_text(str(code))
    sys.exit(code)
