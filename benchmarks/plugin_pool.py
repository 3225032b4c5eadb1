"""Per-test cost of the pytest plugin's process pool, side by side with fresh processes per test.

    python -m benchmarks.plugin_pool [--tests 40] [--fresh-tests 5] [--append-results]

Writes throw-away test projects and runs pytest on each in a subprocess, one after the other in
one run (the machine is shared: compare the rows with each other, not with other runs):

- ``pooled8`` / ``pooled4``: ``--tests`` trivial tests marked
  ``@pytest.mark.parallel(world_size=W, tensor=2, ...)`` (8 and 4 ranks, one layout);
- ``relaunch8``: the same at 8 ranks, alternating two layouts, so ``gpc`` is launched anew for
  every test (what ``layouts=`` costs);
- ``user8``: issue 26's set-up: OMP_NUM_THREADS unset, a conftest that runs
  ``torch.set_num_threads(2)`` and a large matmul at import and logs through a QueueListener
  thread, tests that each do a matmul and log on 8 ranks;
- ``fresh8``: ``--fresh-tests`` tests that each start 8 fresh processes with
  ``parallelctx.spawn`` (what a harness without a pool does).

Seconds per test are pytest's own per-test times (junit XML), setup and teardown included;
"steady" is the mean after the first test (which starts the pool). ``--append-results``
writes the table to benchmarks/RESULTS.md as a labelled section.
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

POOLED_TEST = """
@pytest.mark.parallel(world_size={world}, {layout})
def test_pooled_{i}():
    pass
"""
USER_CONFTEST = """
import logging, logging.handlers, queue
import torch

torch.set_num_threads(2)
_a = torch.randn(1024, 1024)
_ = (_a @ _a).sum()
_queue = queue.Queue()
_listener = logging.handlers.QueueListener(_queue, logging.FileHandler("records.log"))
_listener.start()
logging.getLogger("user").addHandler(logging.handlers.QueueHandler(_queue))
logging.getLogger("user").setLevel(logging.INFO)
"""
USER_TEST = """
@pytest.mark.parallel(world_size=8, tensor=2, pipeline=2)
def test_user_{i}():
    a = torch.randn(256, 256)
    (a @ a).sum()
    logging.getLogger("user").info("rank %d test {i}", gpc.get_global_rank())
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
HEADER = "import logging\nimport pytest, torch\nfrom parallelctx import gpc\n"


def _run(folder: Path) -> tuple[float, list[float], int]:
    """Run pytest in ``folder``; return (wall seconds, per-test seconds of the passed tests in
    order, how many failed)."""
    xml = folder / "report.xml"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    begin = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "."],
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
        env={**env, "GLOO_SOCKET_IFNAME": "lo"},
    )
    wall = time.perf_counter() - begin
    cases = list(ET.parse(xml).iter("testcase")) if xml.exists() else []
    times = [float(case.get("time")) for case in cases if not len(case)]  # passed: no failure child
    if not times or (proc.returncode != 0 and not folder.name.startswith("fresh")):
        raise RuntimeError(f"pytest in {folder} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    if len(times) < len(cases):  # fresh processes on a loaded machine: gloo may fail to connect
        print(f"{folder.name}: {len(cases) - len(times)} of {len(cases)} tests failed; timing the others")
    return wall, times, len(cases) - len(times)


def _projects(tests: int, fresh_tests: int) -> dict[str, dict[str, str]]:
    """Each project's files: name -> {file name: text}."""
    layouts = ["tensor=2, pipeline=2", "tensor=4"]
    return {
        "pooled8": {
            "test_p.py": HEADER
            + "".join(POOLED_TEST.format(i=i, world=8, layout=layouts[0]) for i in range(tests))
        },
        "pooled4": {
            "test_p.py": HEADER
            + "".join(POOLED_TEST.format(i=i, world=4, layout="tensor=2") for i in range(tests))
        },
        "relaunch8": {
            "test_p.py": HEADER
            + "".join(POOLED_TEST.format(i=i, world=8, layout=layouts[i % 2]) for i in range(tests))
        },
        "user8": {
            "conftest.py": USER_CONFTEST,
            "test_u.py": HEADER + "".join(USER_TEST.format(i=i) for i in range(tests)),
        },
        "fresh8": {
            "test_f.py": FRESH.format(
                tests="".join(FRESH_TEST.format(i=i, world=8) for i in range(fresh_tests))
            )
        },
    }


def measure(tests: int, fresh_tests: int) -> dict[str, dict[str, float]]:
    """Run every project, one after the other.

    Returns:
        Per project: ``tests``, ``mean``, ``first``, ``steady`` (mean after the first),
        ``steady_median``, ``wall``.
    """
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="parallelctx-bench-") as tmp:
        for name, files in _projects(tests, fresh_tests).items():
            folder = Path(tmp) / name
            folder.mkdir()
            for file, text in files.items():
                (folder / file).write_text(text)
            wall, times, failed = _run(folder)
            print(
                f"{name}: first {times[0]:.2f} s, then {statistics.fmean(times[1:] or times):.3f} s per test"
            )
            rest = times[1:] or times
            out[name] = {
                "tests": len(times),
                "mean": statistics.fmean(times),
                "first": times[0],
                "steady": statistics.fmean(rest),
                "steady_median": statistics.median(rest),
                "wall": wall,
                "failed": failed,
            }
            if name == "user8":
                records = (folder / "records.log").read_text().splitlines()
                out[name]["records"] = len(records)
    return out


