"""The command line (`python -m parallelctx plan`) and the main demo under real torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_helpers import run_torchrun

from parallelctx import ParallelMode, plan
from parallelctx.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_plan_json_matches_layout(capsys) -> None:
    assert main(["plan", "--world-size", "16", "--tensor", "2", "--pipeline", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    layout = plan(16, tensor=2, pipeline=2)
    assert printed == layout.to_dict()
    assert printed["tensor"][0] == [0, 1]
    assert set(printed) >= {
        "global",
        "tensor",
        "pipeline",
        "data",
        "context",
        "model",
        "data_context",
        "embedding",
        "expert",
        "expert_data",
    }


def test_plan_options(capsys) -> None:
    assert (
        main(
            ["plan", "--world-size", "8", "--tensor", "2", "--pipeline", "2", "--order", "tp-pp-dp", "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (
        main(
            [
                "plan",
                "--world-size",
                "16",
                "--context",
                "2",
                "--expert",
                "4",
                "--expert-tensor",
                "1",
                "--json",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed == plan(16, context=2, expert=4, expert_tensor=1).to_dict()


def test_plan_table(capsys) -> None:
    assert main(["plan", "--world-size", "8", "--tensor", "2", "--pipeline", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor" in out and "[0,1] [2,3] [4,5] [6,7]" in out
    assert "pipeline stage 1" in out


def test_plan_error_exit_code(capsys) -> None:
    assert main(["plan", "--world-size", "8", "--tensor", "3"]) == 2
    assert "tensor=3 x pipeline=1 x context=1 = 3 does not divide world_size=8" in capsys.readouterr().err


def test_module_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "parallelctx", "plan", "--world-size", "4", "--tensor", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(out.stdout)["tensor"] == [[0, 1], [2, 3]]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_under_torchrun() -> None:
    argv = [
        "-m",
        "parallelctx.cli.demo",
        "--config",
        "configs/demo_3d.py",
        "--sizes",
        "4KiB,64KiB",
        "--iters",
        "2",
    ]
    proc = run_torchrun(8, argv, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "parallelctx check: world=8 tp=2 cp=1 dp=2 pp=2" in out and "all checks passed" in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    check_rows = [line for line in rows if "│ ok " in line]
    assert len(check_rows) == len(ParallelMode)  # one row per mode, each proven
    assert "FAILED" not in out and "seeds: ok" in out
    assert "4 KiB (slowest)" in out and "64 KiB (slowest)" in out
    assert "processes on this node: 8, nodes: 1" in out
    assert out.count("parallelctx layout") == 1, "only rank 0 prints"
