"""A world of N ranks as N threads of one process, with real numbers (issue 36).

Each simulated rank is a :class:`RankThread`; torch.distributed's world is made per thread
(torch's ``ThreadLocalWorld`` and its thread-isolated group registry, the pieces torch's own
threaded tests use), and every group is a :class:`LocalGroup` of the ``"local"`` backend, whose
collectives move the members' tensors inside the process.

The threads never run side by side: a baton (:class:`LocalWorld`) lets one rank run at a time
and passes on only where that rank must wait for others (a collective whose members have not
all come, a ``recv`` whose message was not sent). Every time the baton moves, the rank leaving
keeps the state of its default generators (torch's CPU generator, Python's ``random``, numpy's
global generator) and the rank taking it gets its own back, so each simulated rank draws what
the real process of that rank draws: ``torch.manual_seed``, ``torch.get_rng_state`` /
``set_rng_state``, ``torch.random.fork_rng``, gpc's per-mode streams and activation
checkpointing's recompute all act per rank. The order in which ranks run between waits does not
change a number: a collective is computed once every member has given its tensors, from all of
them in group-rank order.

When no rank can run and some wait, the job would hang: every waiting rank raises
:class:`LocalDeadlock`, which names each rank, what it waits for and on which group. Two
members that call different collectives in the same place of a group's sequence raise
:class:`LocalMismatch` on both. Sums over groups of more than two ranks are added in group-rank
order; gloo and NCCL add in their own order, so such sums may differ from a real run's in the
last bits (two ranks: the same bits).
"""

from __future__ import annotations

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
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]
from torch.futures import Future

__all__ = [
    "BACKEND",
    "LocalDeadlock",
    "LocalGroup",
    "LocalMismatch",
    "LocalWorld",
    "RankThread",
    "keep_per_rank",
    "register_backend",
]

# torch's stubs type these classes' methods by their C++ overloads; the Python overrides below
# are what torch.distributed's Python functions and its C++ trampolines call.
_ProcessGroup: Any = dist.ProcessGroup
_Work: Any = dist.Work

BACKEND = "local"
"""The name of the in-process backend."""
SHOWN = 8  # waiting ranks named in a report

_REDUCE: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    dist.ReduceOp.SUM: lambda s: s.sum(dim=0),
    dist.ReduceOp.PRODUCT: lambda s: s.prod(dim=0),
    dist.ReduceOp.MIN: lambda s: s.amin(dim=0),
    dist.ReduceOp.MAX: lambda s: s.amax(dim=0),
    dist.ReduceOp.AVG: lambda s: s.sum(dim=0) / s.shape[0],
}


class LocalDeadlock(RuntimeError):
    """No simulated rank can run and some wait: the real job would hang here."""


class LocalMismatch(RuntimeError):
    """Members of one group called different collectives at the same place of its sequence."""


def _reduce(tensors: Sequence[torch.Tensor], op: Any) -> torch.Tensor:
    op = getattr(op, "op", op)  # a ReduceOp holds its RedOpType
    if op not in _REDUCE:
        raise NotImplementedError(
            f"the local backend has no reduce op {op}; use SUM, AVG, PRODUCT, MIN or MAX"
        )
    if len(tensors) == 1:
        return tensors[0].clone()
    if op == dist.ReduceOp.SUM:  # left to right in group-rank order (two ranks: a + b, as gloo)
        out = tensors[0].clone()
        for t in tensors[1:]:
            out.add_(t)
        return out
    return _REDUCE[op](torch.stack(list(tensors)))


def _done_work(result: Any = None) -> Any:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class _Waiting(_Work):
    """The work of an ``irecv`` whose message has not come: ``wait()`` hands the baton on until
    it has."""

    def __init__(self, world: LocalWorld, rank: int, slot: _Recv) -> None:
        super().__init__()
        self._world, self._rank, self._slot = world, rank, slot

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._world.wait_until(self._rank, self._slot.describe, lambda: self._slot.done)
        return True

    def is_completed(self) -> bool:
        return self._slot.done

    def is_success(self) -> bool:
        return self._slot.done

    def _source_rank(self) -> int:
        return self._slot.src_group_rank

    def get_future(self) -> Future:
        self.wait()
        fut: Future = Future()
        fut.set_result([self._slot.tensor])
        return fut