ROWS = {
    "pooled8": "plugin pool, 8 ranks (tp2 pp2), one layout",
    "pooled4": "plugin pool, 4 ranks (tp2), one layout",
    "relaunch8": "plugin pool, 8 ranks, two layouts alternating (gpc launched for every test)",
    "user8": "plugin pool, 8 ranks: conftest with a thread pool and a logging thread, matmul + log per test",
    "fresh8": "fresh processes per test (`parallelctx.spawn`), 8 ranks",
}
#: Seconds per test once the pool runs that issue 26 allows (8 and 4 ranks).
GOALS = {"pooled8": 0.15, "pooled4": 0.08, "user8": 0.15}


def table(m: dict[str, dict[str, float]]) -> str:
    """The result as a markdown table with the verdicts.

    Returns:
        The table text.
    """
    fresh = m["fresh8"]["mean"]
    rows = [
        "| harness | tests | first test s | s per test after the first (mean / median) | fresh ÷ this | pytest run s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, label in ROWS.items():
        r = m[name]
        rows.append(
            f"| {label} | {int(r['tests'])} | {r['first']:.2f} | {r['steady']:.3f} / {r['steady_median']:.3f} | "
            f"{fresh / r['steady']:.0f}x | {r['wall']:.1f} |"
        )
    verdicts = []
    for name, goal in GOALS.items():
        got = m[name]["steady"]
        verdicts.append(
            f"- {ROWS[name]}: {got:.3f} s per test after the first (goal ≤ {goal}: {'met' if got <= goal else 'NOT met'})"
        )
    if "records" in m["user8"]:
        want = 8 * int(m["user8"]["tests"])
        verdicts.append(
            f"- the conftest's logging thread wrote {int(m['user8']['records'])} of {want} records"
        )
    for name in ROWS:
        if m[name].get("failed"):
            verdicts.append(
                f"- {ROWS[name]}: {int(m[name]['failed'])} more test(s) failed (gloo could not connect) "
                "and are not timed"
            )
    relaunch = m["relaunch8"]["steady"] - m["pooled8"]["steady"]
    verdicts.append(
        f"- launching gpc anew adds {relaunch * 1000:.0f} ms per 8-rank test (relaunch8 − pooled8)"
    )
    return "\n".join(rows) + "\n\n" + "\n".join(verdicts) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Measure, print, and optionally append to RESULTS.md.

    Returns:
        The exit code (0).

    Raises:
        RuntimeError: a pytest run failed (its output is in the message).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=40)
    parser.add_argument("--fresh-tests", type=int, default=5)
    parser.add_argument("--append-results", action="store_true")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    m = measure(args.tests, args.fresh_tests)
    load_after = os.getloadavg()
    text = table(m)
    print(text)
    if args.append_results:
        when = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m benchmarks.plugin_pool " + " ".join(argv if argv is not None else sys.argv[1:])
        section = (
            "## pytest plugin: pooled vs fresh processes per test (issues 9, 26)\n\n"
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
