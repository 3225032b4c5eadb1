"""The guarded launch rendezvous: reach the store, meet every rank, agree, in bounded time.

Every wait here has a deadline (the launch's ``dist.timeout``) and is done in short slices, so
that Ctrl-C and SIGTERM are acted on within a fraction of a second, and every failure names
what it waited for: the ranks that never arrived, the host and port, the ranks and keys that
disagree. :func:`connect_store` reaches (rank 0: serves) the rendezvous store;
:func:`meet` is the one round trip of a launch: every rank posts its :class:`Arrival` (host
name, the values all ranks must agree on, or the error its own checks raised) under a key
prefix no earlier launch on that store used (a store outlives its processes under torchrun
restarts and in-process restarts), and rank 0 answers with one verdict: the prefix confirmed,
every rank's host name, and what stops the launch; :func:`disagreement` words what differs.

Imports nothing from parallelctx (context.py builds on it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch.distributed as dist

__all__ = [
    "ABANDONED",
    "Arrival",
    "Lineage",
    "RendezvousError",
    "agree_launch",
    "connect_store",
    "disagreement",
    "meet",
    "rank_list",
    "serves_store",
    "settle",
    "store_attempt",
]

# Longest sleep between two polls of the store: Ctrl-C and SIGTERM are acted on within this.
_SLICE_S = 0.25
# Polls of the store per second that all ranks together may send when they start waiting: the
# first sleep is world_size / this (at least 1 ms, at most 10 ms, the old fixed start), so that
# a small job sees its last rank within a millisecond or two and a large one does not flood the
# store server (a poll is up to 3 requests; one TCPStore served ~90k requests/s here).
_POLL_RATE = 30_000


# How long a wait goes before it first names the ranks it waits for (a store request per rank,
# for SIGTERM's and Ctrl-C's message), and how that grows: a short wait never pays for it.
_NAME_AFTER_S = 1.0
_NAME_EVERY_MAX_S = 8.0
# Added to the count of a rendezvous by a rank that refused, so that one request tells a waiting
# rank both how many arrived and whether one refused.
REFUSED = 1 << 32
# Added to a launch prefix's answer count by a rank that abandoned that attempt after answering
# (parallelctx.runtime.bell.abandon): a multiple of REFUSED, so answers modulo REFUSED still count.
ABANDONED = 1 << 48
# Added once (the first rank to set the prefix's "ahead" key) to a launch prefix's answer count by
# a rank at a later launch of its process than rank 0's: rank 0's launch can never pair with it.
# Above 256 refusals a count reaches this band too, so rank 0 reads the key to tell them apart.
AHEAD = 1 << 40

logger = logging.getLogger("parallelctx")


def _namings() -> Iterator[float]:
    """Yield the times (``time.monotonic()``) at which a wait that began now names the ranks it
    waits for: after 1 s, then 2, 4 and every 8 s."""
    begin, step = time.monotonic(), _NAME_AFTER_S
    at = begin + step
    while True:
        yield at
        step = min(step * 2, _NAME_EVERY_MAX_S)
        at += step


def _pauses(world_size: int) -> Iterator[float]:
    """Yield the sleeps between two polls of the store: from ``world_size / _POLL_RATE``
    seconds (within [1 ms, 10 ms]), each half as long again as the last, up to ``_SLICE_S``."""
    pause = min(max(world_size / _POLL_RATE, 0.001), 0.01)
    while True:
        yield pause
        pause = min(pause * 1.5, _SLICE_S)


class RendezvousError(RuntimeError):
    """The launch rendezvous failed: a rank never arrived, the store did not answer, the port
    is taken, or the ranks disagree. ``ranks`` holds the ranks at fault (when known) and
    ``address`` the ``host:port`` (or URL) of the rendezvous."""

    def __init__(self, message: str, ranks: Sequence[int] = (), address: str = "") -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.address = address


@dataclass(frozen=True)
class Arrival:
    """What one rank posts at the rendezvous: its ``rank``, ``host`` name, the ``values`` every
    rank must agree on (flat dotted keys), and ``error``, the message of the check that failed
    on this rank before the rendezvous (None when its checks passed)."""

    rank: int
    host: str
    values: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Lineage:
    """Which processes met: ``me``, this process's id (rank 0 posts it with each prefix);
    ``rank0``, the id of the rank 0 process whose verdict this process last accepted (None until
    then; :func:`meet` updates it); ``attempt``, which set of processes shares the store's life
    (:func:`store_attempt`; "" when unknown). A rank finding rank 0 at a later launch than its
    own stops at once only when that rank 0 is this job's: the process it met before or, before
    it met one, a rank 0 that posted the same non-empty ``attempt``. A prefix left by an earlier
    job's rank 0 (before a torchrun restart) says nothing about the rank 0 to come."""

    me: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    rank0: str | None = None
    attempt: str = ""

    @property
    def poster(self) -> str:
        """What rank 0 posts with each prefix to name itself: its process id and attempt."""
        return f"{self.me} {self.attempt.replace(' ', '_')}"