@dataclass
class _Recv:
    """A posted receive: where the message goes, from whom, and whether it came."""

    tensor: torch.Tensor
    dst: int
    src: int
    src_group_rank: int
    tag: int
    members: tuple[int, ...]
    done: bool = False

    @property
    def describe(self) -> str:
        return f"recv from rank {self.src} (tag {self.tag}) on group {list(self.members)}"


@dataclass
class _Meeting:
    """One collective of one group: what each member gave, and the result once all came."""

    kind: str
    shown: str
    starter: int
    data: dict[int, Any] = field(default_factory=dict)
    done: bool = False
    error: str | None = None


@dataclass
class _Channel:
    """A group's shared state: its members and each member's place in its sequence of
    collectives."""

    members: tuple[int, ...]
    next_call: dict[int, int] = field(default_factory=dict)
    meetings: dict[int, _Meeting] = field(default_factory=dict)


_RNGSlot = tuple[torch.Tensor, Any, Any]


def _take_rng() -> _RNGSlot:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _put_rng(slot: _RNGSlot) -> None:
    torch.set_rng_state(slot[0])
    random.setstate(slot[1])
    np.random.set_state(slot[2])


@dataclass
class _Own:
    """What a rank keeps while another runs: its default generators and its values of the
    attributes kept per rank."""

    rng: _RNGSlot
    kept: dict[tuple[Any, str], Any]


