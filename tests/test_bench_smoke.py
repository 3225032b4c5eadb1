"""Smoke test of the benchmarks: each runs once at a tiny size, so that none can rot.

Asserts only that they run and print their tables; timings never decide a pass or fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("megatron.core")
pytest.importorskip("matplotlib")


@pytest.mark.bench
def test_benchmarks_run_once_and_print_tables(tmp_path: Path) -> None:
    """The whole entry point at world 4, one round, two small simulated worlds."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--worlds",
        "4",
        "--repeats",
        "1",
        "--query-calls",
        "2000",
        "--sim-worlds",
        "64",
        "1024",
        "--sim-repeats",
        "1",
        "--timeout",
        "240",
        "--out",
        str(tmp_path),
        "--no-install",
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for heading in ("## Start-up", "## Queries", "## Simulated start-up"):
        assert heading in out
    for lib in ("parallelctx", "Megatron-core", "DeviceMesh"):
        assert f"| {lib} |" in out
    assert "get_tensor_model_parallel_rank()" in out and 'mesh.get_local_rank("tp")' in out
    results = (tmp_path / "RESULTS.md").read_text()
    assert "python -m benchmarks.run --worlds 4" in results
    assert (tmp_path / "startup.png").stat().st_size > 0


def test_simulated_sizes_divide_the_world() -> None:
    """The simulated layouts shrink the wanted sizes until they divide the world."""
    from benchmarks.simulate import sizes_for
    from parallelctx import plan

    for world in (4, 64, 1024, 131072):
        sizes = sizes_for(world)
        plan(world, **sizes)  # raises if they do not fit
    assert sizes_for(131072) == {"tensor": 8, "pipeline": 16, "context": 2, "expert": 8}


def test_megatron_bridge_section_replaces_itself(tmp_path: Path) -> None:
    """benchmarks.megatron_bridge appends its labelled section once, then replaces it."""
    from benchmarks.megatron_bridge import END, START, write_section

    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nbody\n")
    write_section(results, "| first |", ["--worlds", "8"])
    write_section(results, "| second |", ["--worlds", "8"])
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\nbody\n")
    assert text.count(START) == text.count(END) == 1
    assert "| second |" in text and "| first |" not in text


def test_torchtitan_bridge_table_takes_max_over_ranks_and_median_of_rounds() -> None:
    from benchmarks.torchtitan_bridge import table

    def rec(bridge: float, titan: float) -> dict:
        one = {"first_collective_s": 1.0, "calls": 3, "joined": 4}
        return {"bridge": {**one, "create_s": bridge}, "torchtitan": {**one, "create_s": titan, "calls": 10}}

    ranks = [
        {"2,4,1,1,1,1": [rec(0.1, 0.2), rec(0.1, 0.2), rec(0.3, 0.1)]},
        {"2,4,1,1,1,1": [rec(0.2, 0.4), rec(0.1, 0.1), rec(0.1, 0.1)]},
    ]
    row = table(ranks).splitlines()[-1]
    # per round, the slowest rank: bridge 0.2, 0.1, 0.3; torchtitan 0.4, 0.2, 0.1 -> ratios 0.5, 0.5, 3
    assert row == "| 2, 4, 1, 1, 1, 1 | 200 ms | 200 ms | 0.50 | 1.00 | 3, 10 | 4, 4 |"


def test_megatron_bridge_pgc_table_shows_the_torch_floor_from_its_own_job() -> None:
    """The process_groups() table carries torch alone making the same groups (run in its own
    job), as a median of per-round ratios against Megatron's init in that job."""
    from benchmarks.megatron_bridge import table

    def rnd(**times: float) -> list[dict]:
        return [
            {"lib": lib, "create_s": t, "first_collective_s": t, "calls_max": 7} for lib, t in times.items()
        ]

    run = {
        "world_size": 16,
        "tensor": 2,
        "pipeline": 4,
        "lazy_init": True,
        "rounds": [rnd(bridge_pgc=0.08, megatron=0.1), rnd(bridge_pgc=0.09, megatron=0.1)],
        "floor": {"rounds": [rnd(torch_groups=0.03, megatron=0.1), rnd(torch_groups=0.05, megatron=0.1)]},
    }
    head, _, row = table([run], {}, "bridge_pgc").splitlines()
    assert head.endswith("| torch alone, the same groups (own job) | its ratio | parallelctx ÷ torch alone |")
    assert (
        row == "| 16 | tp 2 pp 4 | lazy | 85.0 ms | 100.0 ms | 0.85 | 0.85 | 7, 7 | 40.0 ms | 0.40 | 2.12 |"
    )
    run.pop("floor")
    assert "torch alone" not in table([run], {}, "bridge_pgc")


@pytest.mark.bench
def test_the_issue_34_benchmarks_run_once_and_print_tables() -> None:
    """many_fds (a hundred descriptors, 3 rounds) and startup_phases (2 ranks, 2 rounds)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for cmd, heading in (
        (
            ["benchmarks.many_fds", "--nproc", "2", "--rounds", "3", "--extra", "100"],
            "| abort(), thread CPU |",
        ),
        (
            ["benchmarks.startup_phases", "--nproc", "2", "--rounds", "2"],
            "| floor ÷ torch alone |",
        ),
    ):
        done = subprocess.run(
            [sys.executable, "-m", *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert heading in done.stdout, done.stdout
