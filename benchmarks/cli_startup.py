"""Start-up of the torch-free planner: ``parallelctx plan`` against ``python -c "import torch"``.

    python -m benchmarks.cli_startup [--runs 7] [--write-results]

Each command runs ``--runs`` times in a fresh interpreter (the same Python); the table gives the
median wall time of each and the ratio. ``--write-results`` writes it as a labelled section of
benchmarks/RESULTS.md (replacing an earlier one; ``make bench`` keeps it). Goal (issue 13):
``plan`` under a third of ``import torch``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import sections

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
COMMANDS = {
    'python -c "import torch"': [sys.executable, "-c", "import torch"],
    "python -m parallelctx plan --world-size 16 --tensor 2 --pipeline 2": [
        sys.executable,
        "-m",
        "parallelctx",
        "plan",
        "--world-size",
        "16",
        "--tensor",
        "2",
        "--pipeline",
        "2",
    ],
    "python -m parallelctx plan ... --json": [
        sys.executable,
        "-m",
        "parallelctx",
        "plan",
        "--world-size",
        "16",
        "--tensor",
        "2",
        "--json",
    ],
}


def median_seconds(cmd: list[str], runs: int) -> float:
    """Return the median wall time of ``runs`` runs of ``cmd`` (output discarded).

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, optionally write it to RESULTS.md; return 0."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    seconds = {name: median_seconds(cmd, args.runs) for name, cmd in COMMANDS.items()}
    torch_s = seconds['python -c "import torch"']
    lines = ["| command | median wall time | ÷ import torch |", "| --- | ---: | ---: |"]
    lines += [f"| `{name}` | {s:.3f} s | {s / torch_s:.2f} |" for name, s in seconds.items()]
    table = "\n".join(lines)
    print(table)
    if args.write_results:
        section = (
            "## Start-up of the torch-free planner (issue 13)\n\n"
            f"Written by `python -m benchmarks.cli_startup --runs {args.runs} --write-results`: median of "
            f"{args.runs} fresh interpreters each; load average {load[0]:.1f} before the run. Goal: `plan` "
            "under a third of `import torch`.\n\n" + table
        )
        sections.write_section(RESULTS, "cli_startup", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