class LocalWorld:
    """The shared state of one world of threads: the baton, each group's channel, the messages
    in flight, and each rank's default-generator states while it does not hold the baton."""

    def __init__(self, world_size: int) -> None:
        """A world of ``world_size`` ranks, none started.

        Raises:
            ValueError: ``world_size`` below 1.
        """
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        self.world_size = world_size
        self.store = dist.HashStore()
        self._lock = threading.Lock()
        self._turn = [threading.Event() for _ in range(world_size)]
        self._state = ["new"] * world_size  # new -> ready <-> waiting -> done
        self._waits: dict[int, str] = {}
        self._holder: int | None = None
        self._own: dict[int, _Own] = {}
        self._kept: dict[tuple[Any, str], Any] = {}  # attribute -> its value before any rank set it
        self._failure: str | None = None
        self._channels: dict[tuple[str, tuple[int, ...]], _Channel] = {}
        self._mail: dict[tuple[int, int, int], deque[torch.Tensor]] = {}
        self._posted: dict[tuple[int, int, int], deque[_Recv]] = {}
        self.finished: dict[int, BaseException | None] = {}
        self.abandoned = False

    # ------------------------------------------------------------------ the baton
    def enter(self, rank: int) -> None:
        """Rank ``rank``'s thread arrives; return once it holds the baton (rank 0 starts once
        every rank arrived), with its generator states in place.

        Raises:
            LocalDeadlock: the world failed before this rank got to run.
        """
        with self._lock:
            self._state[rank] = "ready"
            self._own[rank] = self._take()  # every thread starts from the process's state
            first = self._next_ready(self.world_size - 1)
            if all(s != "new" for s in self._state) and self._holder is None and first is not None:
                self._give(first)
        self._await(rank)

    def leave(self, rank: int, error: BaseException | None = None) -> None:
        """Rank ``rank`` is finished (``error``: what it raised); the baton passes on. Returns None."""
        with self._lock:
            self.finished[rank] = error
            self._state[rank] = "done"
            if self._holder == rank:
                self._pass(rank)

    def wait_until(self, rank: int, what: str, ready: Callable[[], bool]) -> None:
        """Hand the baton on until ``ready()`` (checked under the world's lock, made true by
        another rank's call, which wakes this one); ``what`` says what the rank waits for.
        Returns None.

        Raises:
            LocalDeadlock: no rank can run any more while this one waits.
        """
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

    def running(self) -> str:
        """Say which rank holds the baton and what the waiting ranks wait for."""
        with self._lock:
            holder = "no rank runs" if self._holder is None else f"rank {self._holder} runs"
            waits = [f"rank {r} waits for {w}" for r, w in sorted(self._waits.items())[:SHOWN]]
            more = len(self._waits) - len(waits)
            return "; ".join([holder, *waits] + ([f"{more} more ranks wait"] if more > 0 else []))

    def wake(self, rank: int) -> None:
        """Make a waiting rank ready to run again (caller holds the world's lock)."""
        if self._state[rank] == "waiting":
            self._state[rank] = "ready"
            self._waits.pop(rank, None)

    def _await(self, rank: int) -> None:
        self._turn[rank].wait()
        self._turn[rank].clear()
        with self._lock:
            if self._holder != rank:  # woken by a failure
                raise LocalDeadlock(self._failure or "the local world failed")
            self._put(self._own.pop(rank))

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
        return _Own(_take_rng(), {key: getattr(*key) for key in self._kept})

    def _put(self, own: _Own) -> None:
        _put_rng(own.rng)
        for key, first in self._kept.items():
            setattr(key[0], key[1], own.kept.get(key, first))

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
            lines.append(
                "ranks that raised: " + ", ".join(f"{r} ({type(e).__name__}: {e})" for r, e in raised.items())
            )
        if done:
            lines.append(f"ranks finished: {_ranges(done)}")
        self._failure = "no simulated rank can run: the real job would hang here; " + "; ".join(lines)
        for r in stuck:
            self._turn[r].set()

    def abandon(self, why: str) -> None:
        """Give the world up (the runner stopped waiting for it): every waiting rank raises
        :class:`LocalDeadlock` with ``why``, and so does every later wait. Returns None."""
        with self._lock:
            self.abandoned = True
            self._failure = why
            self._holder = None
            for turn in self._turn:
                turn.set()

    # ------------------------------------------------------------------ groups
    def channel(self, name: str, members: tuple[int, ...]) -> _Channel:
        """Return the shared state of the group ``name`` of ``members`` (made by the first member)."""
        with self._lock:
            return self._channels.setdefault((name, members), _Channel(members))

    def collective(
        self,
        channel: _Channel,
        rank: int,
        kind: str,
        shown: str,
        mine: Any,
        work: Callable[[list[Any]], None],
    ) -> Any:
        """Rank ``rank``'s call of collective ``kind`` on ``channel``'s group, giving ``mine``;
        the last member to come runs ``work`` on every member's value in group-rank order.

        Returns:
            A completed ``Work``.

        Raises:
            LocalMismatch: a member called another collective at this place of the sequence.
            LocalDeadlock: the members never all come.
        """
        members = channel.members
        me = members.index(rank)
        with self._lock:
            place = channel.next_call.get(me, 0)
            channel.next_call[me] = place + 1
            meeting = channel.meetings.setdefault(place, _Meeting(kind, shown, rank))
            if meeting.kind != kind and meeting.error is None:
                meeting.error = (
                    f"rank {rank} called {shown} as call {place + 1} on group {list(members)}, where "
                    f"rank {meeting.starter} called {meeting.shown}: the ranks of a group must call "
                    "the same collectives in the same order (a real job hangs or mixes the data)"
                )
                for r in members:
                    self.wake(r)
            meeting.data[me] = mine
            if len(meeting.data) == len(members) and meeting.error is None:
                work([meeting.data[i] for i in range(len(members))])
                meeting.done = True
                channel.meetings.pop(place, None)
                for r in members:
                    self.wake(r)
        what = f"{shown} (call {place + 1} on group {list(members)})"
        self.wait_until(rank, what, lambda: meeting.done or meeting.error is not None)
        if meeting.error is not None:
            raise LocalMismatch(meeting.error)
        return _done_work(mine)

    # ------------------------------------------------------------------ point to point
    def send(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> Any:
        """Deliver a copy of ``tensor`` from ``src`` to ``dst`` (buffered: it returns at once).
        Returns a completed ``Work``.

        Raises:
            ValueError: the receive posted for it has another shape or dtype.
        """
        message = tensor.detach().clone()
        key = (dst, src, tag)
        with self._lock:
            posted = self._posted.get(key)
            if posted:
                slot = posted.popleft()
                _fill(slot.tensor, message, src, dst)
                slot.done = True
                self.wake(dst)
            else:
                self._mail.setdefault(key, deque()).append(message)
        return _done_work([tensor])

    def recv(self, slot: _Recv) -> Any:
        """Post ``slot``: filled at once from a message already sent, else when it comes.

        Returns:
            A ``Work`` whose ``wait()`` hands the baton on until the message came.

        Raises:
            ValueError: the message has another shape or dtype.
        """
        key = (slot.dst, slot.src, slot.tag)
        with self._lock:
            mail = self._mail.get(key)
            if mail:
                _fill(slot.tensor, mail.popleft(), slot.src, slot.dst)
                slot.done = True
                return _done_work([slot.tensor])
            self._posted.setdefault(key, deque()).append(slot)
        return _Waiting(self, slot.dst, slot)


def _fill(into: torch.Tensor, message: torch.Tensor, src: int, dst: int) -> None:
    if into.shape != message.shape or into.dtype != message.dtype:
        raise ValueError(
            f"rank {dst} receives {tuple(into.shape)} {into.dtype} from rank {src}, which sent "
            f"{tuple(message.shape)} {message.dtype}: the sizes of a send and its recv must match"
        )
    into.detach().copy_(message)


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


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"the local backend has no {what}; run this code on real ranks (@pytest.mark.parallel "
        "without local=True, or parallelctx.spawn)"
    )


