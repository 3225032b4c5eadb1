"""A pool of long-lived rank processes, one per rank, that run tests on ``world_size`` ranks.

The controller (the pytest process) starts ``python -m parallelctx.testing.worker`` once per
rank and talks to each over a local socket. Each rank process starts a pytest session like the
controller's and, for every test, forks a child that runs it and exits, so no test sees what
another left behind (:mod:`parallelctx.testing.worker`). Rank 0's child serves the rendezvous
store on a port the OS picks, which the controller passes on to the other ranks: pools never
collide on a port. Each rank's stdout and stderr go to files in the pool's folder, so the
output of one test is what was appended while it ran; SIGUSR1 makes a child dump its Python
stacks (faulthandler) to a third file. A test that hangs costs its children, not the pool; a
pool whose rank process died is killed, never reused.
"""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from ..env import is_launcher_variable

__all__ = ["Pool", "PoolError", "RunOutcome", "pick_devices"]

#: After one rank fails or dies, how long the others get to finish before they count as hung.
FAILURE_GRACE_S = 3.0
#: How long a hung worker gets to write its stacks after SIGUSR1.
STACK_WAIT_S = 2.0


class PoolError(RuntimeError):
    """The pool could not start (a worker exited or did not connect in time), or a worker was
    gone before a test could be sent; the message has the worker's stderr."""


@dataclass
class RunOutcome:
    """What one test did on every rank.

    ``results`` maps a rank to its result dict (see
    :meth:`parallelctx.testing.rank.RankPlugin.result`); ranks missing there are in ``dead``
    (rank to a description of how it ended, ``dead_at`` when, as ``time.time()``) or ``hung``
    (still running at the deadline, then killed). ``stacks`` holds the hung ranks' Python
    stacks, ``stdout``/``stderr`` what each rank wrote outside pytest's capture during the test.
    ``timed_out`` is True when the test's own timeout passed, False when the others were given
    up on after a rank failed, skipped or died. ``broken`` lists ranks whose long-lived process
    is gone or did not answer: the pool must be replaced.
    """

    world_size: int
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)
    dead_at: dict[int, float] = field(default_factory=dict)
    broken: list[int] = field(default_factory=list)
    hung: list[int] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    timed_out: bool = False
    elapsed: float = 0.0

    @property
    def reusable(self) -> bool:
        """True when every rank process is still there and answered: the pool may run the next
        test (each test runs in children of its own, so nothing a test did survives it)."""
        return not self.broken


