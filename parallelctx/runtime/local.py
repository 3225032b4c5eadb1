"""A world of N ranks as N threads of one process, with real numbers (issue 36): the baton.

Each simulated rank is a :class:`RankThread`; torch.distributed's world is made per thread
(torch's ``ThreadLocalWorld`` and its thread-isolated group registry, the pieces torch's own
threaded tests use), and every group is a :class:`~parallelctx.runtime.local_group.LocalGroup`
of the ``"local"`` backend, whose collectives and messages go through :class:`LocalWorld`.

The threads never run side by side: the baton lets one rank run at a time and passes on only
where that rank must wait for others (a collective whose members have not all come, a ``recv``
whose message was not sent, a ``send`` not yet received). Every time the baton moves, the rank
leaving keeps what a real process has alone (torch's CPU generator, Python's ``random``, numpy's
global generator, torch's default dtype, the environment with its own ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``, and any attribute named with :func:`keep_per_rank`) and
the rank taking it
gets its own back, so ``torch.manual_seed``, ``get_rng_state``/``set_rng_state``,
``torch.random.fork_rng``, gpc's per-mode streams and activation checkpointing's recompute all
act per rank. A collective is computed once every member has given its tensors, from all of
them in group-rank order, so the order in which ranks ran changes no number; a call returns a
pending work at once (``async_op=True`` works as on a real backend) and ``wait()`` passes the
baton until it is done.

When no rank can run and some wait, the job would hang: every waiting rank raises
:class:`LocalDeadlock`, which names each rank, what it waits for and on which group. Members of
a group that call different collectives at the same place of its sequence, or disagree on the
op, the root, a shape or a dtype, raise :class:`LocalMismatch`, naming both calls.
"""

from __future__ import annotations

import os
import random
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

__all__ = [
    "LocalAbandoned",
    "LocalDeadlock",
    "LocalMismatch",
    "LocalWorld",
    "RankThread",
    "keep_per_rank",
    "put_environ",
]

# torch's stubs type Work's methods by their C++ overloads; the Python overrides below are what
# torch.distributed's Python functions and its C++ trampoline call.
_Work: Any = dist.Work

SHOWN = 8  # waiting ranks named in a report


class LocalDeadlock(RuntimeError):
    """No simulated rank can run and some wait: the real job would hang here."""


class LocalMismatch(RuntimeError):
    """Members of a group disagree on a collective or a message (which call, its op, root, a
    shape or a dtype): a real job would hang, raise or read the wrong memory."""


class LocalAbandoned(BaseException):
    """Raised inside a rank still running when its local world was given up (a timeout or an
    interrupt): a BaseException, so that the rank's own ``except Exception`` does not keep it."""


class _Pending(_Work):
    """A call's work: done once ``ready()``; ``wait()`` passes the baton until then and raises
    :class:`LocalMismatch` when the call went wrong."""

    def __init__(
        self,
        world: LocalWorld,
        rank: int,
        what: str,
        ready: Callable[[], bool],
        error: Callable[[], str | None],
        result: Any = None,
        source: int = -1,
    ) -> None:
        super().__init__()
        self._world, self._rank, self._what = world, rank, what
        self._ready, self._error, self._result, self._source = ready, error, result, source

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._world.wait_until(self._rank, self._what, self._ready)
        problem = self._error()
        if problem is not None:
            raise LocalMismatch(problem)
        return True

    def is_completed(self) -> bool:
        return self._ready()

    def is_success(self) -> bool:
        return self._ready() and self._error() is None

    def _source_rank(self) -> int:
        return self._source

    def get_future(self) -> Future:
        self.wait()
        fut: Future = Future()
        fut.set_result(self._result)
        return fut


class _AllOf(_Work):
    """The work of several calls made as one (torch's coalesced forms): done when all are."""

    def __init__(self, works: Sequence[Any], result: Any) -> None:
        super().__init__()
        self._works, self._result = list(works), result

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def get_future(self) -> Future:
        self.wait()
        fut: Future = Future()
        fut.set_result(self._result)
        return fut


