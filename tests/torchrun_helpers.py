"""Running a script under real torchrun from a test: the path users take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run_torchrun(nproc: int, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --standalone --nproc-per-node NPROC ARGV...`` in the repository root.

    Returns:
        The finished process (output captured as text; the exit code is the caller's to check).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds.
    """
    return run_torchrun_env(nproc, argv, {}, timeout)


def run_torchrun_env(
    nproc: int, argv: list[str], env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """:func:`run_torchrun` with ``env`` added to the environment."""
    return subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **env),
        check=False,
    )


def relaunch_rows(out: Path, nproc: int, cycles: int, *extra: str, timeout: float) -> list[dict[str, Any]]:
    """Run tests/torchrun_relaunch.py under torchrun; return every rank's record, rank order.

    Raises:
        AssertionError: torchrun failed, or a rank wrote no record (the output is in the message).
    """
    proc = run_torchrun(nproc, ["tests/torchrun_relaunch.py", str(out), str(cycles), *extra], timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = sorted((json.loads(p.read_text()) for p in out.glob("rank-*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == list(range(nproc)), proc.stdout[-3000:]
    return rows


def hang_report_row(report: Any, entered: float) -> dict[str, Any]:
    """A :class:`parallelctx.HangReport` as a JSON-ready dict for a scenario's output: its
    fields (modes by name), its text, and the seconds from ``entered`` (a ``time.monotonic()``
    taken as the rank entered the call) to now."""
    import dataclasses
    import time

    fields = dataclasses.asdict(report)
    fields.pop("aborter", None)
    fields["mode"] = report.mode.value
    fields["modes"] = [m.value for m in report.modes]
    fields["text"] = str(report)
    fields["after_entry_s"] = time.monotonic() - entered
    return fields
