"""A pool of long-lived rank processes, one per rank, that run tests on ``world_size`` ranks.

The controller (the pytest process) starts ``python -m parallelctx.testing.worker`` once per
rank (the rank's zygote, which never runs user code) and talks to each over a local socket.
Each zygote forks a session process that starts a pytest session like the controller's,
collects, and runs test after test, keeping session- and module-scoped fixtures, as a
pytest-xdist worker does (:mod:`parallelctx.testing.worker`, :mod:`parallelctx.testing.rank`);
the ranks' collections are compared before the first test. After a test that hung or whose
session process died on some rank, all the session processes end and the next test gets new
ones. Rank 0's session
process serves the rendezvous store on a port the OS picks, which the controller passes on to
the other ranks: pools never collide on a port. Each rank's stdout and stderr go to files in
the pool's folder, so the output of one test is what was appended while it ran; SIGUSR1 makes
a session process dump its Python stacks (faulthandler) to a third file. A test that hangs
costs its session processes, not the pool; a pool whose zygote died is killed, never reused.
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
from .balance import unbalanced

__all__ = ["Pool", "PoolError", "RunOutcome", "pick_devices"]

#: After one rank fails or dies, how long the others get to finish before they count as hung.
FAILURE_GRACE_S = 3.0
#: How long a hung worker gets to write its stacks after SIGUSR1.
STACK_WAIT_S = 2.0
#: How long a rank's session process gets to tear its fixtures down and save its coverage.
END_WAIT_S = 30.0


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
    is gone or did not answer: the pool must be replaced. ``unbalanced`` holds one sentence per
    process group the test left unbalanced although every rank passed (a call some members
    made that the others did not match: :func:`parallelctx.testing.balance.unbalanced`); the
    session processes were then ended, their groups aborted first.
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
    unbalanced: list[str] = field(default_factory=list)

    @property
    def reusable(self) -> bool:
        """True when every rank's zygote is still there and answered: the pool may run the next
        test (on new session processes when this one did not pass on every rank)."""
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
    """``world_size`` rank processes, started once and reused for test after test; tests run in
    the session processes they fork (see :mod:`parallelctx.testing.worker`).

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
        self.start_timeout = start_timeout
        #: Rank 0's rendezvous store port, and each rank's session process, while one is open.
        self.port = 0
        self.session_pids: dict[int, int] = {}
        #: Each rank's collected ``[(node id, parameters)]``, from its session's start.
        self.collected: dict[int, list[tuple[str, str]]] = {}
        #: How many times the ranks' session processes were started (1 + one per replacement).
        self.sessions_started = 0
        #: A zygote's warning that forking it may be unsafe (empty when it is not).
        self.warning = ""
        #: Whether the next test must launch gpc anew (the last one did not pass everywhere).
        self.relaunch = False
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
        dropped, PYTHONHASHSEED fixed (the controller's number, else 0, also for ``random``),
        one OpenMP thread that sleeps when idle
        unless set, no GPU on a CPU pool (on a GPU pool, CUDA
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
        # every rank iterates sets and dicts of str alike, so test code (and parametrize values
        # that cannot be sent from the controller) agree; "random" would give each rank its own
        seed = base.get("PYTHONHASHSEED", "").strip()
        env["PYTHONHASHSEED"] = seed if seed and seed != "random" else "0"
        env.setdefault("OMP_NUM_THREADS", "1")
        # N ranks share the cores: OpenMP threads that spin after each parallel region (libgomp's
        # default) steal them from the peers (a conftest's set_num_threads(2) made tests 2-4x slower)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
        env["PARALLELCTX_POOL_CONTROLLER"] = str(os.getpid())  # a rank ends once it is not its parent
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
        self.open_session()

    def collection_problem(self, nodeid: str, compare_params: bool = True) -> str:
        """Whether the ranks collected ``nodeid`` differently (with other parameter values, or
        only some of them): a problem of that test alone, so the others still run. With
        ``compare_params`` False (every parameter value of the test is sent from the controller,
        which the ranks take: :func:`~parallelctx.testing.rank.take_params`) only whether each
        rank collected the test counts.

        Returns:
            The message that names each rank's version and the first difference between the
            ranks' collections, or "" when every rank collected the test alike (or none did
            while the ranks' collections agree: the rank then reports its collection errors).
        """
        found = {r: dict(items).get(nodeid) for r, items in sorted(self.collected.items())}
        collected = self.collected
        if not compare_params:
            found = {r: None if v is None else "" for r, v in found.items()}
            collected = {r: [(n, "") for n, _ in items] for r, items in self.collected.items()}
        try:
            check_same_collection(collected)
            first = ""
        except PoolError as exc:
            first = f" ({exc})"
        if set(found.values()) == {None} and first:  # its id holds a per-process value
            return f"no rank collected {nodeid}{first}"
        if len(set(found.values())) <= 1:
            return ""
        versions = ", ".join(
            f"rank {r} did not collect it"
            if v is None
            else f"rank {r} with {v}"
            if v
            else f"rank {r} collected it"
            for r, v in found.items()
        )
        return f"the ranks collected {nodeid} differently: {versions}{first}"

    def open_session(self) -> None:
        """Have every rank's zygote fork its session process and wait until each has started its
        pytest session and collected; keep what each collected (:meth:`collection_problem`
        checks a test against it before it runs). Returns None.

        Raises:
            PoolError: a session process ended or failed while starting or did not answer
                within the start timeout; the caller must :meth:`kill` the pool.
        """
        deadline = time.monotonic() + self.start_timeout
        for conn in self._conns.values():
            conn.send(("fork",))
        infos: dict[int, dict[str, Any]] = {}
        while len(infos) < self.world_size:
            self._check_starting(deadline, self.start_timeout, set(infos))
            for ready_conn in wait(
                [self._conns[r] for r in range(self.world_size) if r not in infos], timeout=0.2
            ):
                rank = next(r for r, c in self._conns.items() if c is ready_conn)
                try:
                    message = self._conns[rank].recv()
                except (EOFError, OSError):
                    continue  # its exit is reported by _check_starting
                if message[0] == "exited":
                    raise PoolError(
                        f"pool rank {rank} of {self.world_size}'s session process {message[1]} while starting; "
                        f"its stderr:\n{_tail(self._paths(rank)[1])}"
                    )
                if message[0] == "ready":
                    if message[1].get("error"):
                        raise PoolError(
                            f"pool rank {rank} of {self.world_size} could not start its pytest session:\n"
                            f"{message[1]['error']}"
                        )
                    infos[rank] = message[1]
        self.collected = {r: [(str(a), str(b)) for a, b in info["items"]] for r, info in infos.items()}
        self.port = int(infos[0]["port"])
        self.session_pids = {r: int(info["pid"]) for r, info in infos.items()}
        self.warning = next((info["warning"] for info in infos.values() if info.get("warning")), "")
        self.sessions_started += 1

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
        """Run one test on every rank's session process (opening them first if none is open);
        collect the answers.

        Waits at most ``timeout`` seconds for all ranks; once a rank has failed, skipped or died
        the others get :data:`FAILURE_GRACE_S` more. Ranks still running then are hung: their
        stacks are dumped and collected, and their session processes killed. When every rank
        answered (passed, failed or skipped), the session processes stay for the next test,
        with their fixtures (after a failure or a skip the next test launches ``gpc`` anew),
        unless every rank passed but the ranks' calls on some process group do not match
        (:attr:`RunOutcome.unbalanced`): they then end, their groups aborted first;
        when a rank hung or its session process died they all end (the others tear their
        fixtures down) and the next test gets new ones, forked from the zygotes: the pool stays
        usable unless a zygote is gone
        (:attr:`RunOutcome.reusable`; the caller must :meth:`kill` the pool otherwise).

        Returns:
            The :class:`RunOutcome`.

        Raises:
            PoolError: a rank process was gone before the test was sent, or new session
                processes could not start (nothing ran).
        """
        outcome = RunOutcome(self.world_size)
        if not self.alive():
            gone = {r: _describe_exit(p.returncode) for r, p in self._procs.items() if p.poll() is not None}
            raise PoolError(f"pool workers are gone before the test: {gone}")
        if not self.session_pids:
            self.open_session()
        offsets = {
            r: (self._paths(r)[0].stat().st_size, self._paths(r)[1].stat().st_size)
            for r in range(self.world_size)
        }
        begin = time.monotonic()
        message_out = ("run", {**spec, "port": self.port, "relaunch": self.relaunch})
        for rank, conn in self._conns.items():
            try:
                conn.send(message_out)
            except OSError as exc:
                raise PoolError(f"pool worker rank {rank} is gone before the test: {exc}") from None
        self.tests_run += 1
        deadline = begin + timeout
        given_up_at: float | None = None
        exited: set[int] = set()  # session processes that ended
        broken: set[int] = set()

        def pending() -> set[int]:
            return {
                r for r in range(self.world_size) if r not in outcome.results and r not in exited | broken
            }

        while pending():
            now = time.monotonic()
            if now > deadline:
                outcome.timed_out = True
                break
            if given_up_at is not None and now > given_up_at:
                break
            for ready_conn in wait(
                [self._conns[r] for r in set(range(self.world_size)) - broken], timeout=0.1
            ):
                rank = next(r for r, c in self._conns.items() if c is ready_conn)
                try:
                    message = self._conns[rank].recv()
                except (EOFError, OSError, pickle.UnpicklingError):
                    broken.add(rank)
                    outcome.dead[rank] = _describe_exit(self._procs[rank].poll())
                    outcome.dead_at[rank] = time.time()
                    continue
                kind = message[0]
                if kind == "result":
                    outcome.results[rank] = message[1]
                    if message[1]["outcome"] != "passed" and given_up_at is None:
                        given_up_at = time.monotonic() + FAILURE_GRACE_S
                elif kind == "exited":
                    exited.add(rank)
                    if rank not in outcome.results:
                        outcome.dead[rank] = message[1]
                        outcome.dead_at[rank] = float(message[2])
                        if given_up_at is None:
                            given_up_at = time.monotonic() + FAILURE_GRACE_S
            for rank in set(range(self.world_size)) - broken:
                if self._procs[rank].poll() is not None:
                    broken.add(rank)
                    outcome.dead[rank] = _describe_exit(self._procs[rank].returncode)
                    outcome.dead_at[rank] = time.time()
        outcome.hung = sorted(pending())
        if outcome.hung:
            outcome.stacks = self._dump_stacks({r: self.session_pids.get(r) for r in outcome.hung})
        if len(outcome.results) == self.world_size and all(
            res["outcome"] == "passed" for res in outcome.results.values()
        ):
            outcome.unbalanced = unbalanced({r: res.get("calls") for r, res in outcome.results.items()})
        if outcome.hung or outcome.dead or exited or len(outcome.results) < self.world_size:
            self.end_session(exited, broken, kill=set(outcome.hung))
        elif outcome.unbalanced:  # a call left pending would pair with the next test's: new processes
            self.end_session(exited, broken, abort=True)
        # after a failure or a skip somewhere, or a test that destroyed, relaunched or changed
        # gpc on some rank, every rank launches gpc anew for the next test
        self.relaunch = any(
            res["outcome"] != "passed" or not res.get("keep", False) for res in outcome.results.values()
        )
        outcome.broken = sorted(broken)
        outcome.elapsed = time.monotonic() - begin
        for rank, (out_at, err_at) in offsets.items():
            out, err, _ = self._paths(rank)
            outcome.stdout[rank] = _read_from(out, out_at)
            outcome.stderr[rank] = _read_from(err, err_at)
        return outcome

    def end_session(
        self,
        exited: set[int] | None = None,
        broken: set[int] | None = None,
        kill: set[int] | None = None,
        abort: bool = False,
    ) -> None:
        """End every rank's session process: SIGKILL for the ranks in ``kill``, ``("end",)`` for
        the others (their fixtures are torn down and their coverage saved; with ``abort``, after
        ``gpc.abort()``, so that a call left pending does not hold the teardown up), and wait for each
        zygote to say it ended; ranks in ``exited`` have ended already. A rank whose session does
        not end within :data:`END_WAIT_S` is killed; a rank whose zygote does not answer is added
        to ``broken``. Returns None."""
        exited = set() if exited is None else exited
        broken = set() if broken is None else broken
        message: tuple[Any, ...] = ("end", {"abort": True}) if abort else ("end",)
        for rank in sorted(set(self.session_pids) - exited - broken):
            if kill and rank in kill:
                _kill_pid(self.session_pids[rank])
                continue
            try:
                self._conns[rank].send(message)
            except OSError:
                broken.add(rank)
        waiting = set(self.session_pids) - exited - broken
        for patience in (END_WAIT_S, 5.0):
            deadline = time.monotonic() + patience
            while waiting and time.monotonic() < deadline:
                for ready_conn in wait([self._conns[r] for r in waiting], timeout=0.2):
                    rank = next(r for r, c in self._conns.items() if c is ready_conn)
                    try:
                        message = self._conns[rank].recv()
                    except (EOFError, OSError, pickle.UnpicklingError):
                        broken.add(rank)
                        waiting.discard(rank)
                        continue
                    if message[0] == "exited":
                        waiting.discard(rank)
                for rank in list(waiting):
                    if self._procs[rank].poll() is not None:
                        broken.add(rank)
                        waiting.discard(rank)
            for rank in waiting:  # a teardown that hangs
                _kill_pid(self.session_pids[rank])
        broken.update(waiting)
        self.session_pids = {}

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
        """End the session processes (fixtures torn down, coverage saved: :meth:`end_session`),
        ask every rank process to exit, wait briefly, then kill what is left (see :meth:`kill`)."""
        if self.session_pids and self.alive():
            self.end_session()
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


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def check_same_collection(items: Mapping[int, list[tuple[str, str]]]) -> None:
    """Check that every rank collected the same tests, in the same order, with the same
    parameter values (``items`` maps a rank to its ``[(node id, parameters)]``). Returns None.

    Raises:
        PoolError: two ranks differ; the message names the first difference and the likely
            cause.
    """

    def describe(found: list[tuple[str, str]], index: int) -> str:
        if index >= len(found):
            return f"no test {index + 1} (it collected {len(found)})"
        nodeid, params = found[index]
        return f"{nodeid} with {params}" if params else nodeid

    reference = [(str(a), str(b)) for a, b in items[min(items)]]
    for rank in sorted(items):
        found = [(str(a), str(b)) for a, b in items[rank]]
        if found == reference:
            continue
        index = next(
            (i for i, (a, b) in enumerate(zip(reference, found, strict=False)) if a != b),
            min(len(reference), len(found)),
        )
        raise PoolError(
            f"the ranks collected different tests: test {index + 1} of rank {min(items)} is "
            f"{describe(reference, index)}, of rank {rank} {describe(found, index)}. Each rank collects the "
            "test files itself; parameters must not depend on the process (random values, a set or "
            "another hash-ordered value when PYTHONHASHSEED is not fixed, the rank's environment)"
        )


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
