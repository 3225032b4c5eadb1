"""Per-test cost of the pytest plugin's process pool against fresh processes per test.

    python -m benchmarks.plugin_pool [--tests 40] [--fresh-tests 40] [--world-size 8] [--append-results]

Writes two throw-away test files: ``--tests`` trivial tests marked
``@pytest.mark.parallel(world_size=W, tensor=2, pipeline=2)`` (the plugin's pool), and
``--fresh-tests`` tests that each start W fresh processes with ``parallelctx.spawn`` (what a
harness without a pool does), runs pytest on each in a subprocess, and prints seconds per test
from pytest's own per-test times (junit XML). ``--append-results`` appends the table to
benchmarks/RESULTS.md as a labelled section.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from . import sections

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"

POOLED = """
import pytest

{tests}
"""
POOLED_TEST = """
@pytest.mark.parallel(world_size={world}, tensor=2, pipeline=2)
def test_pooled_{i}():
    pass
"""
FRESH = """
import parallelctx


def trivial():
    pass

{tests}
"""
FRESH_TEST = """
def test_fresh_{i}():
    parallelctx.spawn(trivial, {world}, config=dict(parallel=dict(tensor=2, pipeline=2)), backend="gloo",
                      join_timeout=300)
"""


def _run(folder: Path, name: str) -> tuple[float, list[float]]:
    """Run pytest on one file; return (wall seconds, per-test seconds in order)."""
    xml = folder / f"{name}.xml"
    begin = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", f"{name}.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    wall = time.perf_counter() - begin
    if proc.returncode != 0:
        raise RuntimeError(f"pytest on {name}.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    times = [float(case.get("time")) for case in ET.parse(xml).iter("testcase")]
    return wall, times


def measure(tests: int, fresh_tests: int, world: int) -> dict[str, float]:
    """Run both files.

    Returns:
        The measurements: per-test means, the pool's first test, wall times, ratios.
    """
    with tempfile.TemporaryDirectory(prefix="parallelctx-bench-") as tmp:
        folder = Path(tmp)
        (folder / "pooled.py").write_text(
            POOLED.format(tests="".join(POOLED_TEST.format(i=i, world=world) for i in range(tests)))
        )
        (folder / "fresh.py").write_text(
            FRESH.format(tests="".join(FRESH_TEST.format(i=i, world=world) for i in range(fresh_tests)))
        )
        pooled_wall, pooled = _run(folder, "pooled")
        fresh_wall, fresh = _run(folder, "fresh")
    out = {
        "tests": tests,
        "fresh_tests": fresh_tests,
        "world": world,
        "pooled_wall": pooled_wall,
        "pooled_mean": statistics.fmean(pooled),
        "pooled_first": pooled[0],
        "pooled_steady": statistics.fmean(pooled[1:]) if len(pooled) > 1 else pooled[0],
        "pooled_steady_median": statistics.median(pooled[1:]) if len(pooled) > 1 else pooled[0],
        "fresh_wall": fresh_wall,
        "fresh_mean": statistics.fmean(fresh),
    }
    out["ratio"] = out["fresh_mean"] / out["pooled_mean"]
    out["ratio_steady"] = out["fresh_mean"] / out["pooled_steady"]
    return out


def table(m: dict[str, float]) -> str:
    """The result as a markdown table.

    Returns:
        The table text.
    """
    w = int(m["world"])
    rows = [
        "| harness | tests | s per test (mean) | notes |",
        "|---|---:|---:|---|",
        f"| plugin pool, {w} ranks | {int(m['tests'])} | {m['pooled_mean']:.3f} | "
        f"first test (starts the pool) {m['pooled_first']:.2f} s; "
        f"the other {int(m['tests']) - 1}: mean {m['pooled_steady']:.3f} s, median "
        f"{m['pooled_steady_median']:.3f} s; pytest run {m['pooled_wall']:.1f} s |",
        f"| fresh processes per test (`parallelctx.spawn`), {w} ranks | {int(m['fresh_tests'])} | "
        f"{m['fresh_mean']:.3f} | pytest run {m['fresh_wall']:.1f} s |",
    ]
    verdict = (
        f"fresh ÷ pooled per test: **{m['ratio']:.1f}x** counting the pool's start-up "
        f"({m['ratio_steady']:.1f}x once the pool runs); "
        f"goal ≥ 10x: {'met' if m['ratio'] >= 10 else 'NOT met'}. "
        f"Per-test overhead once the pool runs: {m['pooled_steady']:.3f} s "
        f"(goal < 0.2 s: {'met' if m['pooled_steady'] < 0.2 else 'NOT met'})."
    )
    return "\n".join(rows) + "\n\n" + verdict + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure, print, and optionally append to RESULTS.md.

    Returns:
        The exit code (0).

    Raises:
        RuntimeError: a pytest run failed (its output is in the message).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=40)
    parser.add_argument("--fresh-tests", type=int, default=40)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--append-results", action="store_true")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    m = measure(args.tests, args.fresh_tests, args.world_size)
    load_after = os.getloadavg()
    text = table(m)
    print(text)
    if args.append_results:
        when = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m benchmarks.plugin_pool " + " ".join(argv if argv is not None else sys.argv[1:])
        section = (
            "## pytest plugin: pooled vs fresh processes per test (issue 9)\n\n"
            f"Appended by `{command.strip()}` on {when}: Python {platform.python_version()}, torch "
            f"{torch.__version__}, {os.cpu_count()} CPU cores, gloo on CPU; load average (1/5/15 min) "
            f"{' / '.join(f'{x:.1f}' for x in load_before)} before and "
            f"{' / '.join(f'{x:.1f}' for x in load_after)} after (the machine is shared). "
            "Seconds per test are "
            "pytest's own call times (junit XML), setup and teardown included.\n\n" + text
        )
        sections.write_section(RESULTS, "plugin_pool", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