def all_of(works: Sequence[Any], result: Any) -> Any:
    """Return one ``Work`` for ``works``, done when each is (``result``: what its future holds)."""
    return _AllOf(works, result)


@dataclass
class _Meeting:
    """One collective of one group: what the members must agree on, what each gave, and
    whether it was computed or went wrong."""

    kind: str
    agree: Any
    shown: str
    starter: int
    data: dict[int, Any] = field(default_factory=dict)
    done: bool = False
    error: str | None = None


@dataclass
class _Message:
    """A sent tensor, until a ``recv`` takes it."""

    tensor: torch.Tensor
    taken: bool = False
    error: str | None = None


@dataclass
class Recv:
    """A posted receive: where the message goes, from whom, and whether it came."""

    tensor: torch.Tensor
    dst: int
    src: int
    src_group_rank: int
    tag: int
    done: bool = False
    error: str | None = None


@dataclass
class Channel:
    """A group's shared state: its members, how people name it, each member's place in its
    sequence of collectives (and where its function began), and its messages in flight."""

    members: tuple[int, ...]
    label: Callable[[], str]
    next_call: dict[int, int] = field(default_factory=dict)
    base: dict[int, int] = field(default_factory=dict)
    meetings: dict[int, _Meeting] = field(default_factory=dict)
    mail: dict[tuple[int, int, int], deque[_Message]] = field(default_factory=dict)
    posted: dict[tuple[int, int, int], deque[Recv]] = field(default_factory=dict)

    def call_text(self, member: int, place: int) -> str:
        """How a person counts call ``place`` of ``member`` (from its function's start)."""
        base = self.base.get(member)
        if base is None or place < base:
            return f"call {place + 1} of the launch on the {self.label()}"
        return f"its call {place - base + 1} on the {self.label()}"


@dataclass
class _Own:
    """What a rank keeps while another runs."""

    rng: tuple[torch.Tensor, Any, Any]
    dtype: torch.dtype
    env: dict[str, str]
    kept: dict[tuple[Any, str], Any]


