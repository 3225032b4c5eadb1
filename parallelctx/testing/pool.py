"""A pool of long-lived worker processes, one per rank, that run tests on ``world_size`` ranks.

The controller (the pytest process) starts ``python -m parallelctx.testing.worker`` once per
rank, talks to each over a local socket, and waits for every answer with a deadline. Each
worker's stdout and stderr go to files in the pool's folder, so the output of one test is what
was appended while it ran; SIGUSR1 makes a worker dump its Python stacks (faulthandler) to a
third file. A pool whose worker died, hung or failed to tear down is killed, never reused.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
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

    ``results`` maps a rank to the worker's result dict (see
    :func:`parallelctx.testing.worker.run_test`); ranks missing there are in ``dead`` (rank to
    a description of how it ended) or ``hung`` (still running at the deadline). ``stacks`` holds
    the hung ranks' Python stacks, ``stdout``/``stderr`` what each rank printed during the test.
    ``timed_out`` is True when the test's own timeout passed, False when the others were given
    up on after a rank failed or died.
    """

    world_size: int
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    timed_out: bool = False
    elapsed: float = 0.0

    @property
    def reusable(self) -> bool:
        """True when every rank answered and tore gpc down cleanly: the pool may run the next test."""
        return (
            not self.dead
            and not self.hung
            and len(self.results) == self.world_size
            and all(r["clean"] for r in self.results.values())
        )


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    """``world_size`` worker processes, started once and reused for test after test.

    Raises (from the constructor):
        PoolError: a worker exited or did not connect within ``start_timeout`` seconds; the
            message names the rank and shows the end of its stderr.
    """

    def __init__(self, world_size: int, devices: str = "cpu", start_timeout: float = 120.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        self.world_size = world_size
        self.devices = devices
        self.dir = Path(tempfile.mkdtemp(prefix=f"parallelctx-pool{world_size}-"))
        self.port = _free_port()  # rank 0's rendezvous store lives here for the pool's life
        self.tests_run = 0
        self.started_s = 0.0
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._conns: dict[int, Connection] = {}
        self.pids: dict[int, int] = {}
        begin = time.perf_counter()
        try:
            self._start(start_timeout)
        except BaseException:
            self.kill()
            raise
        self.started_s = time.perf_counter() - begin

    def _paths(self, rank: int) -> tuple[Path, Path, Path]:
        return self.dir / f"rank{rank}.out", self.dir / f"rank{rank}.err", self.dir / f"rank{rank}.stacks"

    def _start(self, start_timeout: float) -> None:
        token = secrets.token_hex(16)
        env = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
        env["PARALLELCTX_POOL_TOKEN"] = token
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.devices == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
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
            deadline = time.monotonic() + start_timeout
            while len(self._conns) < self.world_size:
                for rank, proc in self._procs.items():
                    if rank not in self._conns and proc.poll() is not None:
                        raise PoolError(
                            f"pool worker rank {rank} of {self.world_size} {_describe_exit(proc.returncode)} "
                            f"while starting; its stderr:\n{_tail(self._paths(rank)[1])}"
                        )
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.world_size)) - set(self._conns))
                    raise PoolError(
                        f"pool workers {missing} of {self.world_size} did not connect within "
                        f"{start_timeout} s (raise the ini option parallel_start_timeout on a slow machine)"
                    )
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

    def alive(self) -> bool:
        """Return True when every worker process is still running."""
        return bool(self._procs) and all(p.poll() is None for p in self._procs.values())

    def run(self, spec: dict[str, Any], timeout: float) -> RunOutcome:
        """Send one test to every rank and collect the answers.

        Waits at most ``timeout`` seconds for all ranks; once a rank has failed or died the others
        get :data:`FAILURE_GRACE_S` more. Ranks still running then are hung: their stacks are
        dumped and collected. The caller must :meth:`kill` the pool when the outcome is not
        :attr:`RunOutcome.reusable`.

        Returns:
            The :class:`RunOutcome`.

        Raises:
            PoolError: a worker was already gone before the test was sent (nothing ran).
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
            except OSError:
                outcome.dead[rank] = _describe_exit(self._procs[rank].poll())
        self.tests_run += 1
        deadline = begin + timeout
        given_up_at: float | None = None
        pending = {r for r in range(self.world_size) if r not in outcome.dead}
        if outcome.dead:
            given_up_at = time.monotonic() + FAILURE_GRACE_S
        while pending:
            now = time.monotonic()
            if now > deadline:
                outcome.timed_out = True
                break
            if given_up_at is not None and now > given_up_at:
                break
            ready = wait([self._conns[r] for r in pending], timeout=0.1)
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn in ready:
                    try:
                        _, result = conn.recv()
                    except (EOFError, OSError):
                        try:
                            self._procs[rank].wait(timeout=5)
                        except subprocess.TimeoutExpired:
                            pass
                        outcome.dead[rank] = _describe_exit(self._procs[rank].poll())
                    else:
                        outcome.results[rank] = result
                        if result["outcome"] == "failed" and given_up_at is None:
                            given_up_at = time.monotonic() + FAILURE_GRACE_S
                    pending.discard(rank)
                elif self._procs[rank].poll() is not None:
                    outcome.dead[rank] = _describe_exit(self._procs[rank].returncode)
                    pending.discard(rank)
                if rank in outcome.dead and given_up_at is None:
                    given_up_at = time.monotonic() + FAILURE_GRACE_S
        outcome.hung = sorted(pending)
        if outcome.hung:
            outcome.stacks = self._dump_stacks(outcome.hung)
        outcome.elapsed = time.monotonic() - begin
        for rank, (out_at, err_at) in offsets.items():
            out, err, _ = self._paths(rank)
            outcome.stdout[rank] = _read_from(out, out_at)
            outcome.stderr[rank] = _read_from(err, err_at)
        return outcome

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """SIGUSR1 to each of ``ranks``; return what faulthandler wrote for each."""
        before = {r: self._paths(r)[2].stat().st_size if self._paths(r)[2].exists() else 0 for r in ranks}
        for rank in ranks:
            try:
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STACK_WAIT_S
        sizes: dict[int, int] = {}
        while time.monotonic() < deadline:
            now = {r: self._paths(r)[2].stat().st_size if self._paths(r)[2].exists() else 0 for r in ranks}
            if all(now[r] > before[r] for r in ranks) and now == sizes:
                break  # every rank wrote, and nothing changed since the last look
            sizes = now
            time.sleep(0.1)
        return {r: _read_from(self._paths(r)[2], before[r]) or "(no stack written)" for r in ranks}

    def kill(self) -> None:
        """Kill every worker now and remove the pool's folder. Safe to call twice."""
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
        """Ask every worker to exit, wait briefly, then kill what is left (see :meth:`kill`)."""
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
