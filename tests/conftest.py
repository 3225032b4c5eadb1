"""Fixtures shared by the test modules."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
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


_OWNER = "PARALLELCTX_TEST_OWNER"  # set while a multi-process test runs; its processes inherit it


def _orphans_of(token: str) -> list[tuple[int, str]]:
    """Processes whose parent is gone (reparented to init) and whose environment carries
    ``_OWNER=token``: what one test started and left running. (pid, command line) each."""
    marker = f"{_OWNER}={token}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent != 1 or marker not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            cmd = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split())
        except (OSError, IndexError, ValueError):
            continue
        found.append((int(pid), cmd))
    return found


@pytest.fixture(autouse=True)
def _no_orphaned_ranks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a multi-process test (slow, faults, launchers), kill the processes it started that
    outlived their launcher (a torchrun killed at a timeout leaves its ranks running): a rank
    stuck in a busy loop would otherwise take a core from every later test. Only processes that
    carry this test's own mark in their environment are touched; each is named on the terminal."""
    marked = any(request.node.get_closest_marker(m) for m in ("slow", "faults", "launchers"))
    if not marked or not sys.platform.startswith("linux"):
        yield
        return
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    previous = os.environ.get(_OWNER)
    os.environ[_OWNER] = token
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_OWNER, None)
        else:
            os.environ[_OWNER] = previous
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        for pid, cmd in _orphans_of(token):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            line = f"conftest: killed process {pid} left running by {request.node.nodeid}: {cmd[:200]}"
            if reporter is None or capture is None:
                print(line, file=sys.stderr)
                continue
            with capture.global_and_fixture_disabled():  # on the terminal, past the test's capture
                reporter.write_line(line)