class LocalGroup(_ProcessGroup):
    """One member's handle of a group of the local backend (made by torch's ``new_group`` and
    ``init_process_group`` in a :class:`RankThread`)."""

    def __init__(self, world: LocalWorld, rank: int, members: tuple[int, ...], name: str) -> None:
        super().__init__(members.index(rank), len(members))
        self._world, self._rank_global, self._members = world, rank, members
        self._channel = world.channel(name, members)
        self._name = name

    @property
    def group_name(self) -> str:
        """The name torch registered the group under (DeviceMesh and functional collectives read
        it; torch's own groups take it from their C++ backend, which this group has none of)."""
        return self._name

    def getBackendName(self) -> str:
        return BACKEND

    def shutdown(self) -> None:
        """Nothing to close: returns None."""

    # ------------------------------------------------------------------ collectives
    def _call(
        self, kind: str, tensors: Sequence[torch.Tensor], mine: Any, work: Callable[[list[Any]], None]
    ) -> Any:
        shown = f"{kind}({', '.join(_shape(t) for t in tensors)})"
        return self._world.collective(self._channel, self._rank_global, kind, shown, mine, work)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def work(data: list[list[torch.Tensor]]) -> None:
            for i in range(len(data[0])):
                out = _reduce([d[i] for d in data], op)
                for d in data:
                    d[i].detach().copy_(out)

        return self._call("all_reduce", tensors, tensors, work)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0

        def work(data: list[list[torch.Tensor]]) -> None:
            for d in data:
                for t, s in zip(d, data[root]):
                    if t is not s:
                        t.detach().copy_(s)

        return self._call(f"broadcast[root {root}]", tensors, tensors, work)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        def work(data: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]) -> None:
            for outs, _ in data:
                for i, out in enumerate(outs):
                    for src, t in enumerate(out):
                        t.detach().copy_(data[src][1][i])

        return self._call("all_gather", inputs, (outputs, inputs), work)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        def work(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            for out, _ in data:
                out.detach().copy_(torch.cat([d[1].reshape(-1) for d in data]).view_as(out))

        return self._call("all_gather_into_tensor", [input], (output, input), work)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, inp in zip(outputs, inputs):
            self._allgather_base(out, inp, opts)
        return _done_work(outputs)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def work(data: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]) -> None:
            for me, (outs, _) in enumerate(data):
                for i, out in enumerate(outs):
                    out.detach().copy_(_reduce([d[1][i][me] for d in data], op))

        return self._call("reduce_scatter", outputs, (outputs, inputs), work)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        n = self.size()

        def work(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            for me, (out, _) in enumerate(data):
                parts = [d[1].reshape(n, -1)[me] for d in data]
                out.detach().copy_(_reduce(parts, op).view_as(out))

        return self._call("reduce_scatter_tensor", [input], (output, input), work)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, inp in zip(outputs, inputs):
            self._reduce_scatter_base(out, inp, opts)
        return _done_work(outputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        opts: Any = None,
    ) -> Any:
        n = self.size()

        def splits(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
            return list(torch.split(t, list(sizes) if sizes else [t.shape[0] // n] * n))

        def work(data: list[tuple[torch.Tensor, torch.Tensor, list[int], list[int]]]) -> None:
            sent = [splits(d[1], d[3]) for d in data]
            for me, (out, _, osz, _) in enumerate(data):
                for src, part in enumerate(splits(out, osz)):
                    part.detach().copy_(sent[src][me])

        return self._call("all_to_all_single", [input], (output, input, out_splits, in_splits), work)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        def work(data: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
            for me, (outs, _) in enumerate(data):
                for src, out in enumerate(outs):
                    out.detach().copy_(data[src][1][me])

        return self._call("all_to_all", inputs, (outputs, inputs), work)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0

        def work(data: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]) -> None:
            for src, t in enumerate(data[root][0][0] if data[root][0] else []):
                t.detach().copy_(data[src][1][0])

        return self._call(f"gather[root {root}]", inputs, (outputs, inputs), work)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0

        def work(data: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]) -> None:
            for me, (outs, _) in enumerate(data):
                outs[0].detach().copy_(data[root][1][0][me])

        return self._call(f"scatter[root {root}]", outputs, (outputs, inputs), work)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = opts.rootRank if opts is not None else 0
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def work(data: list[list[torch.Tensor]]) -> None:
            for i in range(len(data[0])):
                data[root][i].detach().copy_(_reduce([d[i] for d in data], op))

        return self._call(f"reduce[root {root}]", tensors, tensors, work)

    # torch.distributed's Python functions call these names; its C++ ops the ones above
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        for out, inp in zip(outputs, inputs):
            self.allgather([out], [inp], opts)
        return _done_work(outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        opts: Any = None,
    ) -> Any:
        return self.alltoall_base(output, input, out_splits, in_splits, opts)

    def barrier(self, opts: Any = None) -> Any:
        return self._call("barrier", [], None, lambda data: None)

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        return self._world.send(self._rank_global, self._members[dst], tag, tensors[0])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        slot = _Recv(tensors[0], self._rank_global, self._members[src], src, tag, self._members)
        return self._world.recv(slot)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise _unsupported("recv from any source (recv with src=None)")

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported("monitored_barrier (use barrier: a rank that never comes is named anyway)")


def _shape(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    return type(t).__name__


def _create(options: Any, backend_options: Any = None) -> LocalGroup:
    thread = threading.current_thread()
    if not isinstance(thread, RankThread):
        raise RuntimeError(
            "the 'local' backend serves only the ranks of parallelctx.run_local (and "
            "@pytest.mark.parallel(local=True)); this thread is not one"
        )
    members = tuple(int(r) for r in options.global_ranks_in_group) or tuple(range(thread.world.world_size))
    return LocalGroup(thread.world, thread.rank, members, str(options.group_id))


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


def register_backend() -> None:
    """Register the ``"local"`` backend with torch once per process; returns None."""
    if BACKEND.upper() not in dist.Backend.__dict__:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