def pick_devices(world_size: int, devices: str = "auto") -> str:
    """Decide what a pool of ``world_size`` ranks runs on.

    Returns:
        ``"cuda"`` when ``devices`` is ``"auto"`` and this machine has at least ``world_size``
        GPUs (one per rank, nccl), else ``"cpu"`` (gloo; the workers see no GPU).

    Raises:
        ValueError: ``devices`` is not ``"auto"`` or ``"cpu"``.
    """
    if devices not in ("auto", "cpu"):
        raise ValueError(
            f"parallel_devices={devices!r} must be 'auto' (a GPU per rank where there are enough) or 'cpu'"
        )
    if devices == "cpu":
        return "cpu"
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:
        count = 0
    return "cuda" if count >= world_size else "cpu"


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-limit:]


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "was still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Pool:
    """``world_size`` rank processes, started once and reused for test after test; each test runs
    in children they fork (see :mod:`parallelctx.testing.worker`).

    ``session`` is what every rank's pytest session is made from: the controller's command line
    ``args``, its invocation folder ``dir``, its ``sys_path`` and the test ``files`` to collect.

    Raises (from the constructor):
        PoolError: a rank process exited, did not connect, or could not start its pytest session
            within ``start_timeout`` seconds; the message names the rank and shows why.
    """

    def __init__(
        self,
        world_size: int,
        devices: str = "cpu",
        start_timeout: float = 120.0,
        session: dict[str, Any] | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        self.world_size = world_size
        self.devices = devices
        self.dir = Path(tempfile.mkdtemp(prefix=f"parallelctx-pool{world_size}-"))
        self.tests_run = 0
        self.started_s = 0.0
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._conns: dict[int, Connection] = {}
        self.pids: dict[int, int] = {}
        begin = time.perf_counter()
        try:
            self._start(start_timeout, session or {"args": [], "dir": os.getcwd(), "files": []})
        except BaseException:
            self.kill()
            raise
        self.started_s = time.perf_counter() - begin

    def _paths(self, rank: int) -> tuple[Path, Path, Path]:
        return self.dir / f"rank{rank}.out", self.dir / f"rank{rank}.err", self.dir / f"rank{rank}.stacks"

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The environment a rank gets from the controller's ``base``: launcher variables
        dropped, one OpenMP thread unless set, no GPU on a CPU pool (on a GPU pool, CUDA
        availability asked of NVML), and this package importable.

        Returns:
            The environment dict.
        """
        env = {k: v for k, v in base.items() if not is_launcher_variable(k)}
        package_root = str(Path(__file__).resolve().parents[2])
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if package_root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.devices == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        else:  # torch.cuda.is_available() asks NVML, so the rank processes fork without CUDA
            env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        return env

    def _start(self, start_timeout: float, session: dict[str, Any]) -> None:
        token = secrets.token_hex(16)
        env = self.environment(os.environ)
        env["PARALLELCTX_POOL_TOKEN"] = token
        deadline = time.monotonic() + start_timeout
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(self.world_size)
            listener.settimeout(0.2)
            control_port = listener.getsockname()[1]
            for rank in range(self.world_size):
                out, err, stacks = self._paths(rank)
                with open(out, "wb") as fout, open(err, "wb") as ferr:
                    self._procs[rank] = subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "parallelctx.testing.worker",
                            str(rank),
                            str(self.world_size),
                            str(control_port),
                            str(stacks),
                        ],
                        stdout=fout,
                        stderr=ferr,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        start_new_session=True,
                    )
            while len(self._conns) < self.world_size:
                self._check_starting(deadline, start_timeout, set(self._conns))
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    continue
                sock.settimeout(None)
                conn = Connection(sock.detach())
                if not conn.poll(30):
                    conn.close()
                    continue
                hello = conn.recv()
                if not (
                    isinstance(hello, tuple) and len(hello) == 4 and hello[0] == "hello" and hello[1] == token
                ):
                    conn.close()  # not one of ours
                    continue
                _, _, rank, pid = hello
                self._conns[int(rank)] = conn
                self.pids[int(rank)] = int(pid)
        for rank, conn in self._conns.items():
            conn.send(("session", {**session, "basetemp": str(self.dir / f"rank{rank}-tmp")}))
        ready: set[int] = set()
        while len(ready) < self.world_size:
            self._check_starting(deadline, start_timeout, ready)
            for ready_conn in wait(
                [self._conns[r] for r in range(self.world_size) if r not in ready], timeout=0.2
            ):
                rank = next(r for r, c in self._conns.items() if c is ready_conn)
                try:
                    message = self._conns[rank].recv()
                except (EOFError, OSError):
                    continue  # its exit is reported by _check_starting
                if message[0] == "ready":
                    if message[1].get("error"):
                        raise PoolError(
                            f"pool rank {rank} of {self.world_size} could not start its pytest session:\n"
                            f"{message[1]['error']}"
                        )
                    ready.add(rank)

    def _check_starting(self, deadline: float, start_timeout: float, done: set[int]) -> None:
        for rank, proc in self._procs.items():
            if rank not in done and proc.poll() is not None:
                raise PoolError(
                    f"pool worker rank {rank} of {self.world_size} {_describe_exit(proc.returncode)} "
                    f"while starting; its stderr:\n{_tail(self._paths(rank)[1])}"
                )
        if time.monotonic() > deadline:
            missing = sorted(set(range(self.world_size)) - done)
            raise PoolError(
                f"pool workers {missing} of {self.world_size} were not ready within "
                f"{start_timeout} s (raise the ini option parallel_start_timeout on a slow machine)"
            )

    def alive(self) -> bool:
        """Return True when every rank process is still running."""
        return bool(self._procs) and all(p.poll() is None for p in self._procs.values())

    def run(self, spec: dict[str, Any], timeout: float) -> RunOutcome:
        """Run one test: every rank forks a child for it; collect the answers.

        Waits at most ``timeout`` seconds for all ranks; once a rank has failed, skipped or died
        the others get :data:`FAILURE_GRACE_S` more. Ranks still running then are hung: their
        stacks are dumped and collected, and their children killed. The rank processes
        themselves are untouched by the test, so the pool stays usable unless one of them is
        gone (:attr:`RunOutcome.reusable`; the caller must :meth:`kill` the pool otherwise).

        Returns:
            The :class:`RunOutcome`.

        Raises:
            PoolError: a rank process was already gone before the test was sent (nothing ran).
        """
        outcome = RunOutcome(self.world_size)
        if not self.alive():
            gone = {r: _describe_exit(p.returncode) for r, p in self._procs.items() if p.poll() is not None}
            raise PoolError(f"pool workers are gone before the test: {gone}")
        offsets = {
            r: (self._paths(r)[0].stat().st_size, self._paths(r)[1].stat().st_size)
            for r in range(self.world_size)
        }
        begin = time.monotonic()
        for rank, conn in self._conns.items():
            try:
                conn.send(("run", spec))
            except OSError as exc:
                raise PoolError(f"pool worker rank {rank} is gone before the test: {exc}") from None
        self.tests_run += 1
        deadline = begin + timeout
        given_up_at: float | None = None
        children: dict[int, int] = {}
        running = set(range(self.world_size))  # children not yet reported exited
        broken: set[int] = set()

        def pending() -> set[int]:
            return {r for r in running - broken if r not in outcome.results}

        while pending():
            now = time.monotonic()
            if now > deadline:
                outcome.timed_out = True
                break
            if given_up_at is not None and now > given_up_at:
                break
            for ready_conn in wait([self._conns[r] for r in running - broken], timeout=0.1):
                rank = next(r for r, c in self._conns.items() if c is ready_conn)
                try:
                    message = self._conns[rank].recv()
                except (EOFError, OSError, pickle.UnpicklingError):
                    broken.add(rank)
                    outcome.dead[rank] = _describe_exit(self._procs[rank].poll())
                    outcome.dead_at[rank] = time.time()
                    continue
                kind = message[0]
                if kind == "started":
                    children[rank] = int(message[1])
                elif kind == "port":
                    for other in range(1, self.world_size):
                        if other in running and other not in broken:
                            try:
                                self._conns[other].send(("port", message[1]))
                            except OSError:
                                broken.add(other)
                elif kind == "result":
                    outcome.results[rank] = message[1]
                    if message[1]["outcome"] != "passed" and given_up_at is None:
                        given_up_at = time.monotonic() + FAILURE_GRACE_S
                elif kind == "exited":
                    running.discard(rank)
                    if rank not in outcome.results:
                        outcome.dead[rank] = message[1]
                        outcome.dead_at[rank] = float(message[2])
                        if given_up_at is None:
                            given_up_at = time.monotonic() + FAILURE_GRACE_S
            for rank in running - broken:
                if self._procs[rank].poll() is not None:
                    broken.add(rank)
                    outcome.dead[rank] = _describe_exit(self._procs[rank].returncode)
                    outcome.dead_at[rank] = time.time()
        outcome.hung = sorted(pending())
        if outcome.hung:
            outcome.stacks = self._dump_stacks({r: children.get(r) for r in outcome.hung})
        for rank in sorted(running - broken):
            if rank in outcome.hung:
                if rank in children:
                    try:
                        os.kill(children[rank], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            else:
                try:  # a child that answered waits for this before it exits (see worker.py)
                    self._conns[rank].send(("release",))
                except OSError:
                    broken.add(rank)
        self._reap(running - broken, broken)
        outcome.broken = sorted(broken)
        outcome.elapsed = time.monotonic() - begin
        for rank, (out_at, err_at) in offsets.items():
            out, err, _ = self._paths(rank)
            outcome.stdout[rank] = _read_from(out, out_at)
            outcome.stderr[rank] = _read_from(err, err_at)
        return outcome

    def _reap(self, running: set[int], broken: set[int]) -> None:
        """Wait for the rank processes in ``running`` to report their (killed) child exited;
        a rank that does not within a few seconds joins ``broken``."""
        deadline = time.monotonic() + 10.0
        pending = set(running)
        while pending and time.monotonic() < deadline:
            for ready_conn in wait([self._conns[r] for r in pending], timeout=0.2):
                rank = next(r for r, c in self._conns.items() if c is ready_conn)
                try:
                    message = self._conns[rank].recv()
                except (EOFError, OSError, pickle.UnpicklingError):
                    broken.add(rank)
                    pending.discard(rank)
                    continue
                if message[0] == "exited":
                    pending.discard(rank)
            for rank in list(pending):
                if self._procs[rank].poll() is not None:
                    broken.add(rank)
                    pending.discard(rank)
        broken.update(pending)

    def _dump_stacks(self, ranks: dict[int, int | None]) -> dict[int, str]:
        """SIGUSR1 to the child of each rank in ``ranks`` (rank to child pid; the rank process
        itself when the child is unknown); return what faulthandler wrote for each."""
        paths = {r: self._paths(r)[2] for r in ranks}
        before = {r: p.stat().st_size if p.exists() else 0 for r, p in paths.items()}
        for rank, pid in ranks.items():
            try:
                os.kill(pid if pid is not None else self._procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STACK_WAIT_S
        sizes: dict[int, int] = {}
        while time.monotonic() < deadline:
            now = {r: p.stat().st_size if p.exists() else 0 for r, p in paths.items()}
            if all(now[r] > before[r] for r in ranks) and now == sizes:
                break  # every rank wrote, and nothing changed since the last look
            sizes = now
            time.sleep(0.1)
        return {r: _read_from(paths[r], before[r]) or "(no stack written)" for r in ranks}

    def kill(self) -> None:
        """Kill every rank process and its children now and remove the pool's folder. Safe to
        call twice."""
        for proc in self._procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        """Ask every rank process to exit, wait briefly, then kill what is left (see :meth:`kill`)."""
        for conn in self._conns.values():
            try:
                conn.send(("exit",))
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