def rank_list(ranks: Sequence[int]) -> str:
    """Return ranks as compact text: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    items = sorted(set(ranks))
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ", ".join(out)


def _address(url: str) -> tuple[str | None, int | None]:
    if url.startswith("tcp://"):
        parts = urlsplit(url)
        return parts.hostname, parts.port
    if url.startswith("env://"):
        port = os.environ.get("MASTER_PORT", "")
        return os.environ.get("MASTER_ADDR"), int(port) if port.isdigit() else None
    return None, None


def _where(url: str) -> str:
    host, port = _address(url)
    return f"{host}:{port}" if host and port else url


# ---------------------------------------------------------------------------- signals
_waiting_for: list[str] = []  # what the main thread waits for now (for the SIGTERM message)


def _on_sigterm(signum: int, frame: Any) -> None:
    what = _waiting_for[-1] if _waiting_for else "the launch rendezvous"
    sys.stderr.write(f"parallelctx: SIGTERM while waiting for {what}; stopping\n")
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die of SIGTERM, as the sender expects


@contextlib.contextmanager
def _waiting(what: Callable[[], str]) -> Iterator[None]:
    """While the body waits: a KeyboardInterrupt gets a note saying what was awaited, and an
    unhandled SIGTERM prints it before the process dies (main thread only)."""
    swapped = False
    if threading.current_thread() is threading.main_thread():
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, _on_sigterm)
                swapped = True
    _waiting_for.append(what())
    try:
        yield
    except KeyboardInterrupt as exc:
        exc.add_note(
            f"parallelctx: interrupted while waiting for {_waiting_for[-1] if _waiting_for else what()}"
        )
        raise
    finally:
        _waiting_for.pop()
        if swapped:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _set_waiting(text: str) -> None:
    if _waiting_for:
        _waiting_for[-1] = text


# ---------------------------------------------------------------------------- the store
def _probe(host: str, port: int) -> bool | None:
    """True: something accepts connections at host:port; False: refused; None: unreachable."""
    try:
        with socket.create_connection((host, port), timeout=2.0):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def _make_store(url: str, rank: int, world_size: int, timeout: timedelta) -> Any:
    host, port = _address(url)
    if url.startswith("tcp://") and host and port:
        # rank 0 serves without waiting for the clients: meet() waits, and names who is missing.
        # Under torchrun the agent already serves a store at MASTER_PORT: rank 0 is a client of it
        # there (as torch's env:// does), instead of a server whose bind fails and is logged.
        agent = _agent_serves(port)
        return dist.TCPStore(
            host,
            port,
            world_size,
            rank == 0 and not agent,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=True,
        )
    store, _, _ = next(dist.rendezvous(url, rank, world_size, timeout=timeout))
    return store


def _agent_serves(port: int) -> bool:
    """Whether torchrun's agent serves the store at ``port`` (this process's launcher says so)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_PORT") == str(
        port
    )


def store_attempt(url: str) -> str:
    """Return an id of the processes that share the life of the store of ``url``, the same on
    every rank of one job: ``"served"`` when rank 0's process serves it (every key on it is
    that process's); torchrun's run id and restart count when the agent of a one-node job
    serves it (the store outlives the processes of an attempt, and the one agent counts them);
    "" when not known (``file://``, ``env://``, and torchrun across nodes: each agent keeps its
    own restart count, and one that restarts for a changed membership does not count it)."""
    if serves_store(url):
        return "served"
    port = _address(url)[1]
    one_agent = os.environ.get("GROUP_WORLD_SIZE") == "1"
    if url.startswith("tcp://") and port is not None and _agent_serves(port) and one_agent:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "").replace(" ", "_")
        return f"torchrun:{run}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', '?')}"
    return ""


def serves_store(url: str) -> bool:
    """Return whether rank 0's process serves the rendezvous store of ``url``: a ``tcp://`` URL
    that torchrun's agent does not serve (under ``env://`` and ``file://`` no rank does)."""
    host, port = _address(url)
    return url.startswith("tcp://") and bool(host) and port is not None and not _agent_serves(port)


