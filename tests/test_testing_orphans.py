"""A pool's rank processes end on their own when their controller (the pytest process) is gone:
killed while the pool starts or while a test runs, or gone while another process (one it forked)
still holds its end of a rank's connection, so that no EOF tells the rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow  # nested pytest sessions and rank processes killed on purpose

#: How long a rank process may outlive its controller (it looks once a second).
GRACE_S = 10.0


def _ranks_under(folder: Path) -> list[int]:
    """Pool rank processes (zygotes and session processes) whose command line names a file
    under ``folder`` (their STACK_FILE lies in the pool's folder, under the controller's TMPDIR)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if "parallelctx.testing.worker" in cmd and str(folder) in cmd and state != "Z":
            found.append(int(pid))
    return found


def _gone_within(pids: Callable[[], list[int]], grace: float) -> list[int]:
    """Wait up to ``grace`` seconds for ``pids()`` to be empty; kill what is left and return it."""
    deadline = time.monotonic() + grace
    while (left := pids()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("moment", ["pool starting", "test running"])
def test_no_rank_outlives_a_killed_pytest(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, moment: str
) -> None:
    temp = pytester.path / "temp"
    temp.mkdir()
    pytester.makepyfile(
        test_sleeps="""
        import time
        from pathlib import Path
        import pytest
        from parallelctx import gpc

        @pytest.mark.parallel(world_size=2, timeout=120)
        def test_sleeps():
            Path(f"started-{gpc.get_global_rank()}").write_text("")
            time.sleep(120)
        """
    )
    monkeypatch.setenv("TMPDIR", str(temp))  # the pools' folders, named in their ranks' command lines
    proc = pytester.popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_sleeps.py"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if moment == "pool starting" and _ranks_under(temp):
                break
            if moment == "test running" and len(list(pytester.path.glob("started-*"))) == 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"pytest ended before the {moment}"
        assert _ranks_under(temp), f"no rank process at the {moment}"
        os.killpg(proc.pid, signal.SIGTERM)  # what a user or a CI job does: SIGTERM, then SIGKILL
        time.sleep(0.5)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    finally:
        _kill(proc.pid)
    left = _gone_within(lambda: _ranks_under(temp), GRACE_S)
    assert not left, f"rank processes {left} outlived their killed pytest ({moment}) by {GRACE_S} s"


# A stand-in controller: it starts one rank as the pool does and dies (WHEN) before that rank ran
# a line, or after its hello but before the session, while a process it forked (any fork of
# pytest: a multiprocessing worker, a conftest's os.fork) keeps the listener and the connection
# open, so the rank sees no EOF. It writes the rank's pid and the fork's to PIDS_FILE.
_CONTROLLER = textwrap.dedent(
    """
    import os, socket, subprocess, sys, time
    from multiprocessing.connection import Connection

    when, stacks, pids = sys.argv[1:4]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    env = {**os.environ, "PARALLELCTX_POOL_TOKEN": "token", "PARALLELCTX_POOL_CONTROLLER": str(os.getpid())}
    holder = os.fork() if when == "before its start" else None
    if holder == 0:
        time.sleep(120)
        os._exit(0)
    rank = subprocess.Popen(
        [sys.executable, "-m", "parallelctx.testing.worker", "0", "1", str(listener.getsockname()[1]), stacks],
        env=env, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    if when == "before its session":
        sock, _ = listener.accept()
        conn = Connection(sock.detach())
        assert conn.recv()[0] == "hello"
        holder = os.fork()
        if holder == 0:
            time.sleep(120)
            os._exit(0)
    with open(pids, "w") as f:
        f.write(f"{rank.pid} {holder}")
    os._exit(0)  # gone at once: no cleanup, as after SIGKILL
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("when", ["before its start", "before its session"])
def test_a_rank_ends_when_its_controller_dies_though_a_fork_holds_the_connection(
    tmp_path: Path, when: str
) -> None:
    pids, err = tmp_path / "pids", tmp_path / "controller.err"
    with open(err, "w") as stderr:  # no pipe: the fork would hold it
        code = subprocess.call(
            [sys.executable, "-c", _CONTROLLER, when, str(tmp_path / "rank0.stacks"), str(pids)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            timeout=60,
        )
    assert code == 0, err.read_text()
    rank, holder = (int(x) for x in pids.read_text().split())
    try:

        def alive() -> list[int]:
            try:
                state = Path(f"/proc/{rank}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return []
            return [] if state == "Z" else [rank]

        left = _gone_within(alive, 30 + GRACE_S)  # it imports torch and pytest before it connects
    finally:
        _kill(holder)
    assert not left, f"the rank process outlived its controller, which died {when}"
