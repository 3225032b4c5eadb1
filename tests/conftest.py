"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from parallelctx.env import is_launcher_variable


@pytest.fixture
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher's variables in this test's environment (so detection sees a plain process),
    and gloo on the loopback interface. Returns the monkeypatch for more changes."""
    for key in list(os.environ):
        if is_launcher_variable(key):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    return monkeypatch


@pytest.fixture
def world_of_one() -> Iterator[Callable[[Any], Any]]:
    """``start(config)`` launches gpc as a world of one in this process; torn down after the test."""
    from parallelctx import gpc, launch

    def start(config: Any = None) -> Any:
        return launch(config)

    try:
        yield start
    finally:
        gpc.destroy()


def _started_ticks(pid: str) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of process ``pid``, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def _orphans_since(start: int) -> list[tuple[int, str]]:
    """Processes of this repository started at or after ``start`` (clock ticks since boot)
    whose parent is gone (reparented to init): (pid, command line)."""
    root = str(Path(__file__).resolve().parent.parent)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        got = _started_ticks(pid)
        if got is None or got[0] != 1 or got[1] < start:
            continue
        try:
            if os.readlink(f"/proc/{pid}/cwd") != root:
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append((int(pid), cmd.strip()))
    return found


@pytest.fixture(autouse=True)
def _no_orphaned_ranks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a multi-process test (slow, faults, launchers), kill the processes it started that
    outlived their launcher (a torchrun killed at a timeout leaves its ranks running): a rank
    stuck in a busy loop would otherwise take a core from every later test. Each is named on
    stderr, so a failure's log shows it."""
    marked = any(request.node.get_closest_marker(m) for m in ("slow", "faults", "launchers"))
    if not marked or not sys.platform.startswith("linux"):
        yield
        return
    start = int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))
    yield
    for pid, cmd in _orphans_since(start):
        print(
            f"\nconftest: killing process {pid} left running by {request.node.nodeid}: {cmd}", file=sys.stderr
        )
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