def connect_store(
    url: str,
    rank: int,
    world_size: int,
    timeout: timedelta,
    deadline: float | None = None,
    aborted: threading.Event | None = None,
) -> Any:
    """Reach the rendezvous store of ``url`` (rank 0 of a ``tcp://`` URL serves it) within
    ``timeout`` (or by ``deadline``, a ``time.monotonic()`` value), in a helper thread so that a peer that accepts but never answers cannot hang
    this rank, and Ctrl-C / SIGTERM are acted on at once, and so is ``aborted`` (set by
    ``gpc.abort()``) when given.

    Returns:
        The store (a ``torch.distributed.Store``).

    Raises:
        RendezvousError: the port is taken (rank 0), nothing answered within ``timeout``, or
            something that is no rendezvous store holds the port; the message names host:port
            and what to check.
        KeyboardInterrupt: Ctrl-C while waiting (with a note saying for what).
    """
    where = _where(url)
    host, port = _address(url)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["store"] = _make_store(url, rank, world_size, timeout)
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="parallelctx-rendezvous", daemon=True)
    seconds = timeout.total_seconds()
    deadline = time.monotonic() + seconds if deadline is None else deadline
    what = (
        f"the rendezvous store at {where} to start (rank 0 serves it)"
        if rank == 0
        else f"rank 0's rendezvous store at {where} (rank {rank} of {world_size})"
    )
    with _waiting(lambda: what):
        thread.start()
        while thread.is_alive() and time.monotonic() < deadline:
            if aborted is not None and aborted.is_set():
                raise RendezvousError(f"rank {rank}: aborted while waiting for {what}", (), where)
            thread.join(min(_SLICE_S, max(deadline - time.monotonic(), 0.0)))
    if "store" in box:
        return box["store"]
    error = box.get("error")
    text = str(error).split("\n", 1)[0] if error is not None else ""
    if rank == 0 and ("EADDRINUSE" in text or "address already in use" in text.lower()):
        raise RendezvousError(
            f"rank 0 cannot serve the rendezvous store at {where}: port {port} is already in use by "
            "another program (another job, or a previous run that has not exited); pick a free port "
            "(parallelctx.env.free_port()) or stop the program that holds it",
            (0,),
            where,
        ) from None
    if rank == 0:
        raise RendezvousError(
            f"rank 0 could not serve the rendezvous store at {where} within {seconds:g} s"
            + (f": {text}" if text else "")
            + "; check that the host name is an address of this machine",
            (0,),
            where,
        ) from None
    listening = _probe(host, port) if host and port else None
    if listening and error is None:
        cause = (
            f"something at {where} accepts connections but did not answer as a rendezvous store "
            f"within {seconds:g} s: another program holds this port (another job?), or host/port "
            "is not rank 0's; give every rank rank 0's address and a port no other program uses"
        )
    elif listening is False or error is not None:
        cause = (
            f"no rendezvous store answered at {where} within {seconds:g} s: rank 0, which serves "
            "it, never started, failed before launching, or was given another port; check rank 0's "
            "log and that every rank has the same host:port"
        )
    else:
        cause = (
            f"rank 0's rendezvous store at {where} could not be reached within {seconds:g} s "
            "(no answer at all: a firewall, or a wrong host name?)"
        )
    raise RendezvousError(f"rank {rank} of {world_size}: {cause}", (0,), where) from None


# ---------------------------------------------------------------------------- the meeting
_ROOT = "parallelctx/"


@dataclass(frozen=True)
class _Verdict:
    """What rank 0 posts under a launch's prefix once it has read the answers: each other rank's
    nonce (``b""`` for a rank not yet answered: only a refusal is posted before every rank
    answered, and reposted as more answer), every rank's host name, and the problem that stops
    the launch with the ranks at fault (None, ``()`` when the launch goes on)."""

    nonces: tuple[bytes, ...]
    hosts: tuple[str, ...]
    problem: str | None = None
    culprits: tuple[int, ...] = ()