class LocalWorld:
    """The shared state of one world of threads: the baton, each group's channel, and each
    rank's own state while it does not hold the baton."""

    def __init__(self, world_size: int) -> None:
        """A world of ``world_size`` ranks, none started.

        Raises:
            ValueError: ``world_size`` below 1.
        """
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        self.world_size = world_size
        self.store = dist.HashStore()
        self.finished: dict[int, BaseException | None] = {}
        self.abandoned = False
        self._lock = threading.Lock()
        self._turn = [threading.Event() for _ in range(world_size)]
        self._state = ["new"] * world_size  # new -> ready <-> waiting -> done
        self._waits: dict[int, str] = {}
        self._holder: int | None = None
        self._own: dict[int, _Own] = {}
        self._kept: dict[tuple[Any, str], Any] = {}  # attribute -> its value before any rank set it
        self._failure: str | None = None
        self._channels: dict[tuple[str, tuple[int, ...]], Channel] = {}

    # ------------------------------------------------------------------ the baton
    def enter(self, rank: int) -> None:
        """Rank ``rank``'s thread arrives; return once it holds the baton (rank 0 starts once
        every rank arrived), with its own state in place (the process's generators and dtype,
        its own ``RANK`` and friends).

        Raises:
            LocalDeadlock: the world failed before this rank got to run.
        """
        with self._lock:
            self._state[rank] = "ready"
            n = str(self.world_size)
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": n,
                "LOCAL_WORLD_SIZE": n,
            }
            self._own[rank] = _Own(_take_rng(), torch.get_default_dtype(), env, {})
            first = self._next_ready(self.world_size - 1)
            if all(s != "new" for s in self._state) and self._holder is None and first is not None:
                self._give(first)
        self._await(rank)

    def begin(self, rank: int) -> None:
        """Rank ``rank``'s launch is done and its function begins: its calls are counted from
        here in reports. Returns None."""
        with self._lock:
            for channel in self._channels.values():
                if rank in channel.members:
                    member = channel.members.index(rank)
                    channel.base[member] = channel.next_call.get(member, 0)

    def leave(self, rank: int, error: BaseException | None = None) -> None:
        """Rank ``rank`` is finished (``error``: what it raised); the baton passes on. Returns None."""
        with self._lock:
            self.finished[rank] = error
            self._state[rank] = "done"
            if self._holder == rank:
                self._pass(rank)

    def wait_until(self, rank: int, what: str, ready: Callable[[], bool]) -> None:
        """Pass the baton on until ``ready()`` (checked under the world's lock, made true by
        another rank's call, which wakes this one); ``what`` says what the rank waits for.
        Returns None.

        Raises:
            LocalDeadlock: no rank can run any more while this one waits, or the world was given up.
        """
        while True:  # a rank is woken by any call of its groups that ended: look again
            with self._lock:
                if self.abandoned:
                    raise LocalDeadlock(self._failure or "the local world was given up")
                if ready():
                    return
                self._state[rank] = "waiting"
                self._waits[rank] = what
                self._own[rank] = self._take()
                self._pass(rank)
            self._await(rank)

    def wake(self, rank: int) -> None:
        """Make a waiting rank ready to run again (the caller holds the world's lock)."""
        if self._state[rank] == "waiting":
            self._state[rank] = "ready"
            self._waits.pop(rank, None)

    def running(self) -> str:
        """Say which rank holds the baton and what the waiting ranks wait for."""
        with self._lock:
            holder = "no rank runs" if self._holder is None else f"rank {self._holder} runs"
            ready = [r for r, s in enumerate(self._state) if s == "ready" and r != self._holder]
            waits = [f"rank {r} waits for {w}" for r, w in sorted(self._waits.items())[:SHOWN]]
            more = len(self._waits) - len(waits)
            lines = [holder]
            if ready:
                lines.append(f"ranks {_ranges(ready)} can run once it reaches a collective")
            return "; ".join(lines + waits + ([f"{more} more ranks wait"] if more > 0 else []))

    def abandon(self, why: str) -> None:
        """Give the world up (the runner stopped waiting for it): every waiting rank raises
        :class:`LocalDeadlock` with ``why``, and so does every later wait. Returns None."""
        with self._lock:
            self.abandoned = True
            self._failure = why
            self._holder = None
            for turn in self._turn:
                turn.set()

    def keep_per_rank(self, owner: Any, names: Sequence[str]) -> None:
        """From now on every rank sees its own value of ``owner.<name>`` for each of ``names``
        (a module's globals, say), swapped in and out with the baton like the generators; a
        rank that never set one sees the value it had when it was first kept. Returns None.

        Raises:
            AttributeError: ``owner`` has no attribute of one of ``names``.
        """
        with self._lock:
            for name in names:
                self._kept.setdefault((owner, name), getattr(owner, name))

    def restore_kept(self) -> None:
        """Put every attribute kept per rank back to its value before any rank set it; returns None."""
        with self._lock:
            for (owner, name), value in self._kept.items():
                setattr(owner, name, value)

    def _take(self) -> _Own:
        return _Own(
            _take_rng(),
            torch.get_default_dtype(),
            dict(os.environ),
            {key: getattr(*key) for key in self._kept},
        )

    def _put(self, own: _Own) -> None:
        _put_rng(own.rng)
        torch.set_default_dtype(own.dtype)
        put_environ(own.env)
        for key, first in self._kept.items():
            setattr(key[0], key[1], own.kept.get(key, first))

    def _await(self, rank: int) -> None:
        self._turn[rank].wait()
        self._turn[rank].clear()
        with self._lock:
            if self._holder != rank:  # woken by a failure
                raise LocalDeadlock(self._failure or "the local world failed")
            self._put(self._own.pop(rank))

    def _give(self, rank: int) -> None:
        self._holder = rank
        self._turn[rank].set()

    def _next_ready(self, after: int) -> int | None:
        for step in range(1, self.world_size + 1):
            r = (after + step) % self.world_size
            if self._state[r] == "ready":
                return r
        return None

    def _pass(self, rank: int) -> None:
        nxt = self._next_ready(rank)
        if nxt is not None:
            self._give(nxt)
            return
        self._holder = None
        stuck = sorted(self._waits)
        if not stuck or any(s == "new" for s in self._state):
            return
        raised = {r: e for r, e in self.finished.items() if e is not None}
        lines = [f"rank {r} waits for {self._waits[r]}" for r in stuck[:SHOWN]]
        if len(stuck) > SHOWN:
            lines.append(f"ranks {_ranges(stuck[SHOWN:])} wait too")
        done = sorted(r for r, s in enumerate(self._state) if s == "done")
        if raised:
            named = [f"{r} ({type(e).__name__}: {e})" for r, e in list(raised.items())[:SHOWN]]
            lines.append("ranks that raised: " + ", ".join(named))
        if done:
            lines.append(f"ranks finished: {_ranges(done)}")
        self._failure = "no simulated rank can run: the real job would hang here; " + "; ".join(lines)
        for r in stuck:
            self._turn[r].set()

    # ------------------------------------------------------------------ groups
    def channel(self, name: str, members: tuple[int, ...], label: Callable[[], str]) -> Channel:
        """Return the shared state of the group ``name`` of ``members`` (made by the first
        member to ask; ``label()`` names it in reports)."""
        with self._lock:
            return self._channels.setdefault((name, members), Channel(members, label))

    def collective(
        self,
        channel: Channel,
        rank: int,
        call: tuple[str, Any, str],
        mine: Any,
        work: Callable[[list[Any]], str | None],
        result: Any = None,
    ) -> Any:
        """Rank ``rank``'s call on ``channel``'s group: ``call`` is ``(kind, agree, shown)``,
        the collective with its op and root, what every member must give alike (shapes,
        dtypes), and how a person reads this call; ``mine`` is what this rank gives. The last
        member to come runs ``work`` on every member's ``mine`` in group-rank order; what it
        returns, when not None, is the call's error on every member.

        Returns:
            A ``Work``, done once every member came (``wait()`` passes the baton until then).

        Raises:
            LocalMismatch: (from ``wait()``) a member called another collective at this place
                of the sequence, or disagrees on ``agree``.
        """
        kind, agree, shown = call
        members = channel.members
        me = members.index(rank)
        with self._lock:
            place = channel.next_call.get(me, 0)
            channel.next_call[me] = place + 1
            meeting = channel.meetings.setdefault(place, _Meeting(kind, agree, shown, rank))
            if meeting.error is None and (meeting.kind != kind or meeting.agree != agree):
                why = (
                    "the members of a group must call the same collectives in the same order (a real job "
                    "hangs or mixes the data)"
                    if meeting.kind.partition("[")[0] != kind.partition("[")[0]
                    else "the members must agree on the op, the root, the shapes and the dtypes (a real job "
                    "raises, hangs or reads the wrong memory)"
                )
                meeting.error = (
                    f"rank {rank} called {shown} as {channel.call_text(me, place)}, where rank "
                    f"{meeting.starter} called {meeting.shown}: {why}"
                )
                for r in members:
                    self.wake(r)
            meeting.data[me] = mine
            if len(meeting.data) == len(members) and meeting.error is None:
                meeting.error = work([meeting.data[i] for i in range(len(members))])
                meeting.done = meeting.error is None
                if meeting.done:
                    channel.meetings.pop(place, None)
                for r in members:
                    self.wake(r)
            what = f"{shown} ({channel.call_text(me, place)})"
        return _Pending(
            self, rank, what, lambda: meeting.done or meeting.error is not None, lambda: meeting.error, result
        )

    # ------------------------------------------------------------------ point to point
    def send(self, channel: Channel, src: int, dst: int, tag: int, tensor: torch.Tensor) -> Any:
        """Send a copy of ``tensor`` from ``src`` to ``dst`` on ``channel``'s group (messages
        of other groups, or other tags, never mix with it).

        Returns:
            A ``Work``, done once a ``recv`` took the message (gloo's ``send`` waits for it too:
            two ranks that both send first hang, here named).
        """
        message = _Message(tensor.detach().clone())
        key = (dst, src, tag)
        with self._lock:
            posted = channel.posted.get(key)
            if posted:
                self._deliver(message, posted.popleft(), src, dst)
            else:
                channel.mail.setdefault(key, deque()).append(message)
        what = f"its send to rank {dst} (tag {tag}) on the {channel.label()} to be received"
        return _Pending(self, src, what, lambda: message.taken, lambda: message.error, [tensor])

    def recv(self, channel: Channel, slot: Recv) -> Any:
        """Post ``slot`` on ``channel``'s group: filled at once from a message already sent,
        else when it comes.

        Returns:
            A ``Work``, done once the message came (``wait()`` passes the baton until then);
            it raises :class:`LocalMismatch` when the message has another shape or dtype.
        """
        key = (slot.dst, slot.src, slot.tag)
        with self._lock:
            mail = channel.mail.get(key)
            if mail:
                self._deliver(mail.popleft(), slot, slot.src, slot.dst)
            else:
                channel.posted.setdefault(key, deque()).append(slot)
        what = f"a message from rank {slot.src} (tag {slot.tag}) on the {channel.label()}"
        return _Pending(
            self, slot.dst, what, lambda: slot.done, lambda: slot.error, [slot.tensor], slot.src_group_rank
        )

    def _deliver(self, message: _Message, slot: Recv, src: int, dst: int) -> None:
        sent, into = message.tensor, slot.tensor
        if into.shape != sent.shape or into.dtype != sent.dtype:
            message.error = slot.error = (
                f"rank {dst} receives {tuple(into.shape)} {into.dtype} from rank {src}, which sent "
                f"{tuple(sent.shape)} {sent.dtype}: the sizes of a send and its recv must match"
            )
        else:
            into.detach().copy_(sent)
        message.taken = slot.done = True
        self.wake(src)
        self.wake(dst)


