"""Dry runs (``parallelctx dry-run``, docs/dry_run.md): one rank of a big job, and a sweep.

    python -m benchmarks.dry_run [--repeats 3] [--worlds 1024,16384,131072] [--sweep-world 1024] [--jobs N]
                                 [--write-results]

1. One rank of 1,024 / 16,384 / 131,072 ranks (tensor 8, pipeline 16) with
   ``examples/dry_run/train.py``, each in a fresh ``parallelctx dry-run`` process: the report's
   ``launch_s`` (targets: under 2 s at 16,384, under 5 s at 131,072) and the process's wall time
   (torch's import included); medians of ``--repeats``.
2. Memory of one simulated launch (tracemalloc peak, in a fresh process per world size): the
   whole launch, and torch's own ``init_process_group`` on the fake backend alone (torch keeps a
   ``{rank: rank}`` dict of the world); the difference is what parallelctx adds, which must not
   grow with the world beyond the rank's own groups.
3. A sweep of every rank of a ``--sweep-world`` job with the same script (target for 1,024: under
   120 s): wall time, and the CPU seconds per rank (user + system of the forked ranks), which a
   loaded machine does not inflate.
4. The same sweep of ``benchmarks/dry_run_steps.py`` (a few hundred collectives and
   point-to-point calls per rank), with the call ledger and its cross-rank checks on and with
   ``--no-record-calls``, alternating, side by side: what recording the calls costs.

``--write-results`` writes the tables as the ``dry_run`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import sections

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SCRIPT = ROOT / "examples" / "dry_run" / "train.py"
WORLDS = (1024, 16384, 131072)

_MEMORY = """
import json, sys, tracemalloc
import torch.distributed as dist
from parallelctx import gpc
from parallelctx.dryrun import fake_default_group
world = int(sys.argv[1])
tracemalloc.start()
fake_default_group(world - 1, world, None)
torch_only = tracemalloc.get_traced_memory()[1]
dist.destroy_process_group()
tracemalloc.stop()
tracemalloc.start()
gpc.launch(dict(parallel=dict(tensor=8, pipeline=16)), simulate=dict(world_size=world, rank=world - 1))
whole = tracemalloc.get_traced_memory()[1]
members = sum(len(g) for g in gpc.dry_run.report()["groups"].values())
print(json.dumps({"torch_init": torch_only, "launch": whole, "group_members": members}))
"""


def one_rank(world: int, repeats: int) -> dict[str, float]:
    """Median launch_s and wall time of ``parallelctx dry-run`` as the last rank of ``world``."""
    launch, wall = [], []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        for _ in range(repeats):
            begin = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "parallelctx", "dry-run", "--world-size", str(world), "--rank",
                 str(world - 1), "--json", str(out), str(SCRIPT)],
                check=True, capture_output=True, timeout=600,
            )  # fmt: skip
            wall.append(time.perf_counter() - begin)
            launch.append(json.loads(out.read_text())["launch_s"])
    return {"world": world, "launch_s": statistics.median(launch), "wall_s": statistics.median(wall)}


def memory(world: int) -> dict[str, int]:
    """Peak traced bytes of torch's fake init alone and of the whole simulated launch."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY, str(world)], check=True, capture_output=True, text=True, timeout=600
    )
    return {"world": world, **json.loads(proc.stdout.strip().splitlines()[-1])}


def sweep(
    world: int, jobs: int | None, script: Path = SCRIPT, extra: tuple[str, ...] = ()
) -> dict[str, float]:
    """Wall time and CPU seconds per rank of ``--ranks all`` over ``world`` ranks."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    begin = time.perf_counter()
    cmd = [sys.executable, "-m", "parallelctx", "dry-run", "--world-size", str(world), "--ranks", "all"]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    proc = subprocess.run([*cmd, *extra, str(script)], capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - begin
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "world": world,
        "wall_s": wall,
        "cpu_per_rank_s": cpu / world,
        "passed": proc.returncode == 0,
        "jobs": jobs or os.cpu_count() or 1,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure, print the tables, optionally write them to RESULTS.md; return 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--worlds",
        default=",".join(map(str, WORLDS)),
        help="world sizes, multiples of 128 (tensor 8 x pipeline 16)",
    )
    parser.add_argument("--sweep-world", type=int, default=1024)
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    ranks = [one_rank(w, args.repeats) for w in worlds]
    mems = [memory(w) for w in worlds]
    swept = sweep(args.sweep_world, args.jobs)
    steps = Path(__file__).with_name("dry_run_steps.py")
    on, off = [], []
    for _ in range(args.repeats):  # alternating, so that a change of load falls on both
        off.append(sweep(args.sweep_world, args.jobs, steps, ("--no-record-calls",)))
        on.append(sweep(args.sweep_world, args.jobs, steps))
    load = os.getloadavg()[0]
    lines = [
        "## Dry runs (`parallelctx dry-run`)",
        "",
        f"Written by `python -m benchmarks.dry_run --repeats {args.repeats} --write-results` on "
        f"{os.cpu_count()} cores, load average {load:.1f} at the end. One rank: the last rank of a job of "
        "tensor 8 x pipeline 16 running `examples/dry_run/train.py` in a fresh process (median of "
        f"{args.repeats}); `launch_s` is the report's (targets: < 2 s at 16,384, < 5 s at 131,072).",
        "",
        "| world | launch_s | process wall s (torch import included) | torch init peak MiB | launch peak MiB | parallelctx's part MiB | members of the rank's groups |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r, m in zip(ranks, mems):
        lines.append(
            f"| {r['world']:,} | {r['launch_s']:.3f} | {r['wall_s']:.2f} | {m['torch_init'] / 2**20:.2f} | "
            f"{m['launch'] / 2**20:.2f} | {(m['launch'] - m['torch_init']) / 2**20:.2f} | {m['group_members']:,} |"
        )
    lines += [
        "",
        "torch's `init_process_group` keeps a `{rank: rank}` dict of the whole world (about 70 bytes "
        "per rank); the rest of the launch grows only with the rank's own groups (the data group "
        "grows with the world at fixed tensor and pipeline sizes).",
        "",
        f"Sweep: all {swept['world']:,} ranks of a {swept['world']:,}-rank job, {swept['jobs']} at a time: "
        f"{swept['wall_s']:.1f} s wall, {swept['cpu_per_rank_s']:.3f} CPU s per rank "
        f"(so about {swept['cpu_per_rank_s'] * swept['world'] / swept['jobs']:.0f} s on {swept['jobs']} idle cores); "
        f"checks {'passed' if swept['passed'] else 'FAILED'} (target: < 120 s).",
        "",
        f"Recording the calls: sweeps of all {args.sweep_world:,} ranks of `benchmarks/dry_run_steps.py` "
        f"(300 calls per middle-stage rank), {args.repeats} rounds alternating; medians.",
        "",
        "| sweep | wall s | CPU s per rank | checks |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, runs in (("`--no-record-calls`", off), ("calls recorded and checked", on)):
        lines.append(
            f"| {name} | {statistics.median(r['wall_s'] for r in runs):.1f} | "
            f"{statistics.median(r['cpu_per_rank_s'] for r in runs):.3f} | "
            f"{'passed' if all(r['passed'] for r in runs) else 'FAILED'} |"
        )
    ratio = statistics.median(r["cpu_per_rank_s"] for r in on) / statistics.median(
        r["cpu_per_rank_s"] for r in off
    )
    lines += ["", f"CPU per rank, recorded / not recorded: {ratio:.2f}x."]
    text = "\n".join(lines)
    print(text)
    if args.write_results:
        sections.write_section(RESULTS, "dry_run", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