def meet(
    store: Any,
    arrival: Arrival,
    world_size: int,
    timeout: timedelta,
    where: str,
    deadline: float | None = None,
    on_post: Callable[[str], None] | None = None,
    generation: int | None = None,
    on_adopt: Callable[[int], None] | None = None,
    lineage: Lineage | None = None,
) -> tuple[str, list[str]]:
    """Meet every rank of ``world_size`` on ``store`` in one round trip: agree on a key prefix no
    earlier launch on the store used, and check every rank's ``arrival`` (its values, or the
    error its own checks raised) against the others'.

    A store outlives the processes that used it: torchrun's agent keeps the store at
    MASTER_ADDR:MASTER_PORT across ``--max-restarts`` attempts (every attempt's processes are
    new, and ``TORCHELASTIC_RESTART_COUNT`` differs between agents), and after an in-process
    restart the survivors keep rank 0's store while a replaced rank is a fresh process. So no
    rank can tell from its own state which keys are fresh. Rank 0 takes the next number from the
    store's counter and posts ``parallelctx/launch-<n>/``; every other rank posts its arrival
    under the prefix it read, with a nonce of its own, and waits until rank 0 confirms that nonce
    under that prefix. Rank 0 reads every arrival, compares the values and posts one verdict:
    the nonces, every rank's host name, and what stops the launch (a rank that refused, ranks
    that disagree). A prefix left by an earlier launch is never confirmed with this process's
    nonce, so no rank adopts it. A refusal is posted as soon as rank 0 reads it, and posted
    again as later ranks answer, until every rank has read it or the deadline passes.

    A rank that abandons an attempt after answering adds :data:`~parallelctx.runtime.bell.ABANDONED`
    to its answer count (:func:`parallelctx.runtime.bell.abandon`): rank 0, still waiting for
    answers, then posts a new prefix (with a fresh ``timeout``) and the other ranks answer that.
    ``on_post(prefix)`` is called with each prefix this rank posts or answers.

    ``generation`` is which launch of its process this is (None: any). Rank 0 posts its own with
    the prefix, and another rank answers only a prefix of its own generation, or of any when
    either is None: ranks that abort and relaunch on their own thus pair relaunch with relaunch,
    never one rank's relaunch with another's attempt that is still to be aborted. A rank whose
    first launch pairs with any generation (a replaced rank) takes rank 0's
    (``on_adopt(generation)``), so that it launches in step from then on. ``lineage`` (default: a
    new one) names this process to the others and remembers the rank 0 it met.

    Returns:
        The prefix (the same on every rank) and every rank's host name in rank order. A rank
        whose ``arrival.error`` is set returns once every rank was told (or the deadline passed)
        and does not raise for its own refusal.

    Raises:
        RendezvousError: a rank did not answer by ``deadline`` (``time.monotonic()``; default now
            + ``timeout``), another rank refused, the ranks' values differ, or the store went
            away; the message names the ranks, ``where`` and what to check.
        KeyboardInterrupt: Ctrl-C while waiting (with a note naming the awaited ranks).
    """
    seconds = timeout.total_seconds()
    deadline = time.monotonic() + seconds if deadline is None else deadline
    post = on_post or (lambda prefix: None)
    lineage = lineage or Lineage()
    if arrival.rank == 0:
        prefix, verdict = _lead(
            store, arrival, world_size, seconds, where, deadline, post, generation, lineage.poster
        )
    else:
        prefix, verdict = _follow(
            store,
            arrival,
            world_size,
            seconds,
            where,
            deadline,
            post,
            generation,
            on_adopt or (lambda g: None),
            lineage,
        )
    if verdict.problem is not None and arrival.error is None:
        raise RendezvousError(f"launch refused on every rank: {verdict.problem}", verdict.culprits, where)
    return prefix, list(verdict.hosts)


def agree_launch(
    store: Any,
    rank: int,
    world_size: int,
    timeout: timedelta,
    where: str,
    deadline: float | None = None,
) -> str:
    """Agree with every rank on a key prefix that no earlier launch on ``store`` used, and return
    it: ``"parallelctx/launch-<n>/"``, where ``n`` counts the launches this store has seen
    (:func:`meet` without values to compare).

    Returns:
        The prefix, the same on every rank.

    Raises:
        RendezvousError: a rank did not answer by ``deadline`` (``time.monotonic()``; default
            now + ``timeout``), or the store went away; the message names the ranks and ``where``.
        KeyboardInterrupt: Ctrl-C while waiting (with a note naming the awaited ranks).
    """
    return meet(store, Arrival(rank, ""), world_size, timeout, where, deadline)[0]


def _lead(
    store: Any,
    arrival: Arrival,
    world_size: int,
    seconds: float,
    where: str,
    deadline: float,
    post: Callable[[str], None],
    generation: int | None = None,
    poster: str = "",
) -> tuple[str, _Verdict]:
    """Rank 0's half of :func:`meet` (``poster``: :attr:`Lineage.poster`): post a new prefix,
    read every answer, post the verdict;
    post a new prefix (with a fresh deadline) whenever a rank abandons the one posted. When the
    ranks do not all come in the end, the error names those that never answered any prefix
    (a rank that answered one and gave up, at its own timeout, did arrive)."""
    earlier: list[str] = []  # the prefixes abandoned

    def posting(prefix: str) -> None:
        earlier.append(prefix)
        post(prefix)

    while True:
        try:
            return _lead_once(
                store, arrival, world_size, seconds, where, deadline, posting, generation, poster
            )
        except _Ahead as ahead:
            raise RendezvousError(str(ahead), ahead.ranks, where) from None
        except _Abandoned as gone:
            logger.warning("parallelctx: %s; rank 0 posts a new launch prefix", gone)
            deadline = max(deadline, time.monotonic() + seconds)
        except RendezvousError as exc:
            came: set[int] = set()  # ranks that answered an abandoned prefix
            for abandoned in earlier[:-1]:
                missing = _missing(store, world_size, abandoned + "answer/", 1)
                came |= set(range(1, world_size)) - set(missing if missing is not None else range(world_size))
            never = [r for r in exc.ranks if r not in came]
            if not came or not exc.ranks or not never or never == list(exc.ranks):
                raise
            gave_up = rank_list(sorted(came & set(exc.ranks)))
            raise RendezvousError(
                f"{_not_arrived(never, world_size, seconds, where)}; came, then abandoned the "
                f"attempt (their own timeout, an error or gpc.abort()): {gave_up}",
                never,
                where,
            ) from None


class _Abandoned(RendezvousError):
    """A rank abandoned the prefix rank 0 posted (raised out of :func:`_await_count`'s wait)."""


