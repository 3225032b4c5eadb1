"""One rank of a test pool: ``python -m parallelctx.testing.worker RANK WORLD CONTROL_PORT STACK_FILE``.

The process connects back to the controller (the pytest process) on 127.0.0.1:CONTROL_PORT and
proves itself with the token in PARALLELCTX_POOL_TOKEN. The controller first sends
``("session", spec)``: the process starts a pytest session like the controller's
(:func:`parallelctx.testing.rank.start_session`) and collects the files that hold parallel
tests, with torch and every test module imported but nothing initialised: no process group, no
CUDA, no test run. For each ``("run", spec)`` it forks a child that runs the one test and exits,
so every test starts from the same pristine process state whatever ran before; the parent only
waits for the child and says how it ended. SIGUSR1 dumps the Python stacks of every thread to
STACK_FILE (faulthandler, inherited by the children), which the controller reads when a test
hangs.

Messages on the control connection (the child writes on the parent's connection while the
parent waits): child -> controller ``("started", pid)``, rank 0's child ``("port", port)``,
controller -> children of other ranks ``("port", port)``, child ``("result", dict)``,
controller -> children that passed ``("release",)`` once every rank answered, parent
``("exited", how, time)``.
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

__all__ = ["main"]

#: How often the parent checks that the controller is still there while it waits.
_WATCH_S = 1.0


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"was killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"was killed by signal {sig}"
    return f"exited with code {os.waitstatus_to_exitcode(status)}"


def _apply_environment(spec: dict[str, Any]) -> None:
    """This process's environment becomes the controller's at the test's call (plus the pool's
    own settings); its folder and import path become the controller's."""
    os.environ.clear()
    os.environ.update(spec["env"])
    for entry in reversed(spec["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if os.getcwd() != spec["cwd"]:
        os.chdir(spec["cwd"])


def _run_child(conn: Connection, spec: dict[str, Any], rank: int, world_size: int, state: Any) -> None:
    """In the forked child: meet rank 0's store port, run the test's pytest protocol, answer."""
    from .rank import serve_store

    session, items, plugin = state
    conn.send(("started", os.getpid()))
    _apply_environment(spec)
    store = None
    if rank == 0:
        store = serve_store(world_size, spec["timeout"] + 60.0)
        port = int(store.port)
        conn.send(("port", port))
    else:
        if not conn.poll(spec["timeout"]):
            raise TimeoutError(f"rank {rank}: no rendezvous port from rank 0 within {spec['timeout']} s")
        message = conn.recv()
        port = int(message[1])
    plugin.begin(spec, port)
    item = items.get(spec["nodeid"])
    if item is None:
        errors = "\n".join(plugin.collect_errors) or "no collection error was reported"
        result = {
            "rank": rank,
            "outcome": "failed",
            "phase": "setup",
            "message": f"rank {rank} could not collect {spec['nodeid']}",
            "longrepr": f"rank {rank} could not collect {spec['nodeid']}:\n{errors}",
            "exc_type": None,
            "time": time.time(),
            "peer_loss": False,
            "sections": [],
        }
    else:
        capman = session.config.pluginmanager.get_plugin("capturemanager")
        if capman is not None and capman.is_globally_capturing():
            capman.resume_global_capture()
            capman.read_global_capture()  # drop what a killed child left in the capture files
            capman.suspend_global_capture(in_=False)
        item.ihook.pytest_runtest_protocol(item=item, nextitem=None)
        result = plugin.result()
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(("result", result))
    # A rank that passed stays (with rank 0's store and its connections) until every rank has
    # answered: it must not pull the store or a connection from under a slower one. A rank that
    # failed or skipped leaves at once, so that its peers' collectives end.
    if result["outcome"] == "passed" and conn.poll(spec["timeout"] + 10.0):
        conn.recv()
    del store


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


def _forget_gpc() -> None:
    """A conftest may launch ``gpc`` when the session starts (a world of one, say): destroy it
    here, so that this process stays without a process group and each test's child launches
    its own."""
    from ..context import ParallelMode, gpc

    if gpc.is_initialized(ParallelMode.GLOBAL):
        gpc.destroy()


def _serve(conn: Connection, rank: int, world_size: int, state: Any, controller: int) -> int:
    while True:
        while not conn.poll(_WATCH_S):
            if os.getppid() != controller:
                return 1
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 1
        if message[0] == "exit":
            return 0
        if message[0] != "run":
            continue  # a port or release meant for a child that has already ended
        spec = message[1]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _run_child(conn, spec, rank, world_size, state)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
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
    controller = os.getppid()

    import pytest  # noqa: F401 - warm imports before the first test
    import torch.distributed  # noqa: F401

    import parallelctx  # noqa: F401

    from .rank import RankPlugin, collect, start_session

    sock = socket.create_connection(("127.0.0.1", control_port), timeout=60)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send(("hello", os.environ.get("PARALLELCTX_POOL_TOKEN", ""), rank, os.getpid()))
    try:
        message = conn.recv()
    except (EOFError, OSError):
        return 1
    if message[0] != "session":
        return 1
    setup = message[1]
    for entry in reversed(setup["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    plugin = RankPlugin(rank, world_size)
    try:
        session = start_session(setup["args"], setup["dir"], setup["basetemp"], plugin)
        items = collect(session, setup["files"], plugin)
        _forget_gpc()
    except BaseException:
        conn.send(("ready", {"error": traceback.format_exc()}))
        return 1
    conn.send(("ready", {"error": "", "collected": len(items)}))
    return _serve(conn, rank, world_size, (session, items, plugin), controller)


if __name__ == "__main__":
    sys.exit(main())
