"""One rank of a test pool: ``python -m parallelctx.testing.worker RANK WORLD CONTROL_PORT STACK_FILE``.

The process (the rank's *zygote*) connects back to the controller (the pytest process) on
127.0.0.1:CONTROL_PORT, proves itself with the token in PARALLELCTX_POOL_TOKEN and imports
torch, pytest and parallelctx. It never runs user code: no conftest, no test module, no
fixture, no torch op, so it has one thread, no OpenMP pool and no CUDA, and forking it is safe.
Every wait of the zygote, from its start, looks once a second whether its parent is still the
controller (whose pid is in PARALLELCTX_POOL_CONTROLLER) and ends the zygote when it is not: the
connection alone would not tell while a process the controller forked holds its end.

For each ``("fork",)`` it forks a *session child* that does all the user-facing work of the
rank (:mod:`parallelctx.testing.rank`): starts coverage when the controller measures it,
starts a pytest session like the controller's (conftests, plugins), collects the files that
hold parallel tests, and then runs test after test in this one process, as a pytest-xdist
worker does: session- and module-scoped fixtures are set up once, threads that a conftest
started keep running, torch's thread pools stay valid. The child lives until the controller
ends it (``("end",)``: fixtures torn down, coverage saved) or until a test on any rank did not
pass (it then ends itself after answering, so that its peers' collectives end too); the
zygote then says how it ended and waits for the next ``("fork",)``. SIGUSR1 dumps the Python
stacks of every thread to STACK_FILE (faulthandler, inherited by the child).

Messages on the control connection (the session child writes on the zygote's connection while
the zygote waits): controller -> zygote ``("fork",)``, ``("exit",)``; session child ->
controller ``("ready", info)``; controller -> session child ``("run", spec)``, ``("end",)``
(``("end", {"abort": True})`` after a test that left a process group unbalanced: ``gpc`` is
aborted before the teardown);
session child -> controller ``("result", dict)``; zygote -> controller ``("exited", how, time)``.
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import socket
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["main", "thread_count"]

#: How often a waiting process checks that the controller is still there.
_WATCH_S = 1.0


def thread_count() -> int:
    """Return the number of threads of this process (native ones too, from /proc; 1 where
    /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"was killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"was killed by signal {sig}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def _wait_child(pid: int, controller: int) -> int:
    """Wait for the child ``pid``; kill it and exit when the controller is gone.

    Returns:
        The child's wait status.
    """
    fd = os.pidfd_open(pid)
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], _WATCH_S)
            if ready:
                return os.waitpid(pid, 0)[1]
            if os.getppid() != controller:
                os.kill(pid, signal.SIGKILL)
                os._exit(3)
    finally:
        os.close(fd)


def _await(conn: Connection, controller: int) -> bool:
    """Wait until ``conn`` has a message (or is closed).

    Returns:
        True when it has; False once this process's parent is no longer ``controller``.
    """
    while not conn.poll(_WATCH_S):
        if os.getppid() != controller:
            return False
    return True


def _serve(conn: Connection, rank: int, world_size: int, setup: dict[str, Any], controller: int) -> int:
    from .rank import run_session

    warning = ""
    threads = thread_count()
    if threads > 1:  # nothing here should start one; say so once rather than hang a child
        warning = (
            f"pool rank {rank}'s zygote has {threads} threads before it forks its session process "
            "(something imported at start-up started them); the session process may hang in a lock "
            "such a thread held"
        )
    while True:
        if not _await(conn, controller):
            return 1
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 1
        if message[0] == "exit":
            return 0
        if message[0] != "fork":
            continue  # meant for a session process that has already ended
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                run_session(conn, rank, world_size, setup, controller, warning)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)  # coverage was saved by run_session; no zygote atexit here
        status = _wait_child(pid, controller)
        conn.send(("exited", _describe_status(status), time.time()))


def main(argv: list[str] | None = None) -> int:
    """Serve the controller until it says exit or goes away.

    Returns:
        The process exit code (0 after ``exit``, 1 when the controller went away).

    Raises:
        ValueError: bad command-line arguments (the usage is in the module docstring).
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        raise ValueError(
            f"usage: python -m parallelctx.testing.worker RANK WORLD CONTROL_PORT STACK_FILE, got {args}"
        )
    rank, world_size, control_port = int(args[0]), int(args[1]), int(args[2])
    stacks = open(args[3], "w")  # noqa: SIM115 - kept open for faulthandler for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    controller = int(os.environ.get("PARALLELCTX_POOL_CONTROLLER") or os.getppid())
    if os.getppid() != controller:  # it died before this process started
        return 1

    import pytest  # noqa: F401 - warm imports before the first session
    import torch.distributed  # noqa: F401

    import parallelctx  # noqa: F401

    from . import rank as _rank  # noqa: F401

    sock = socket.create_connection(("127.0.0.1", control_port), timeout=60)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send(("hello", os.environ.get("PARALLELCTX_POOL_TOKEN", ""), rank, os.getpid()))
    if not _await(conn, controller):
        return 1
    try:
        message = conn.recv()
    except (EOFError, OSError):
        return 1
    if message[0] != "session":
        return 1
    return _serve(conn, rank, world_size, message[1], controller)


if __name__ == "__main__":
    sys.exit(main())