def _lead_once(
    store: Any,
    arrival: Arrival,
    world_size: int,
    seconds: float,
    where: str,
    deadline: float,
    post: Callable[[str], None],
    generation: int | None,
    poster: str = "",
) -> tuple[str, _Verdict]:
    try:
        prefix = f"{_ROOT}launch-{store.add(_ROOT + 'launches', 1)}/"
        post(prefix)
        store.set(_ROOT + "leader", f"{prefix} {'*' if generation is None else generation} {poster}".encode())
    except Exception as exc:
        raise _lost(0, where, exc) from None
    if arrival.error is not None:
        why = f"rank 0 (host {arrival.host}) refused to launch, so every rank stops: {arrival.error}"
        return prefix, _refuse(store, prefix, world_size, deadline, why, (0,), where)
    if world_size == 1:
        return prefix, _Verdict((), (arrival.host,))
    with _waiting(lambda: f"the other ranks of {world_size} at {where}"):

        def refused(count: int) -> None:
            if count >= ABANDONED:
                raise _Abandoned(
                    f"a rank abandoned the launch attempt {prefix.rstrip('/')} while rank 0 read the answers"
                )
            if count < REFUSED:
                return
            if count >= AHEAD and store.check([prefix + "ahead"]):
                ahead, _, at = store.get(prefix + "ahead").decode().partition(" ")
                error = _Ahead(int(ahead), int(at), generation or 0, where)
                # the ranks that answered, in step with rank 0, stop now too (not at rank 0's next launch)
                verdict = _Verdict(_nonces(store, prefix, world_size), (), str(error), error.ranks)
                store.set(prefix + "confirmed", pickle.dumps(verdict))
                raise error
            bad = int(store.get(prefix + "refusal"))  # set before the count says a rank refused
            theirs: Arrival = pickle.loads(store.get(f"{prefix}answer/{bad}"))[1]
            why = f"rank {bad} (host {theirs.host}) refused to launch, so every rank stops: {theirs.error}"
            raise _Refused(_refuse(store, prefix, world_size, deadline, why, (bad,), where))

        try:
            _await_count(
                store, prefix + "answers", world_size - 1, world_size, prefix + "answer/", 0,
                seconds, deadline, where, refused, first=1,
            )  # fmt: skip
        except _Refused as refusal:
            return prefix, refusal.verdict
        try:
            answers = [
                pickle.loads(v)
                for v in store.multi_get([f"{prefix}answer/{r}" for r in range(1, world_size)])
            ]
            arrivals = [arrival] + [a for _, a in answers]
            problem = disagreement(arrivals)
            verdict = _Verdict(
                tuple(n for n, _ in answers),
                tuple(a.host for a in arrivals),
                problem,
                tuple(_odd_ranks(arrivals)) if problem is not None else (),
            )
            store.set(prefix + "confirmed", pickle.dumps(verdict))
        except Exception as exc:
            raise _lost(0, where, exc) from None
        if problem is not None:
            _linger(store, prefix, world_size, deadline)
    return prefix, verdict


class _Ahead(RendezvousError):
    """A rank is at a later launch of its process than rank 0 (it told rank 0 so through the
    prefix's answer count): rank 0's launch can never pair with it, so it stops at once."""

    def __init__(self, rank: int, theirs: int, ours: int, where: str) -> None:
        super().__init__(
            f"rank 0 cannot make the {_nth(ours)} launch of its process with rank {rank}: rank "
            f"{rank} is at its {_nth(theirs)} already (rank 0 went on with a launch the others "
            "abandoned, for example after a gpc.abort() that came before its launch began, or "
            "launched fewer times than they did); the ranks of a job launch in step, and rank 0's "
            "next launch pairs with theirs",
            (rank,),
            where,
        )


class _Refused(RendezvousError):
    """Carries the verdict of a refusal out of :func:`_await_count`'s wait (which lets a
    RendezvousError through)."""

    def __init__(self, verdict: _Verdict) -> None:
        super().__init__(verdict.problem or "")
        self.verdict = verdict


def _refuse(
    store: Any,
    prefix: str,
    world_size: int,
    deadline: float,
    problem: str,
    culprits: tuple[int, ...],
    where: str,
) -> _Verdict:
    """Rank 0 after a refusal: post the verdict with the nonces answered so far, post it again
    as more ranks answer, until every rank has read it or ``deadline`` passed (rank 0 serves the
    store, so it stays until then); return the last verdict posted."""
    verdict = _Verdict((), (), problem, culprits)
    told = -1
    with contextlib.suppress(Exception), _waiting(lambda: f"the other ranks of {world_size} at {where}"):
        while True:
            answered = store.add(prefix + "answers", 0) % REFUSED
            if answered != told:
                verdict = _Verdict(_nonces(store, prefix, world_size), (), problem, culprits)
                store.set(prefix + "confirmed", pickle.dumps(verdict))
                told = answered
            if answered >= world_size - 1 and store.add(prefix + "read", 0) >= world_size - 1:
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(_SLICE_S / 4)
    return verdict