def put_environ(env: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``env``, touching only the variables that differ; returns None."""
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _take_rng() -> tuple[torch.Tensor, Any, Any]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _put_rng(rng: tuple[torch.Tensor, Any, Any]) -> None:
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    np.random.set_state(rng[2])


def _ranges(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"


class RankThread(threading.Thread):
    """The thread of one simulated rank of ``world``; ``context`` is the rank's own
    ``ParallelContext`` once its body made it (``gpc`` reads it in this thread)."""

    def __init__(self, world: LocalWorld, rank: int, target: Callable[[], Any]) -> None:
        super().__init__(name=f"parallelctx-local-rank-{rank}", target=target, daemon=True)
        self.world = world
        self.rank = rank
        self.context: Any = None


def keep_per_rank(owner: Any, *names: str) -> None:
    """In a local world, give every rank its own value of ``owner.<name>`` for each of ``names``
    (:meth:`LocalWorld.keep_per_rank`): for module-level state another library keeps once per
    process, which the ranks would otherwise share. Elsewhere (a real process is one rank) it
    does nothing. Returns None.

    Raises:
        AttributeError: ``owner`` has no attribute of one of ``names``.
    """
    thread = threading.current_thread()
    if isinstance(thread, RankThread):
        thread.world.keep_per_rank(owner, names)