def _nonces(store: Any, prefix: str, world_size: int) -> tuple[bytes, ...]:
    """The nonce each rank but 0 answered ``prefix`` with (``b""`` where it has not answered)."""
    return tuple(
        pickle.loads(store.get(f"{prefix}answer/{r}"))[0] if store.check([f"{prefix}answer/{r}"]) else b""
        for r in range(1, world_size)
    )


def _follow(
    store: Any,
    arrival: Arrival,
    world_size: int,
    seconds: float,
    where: str,
    deadline: float,
    post: Callable[[str], None],
    generation: int | None = None,
    adopt: Callable[[int], None] = lambda generation: None,
    lineage: Lineage | None = None,
) -> tuple[str, _Verdict]:
    """The other ranks' half of :func:`meet`: answer the posted prefix with a nonce and this
    rank's arrival until rank 0 confirms that nonce; return the prefix and the verdict."""
    rank = arrival.rank
    nonce = uuid.uuid4().hex.encode()
    answer = pickle.dumps((nonce, arrival))
    count = 1 + (REFUSED if arrival.error is not None else 0)
    answered: str | None = None
    paired: int | None = None  # rank 0's generation at the prefix answered
    lineage = lineage or Lineage()
    leader = ""  # the id of the rank 0 process that posted the prefix answered
    stale: str | None = None  # a prefix this rank answered in an earlier launch
    behind: int | None = None  # rank 0's generation when it is at another launch than this rank
    own = generation
    pauses = _pauses(world_size)
    reread = 0.0  # when to read the posted prefix again (a newer launch may replace it)
    posted = False  # the leader key exists (rank 0 never deletes it): read it without a check
    # A prefix whose verdict went on without this rank's nonce (an earlier launch's, read before
    # rank 0 posted this one): such a verdict is final, so it is not read again.
    past: str | None = None
    told: str | None = None  # the prefix of an earlier launch of rank 0's told that this rank is ahead
    with _waiting(lambda: f"rank 0 at {where} (rank {rank} of {world_size})"):
        while True:
            try:
                now = time.monotonic()
                if now >= reread and (posted or store.check([_ROOT + "leader"])):
                    posted = True
                    prefix, theirs, poster, attempt = _posted(store.get(_ROOT + "leader"))
                    if not _in_step(theirs, generation):
                        behind = theirs  # rank 0 is at another launch: wait for the one of ours
                        now = 0.0  # and read again at the next poll
                        later = theirs is not None and generation is not None and theirs > generation
                        if later and _goes_on(poster, attempt, lineage):
                            # rank 0's launches only count up: the one this rank makes never comes
                            raise _gone_past(rank, theirs or 0, generation or 0, where)
                        if not later and prefix != told:  # rank 0 is behind: tell it, once
                            told, mark = prefix, f"{rank} {generation}".encode()
                            if store.compare_set(prefix + "ahead", b"", mark) == mark:
                                store.add(prefix + "answers", AHEAD)
                    elif prefix != answered and prefix != stale:
                        behind = None
                        # Each rank answers a prefix once, ever: an answer already there is an
                        # earlier launch's of this rank (this process's, or the process it took
                        # over), so the prefix is stale, and answering it again would let rank 0,
                        # still telling that launch's refusal, refuse this launch with it.
                        if store.compare_set(f"{prefix}answer/{rank}", b"", answer) != answer:
                            stale = prefix
                            now = 0.0  # read the posted prefix at every poll until rank 0 posts ours
                        else:
                            post(prefix)
                            if arrival.error is not None:
                                store.set(prefix + "refusal", str(rank).encode())
                            store.add(prefix + "answers", count)
                            answered, paired, leader = prefix, theirs, poster
                    reread = now + _SLICE_S if now else 0.0
                if answered is not None and answered == past:
                    reread = 0.0  # read the posted prefix at every poll until rank 0 posts this launch's
                elif answered is not None and store.check([answered + "confirmed"]):
                    verdict: _Verdict = pickle.loads(store.get(answered + "confirmed"))
                    if len(verdict.nonces) == world_size - 1 and verdict.nonces[rank - 1] == nonce:
                        if verdict.problem is not None:  # rank 0 waits for every rank to read a refusal
                            store.add(answered + "read", 1)
                        if paired is not None and paired != own:
                            adopt(paired)  # paired with rank 0's launch: its count is ours from now
                        lineage.rank0 = leader
                        return answered, verdict
                    if verdict.problem is None:  # posted once, when every rank had answered
                        past = answered
                    reread = 0.0  # an earlier launch's prefix, or a refusal told before this rank answered
            except RendezvousError:
                raise
            except Exception as exc:
                raise _lost(rank, where, exc) from None
            now = time.monotonic()
            if now >= deadline:
                # Under the prefix this rank answered, the ranks that did not answer; when all did
                # (or the prefix was an earlier launch's), rank 0 never confirmed this launch.
                missing = (
                    _missing(store, world_size, answered + "answer/", 1) if answered is not None else None
                )
                if behind is not None and generation is not None and answered is None:
                    raise _out_of_step(rank, behind, generation, world_size, seconds, where)
                raise _not_arrived(missing or [0], world_size, seconds, where)
            time.sleep(min(next(pauses), max(deadline - now, 0.0)))


def _posted(value: bytes) -> tuple[str, int | None, str, str]:
    """The prefix, launch generation (None: any), process id and attempt rank 0 posted."""
    prefix, generation, me, attempt = (value.decode().split(" ") + ["", "", ""])[:4]
    return prefix, int(generation) if generation.isdigit() else None, me, attempt


def _goes_on(poster: str, attempt: str, lineage: Lineage) -> bool:
    """Whether the rank 0 that posted a later launch than this rank's is this job's, live (so the
    launch this rank waits for never comes): the rank 0 process this process met; or, before this
    process met one, a rank 0 of the same store attempt (:func:`store_attempt`). A prefix of an
    earlier attempt (before a torchrun restart; or a rank 0 whose attempt is not known) may be
    stale, and the new rank 0 replaces it: this rank waits for that one."""
    if poster == "":
        return False
    if lineage.rank0 is not None:
        return poster == lineage.rank0
    return lineage.attempt != "" and attempt == lineage.attempt


def _in_step(theirs: int | None, ours: int | None) -> bool:
    """Whether a launch at generation ``theirs`` may pair with one at ``ours`` (None pairs with any)."""
    return theirs is None or ours is None or theirs == ours


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _out_of_step(
    rank: int, theirs: int, ours: int, world_size: int, seconds: float, where: str
) -> RendezvousError:
    """The error of a rank that waited for rank 0's launch of its own generation in vain."""
    return RendezvousError(
        f"rank {rank} waited {seconds:g} s (dist.timeout) at {where} for rank 0 to make the "
        f"{_nth(ours)} launch of its process, as this rank does, but rank 0 is at its {_nth(theirs)}: "
        "the ranks of a job launch in step (each launch after gpc.abort() or a failed launch pairs "
        "only with the other ranks' launches after theirs, so that no rank's relaunch meets "
        "another rank's attempt that is still to be aborted); this rank's next launch pairs with "
        "whichever launch rank 0 is at then and takes its count, so a retry brings it back in step",
        (0,),
        where,
    )


def _gone_past(rank: int, theirs: int, ours: int, where: str) -> RendezvousError:
    """The error of a rank that found rank 0 already at a later launch than its own."""
    return RendezvousError(
        f"rank {rank} cannot wait at {where} for rank 0 to make the {_nth(ours)} launch of its "
        f"process, as this rank does: rank 0 is at its {_nth(theirs)} already (it abandoned the "
        "launch this rank meant to pair with, after gpc.abort() or an error on rank 0, or that "
        "launch ran out of time without this rank); the ranks of a job launch in step, and this "
        "rank's next launch pairs with whichever launch rank 0 is at then and takes its count",
        (0,),
        where,
    )


def _missing(store: Any, world_size: int, posted: str, first: int = 0) -> list[int] | None:
    try:
        return [r for r in range(first, world_size) if not store.check([f"{posted}{r}"])]
    except Exception:
        return None


def _await_count(
    store: Any,
    counter: str,
    target: int,
    world_size: int,
    posted: str,
    rank: int,
    seconds: float,
    deadline: float,
    where: str,
    on_refusal: Callable[[int], None] | None = None,
    first: int = 0,
) -> None:
    """Poll ``counter`` on ``store``, in short slices, one request a poll, until it counts
    ``target`` (modulo :data:`REFUSED`; a count of :data:`REFUSED` or more calls
    ``on_refusal(count)``, which raises when it stops the wait); the ranks from ``first`` whose ``<posted><rank>`` key is missing (of
    ``world_size``) are named after a second of waiting (for SIGTERM's message) and in the error.

    Raises:
        RendezvousError: ``deadline`` passed (the missing ranks named), what ``on_refusal``
            raises, or the store went away.
    """
    pauses, namings = _pauses(world_size), _namings()
    named = next(namings)
    while True:
        try:
            count = store.add(counter, 0)
            if count >= REFUSED and on_refusal is not None:
                on_refusal(count)
            if count % REFUSED >= target:
                return
        except RendezvousError:
            raise
        except Exception as exc:
            raise _lost(rank, where, exc) from None
        now = time.monotonic()
        if now >= deadline:
            raise _not_arrived(_missing(store, world_size, posted, first), world_size, seconds, where)
        if now >= named:  # waited a while: name the ranks it waits for (for SIGTERM's message)
            named = next(namings)
            missing = _missing(store, world_size, posted, first)
            if missing:
                _set_waiting(f"rank{'s' if len(missing) > 1 else ''} {rank_list(missing)} at {where}")
        time.sleep(min(next(pauses), max(deadline - now, 0.0)))


def settle(
    store: Any,
    tag: str,
    rank: int,
    world_size: int,
    timeout: timedelta,
    where: str,
    deadline: float | None = None,
) -> None:
    """Wait, in short slices, until every rank of ``world_size`` has come here (tag ``tag``, the
    same on every rank; it may be settled again later): the barrier after groups that connect at
    creation, so that no rank goes on, and perhaps tears a group down, while a peer is still
    connecting to it (gloo then fails that peer with "Connection closed by peer").

    Raises:
        RendezvousError: a rank did not come by ``deadline`` (default now + ``timeout``; named),
            or the store went away.
        KeyboardInterrupt: Ctrl-C while waiting (with a note naming the awaited ranks).
    """
    seconds = timeout.total_seconds()
    deadline = time.monotonic() + seconds if deadline is None else deadline
    try:
        count = store.add(f"settle/{tag}", 1)
        turn = (count - 1) // world_size  # which settling of this tag this is
        store.set(f"settle/{tag}/{turn}/{rank}", b"1")
    except Exception as exc:
        raise _lost(rank, where, exc) from None
    awaited = f"the other ranks of {world_size} to finish making their groups at {where}"
    with _waiting(lambda: awaited):
        target = (turn + 1) * world_size
        posted = f"settle/{tag}/{turn}/"
        _await_count(store, f"settle/{tag}", target, world_size, posted, rank, seconds, deadline, where)


def _not_arrived(
    missing: Sequence[int] | None, world_size: int, seconds: float, where: str
) -> RendezvousError:
    """The error for ranks (None: unknown ones) that did not arrive within the timeout."""
    many = missing is None or len(missing) > 1
    names = "some ranks" if missing is None else f"rank{'s' if many else ''} " + rank_list(missing)
    return RendezvousError(
        f"{names} of world_size={world_size} did not arrive at the rendezvous {where} within "
        f"{seconds:g} s (dist.timeout); check that {'they were' if many else 'it was'} "
        f"started with world_size={world_size} and the same host:port, that {'they' if many else 'it'} "
        f"did not fail before launching (see its log), and that {where} is reachable from "
        f"{'their' if many else 'its'} host; raise dist.timeout if ranks start slowly",
        missing or (),
        where,
    )


def _linger(store: Any, prefix: str, world_size: int, deadline: float) -> None:
    """Rank 0 serves the store: before it raises (and its process may exit), it waits, within
    the deadline, until every other rank has read the verdict."""
    with contextlib.suppress(Exception):
        while store.add(prefix + "read", 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(_SLICE_S / 4)


def _odd_ranks(arrivals: Sequence[Arrival]) -> list[int]:
    """The ranks outside the largest group of ranks with identical values."""
    groups: dict[str, list[int]] = {}
    for a in arrivals:
        groups.setdefault(repr(sorted(a.values.items())), []).append(a.rank)
    largest = max(groups.values(), key=len)
    return sorted(r for ranks in groups.values() if ranks is not largest for r in ranks)


def _lost(rank: int, where: str, exc: BaseException) -> RendezvousError:
    first = str(exc).split("\n", 1)[0]
    return RendezvousError(
        f"rank {rank} lost the rendezvous store at {where} during the launch ({type(exc).__name__}: "
        f"{first}); rank 0, which serves it, has probably exited or been killed: see rank 0's log",
        (0,),
        where,
    )


def disagreement(arrivals: Sequence[Arrival]) -> str | None:
    """Word what the ranks' ``values`` disagree on: each differing key with its values and the
    ranks holding each. Returns None when every rank holds the same values."""
    keys = sorted({key for a in arrivals for key in a.values})
    lines = []
    bad: set[int] = set()
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for a in arrivals:
            by_value.setdefault(repr(a.values.get(key, "<missing>")), []).append(a.rank)
        if len(by_value) > 1:
            ranked = sorted(by_value.items(), key=lambda item: -len(item[1]))
            for _, ranks in ranked[1:]:
                bad.update(ranks)
            lines.append(
                f"  {key}: "
                + "; ".join(
                    f"{value} on rank{'s' if len(r) > 1 else ''} {rank_list(r)}" for value, r in ranked
                )
            )
    if not lines:
        return None
    return (
        f"the ranks were launched with different settings (rank{'s' if len(bad) > 1 else ''} "
        f"{rank_list(sorted(bad))} differ{'' if len(bad) > 1 else 's'} from the rest) "
        f"on {len(lines)} key{'s' if len(lines) > 1 else ''}:\n"
        + "\n".join(lines)
        + "\ngive every rank the same config (parallel, dist and seed sections), the same launch() "
        "arguments (seed=, backend=, timeout=), the same parallelctx and torch versions and the "
        "same TORCH_GLOO_LAZY_INIT (env.* keys: environment variables)"
    )
