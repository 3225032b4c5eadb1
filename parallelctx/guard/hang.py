"""Hang reports: when a collective on one of gpc's groups waits too long, name the group, the
call and the ranks that never came (or came with another call), on every backend.

torch names nobody when a gloo collective times out (NCCL has its flight recorder; gloo and the
CPU twin groups have nothing). With ``dist.hang_report=dict(after=SECONDS)`` a launch starts a
:class:`HangWatch`:

* **Counting, on the hot path.** The collective methods of ``torch.distributed.ProcessGroup``
  that the ``torch.distributed`` functions call (``allreduce`` for ``all_reduce``, and so on)
  are wrapped while a watch runs (a ProcessGroup accepts no per-object attribute, so the class
  is wrapped and every other group passes straight through). For a watched group, a call
  counts itself and keeps a reference to its arguments and to the ``Work`` torch returns: a
  dict lookup, three attribute writes, no store, no string. Point-to-point calls
  (``ProcessGroup.send``/``recv``/``recv_anysource``, which ``send``, ``isend``, ``recv``,
  ``irecv`` and ``batch_isend_irecv`` call) are counted apart, per direction and peer, and
  reported with the peer (:meth:`HangWatch._report_p2p`). Torch's functional collectives
  (``torch.distributed._functional_collectives``, DTensor's redistributions and their backward
  passes), which reach the group in C++, are counted in the group's sequence as the
  ``torch.distributed`` collective they match (:mod:`parallelctx.guard.funcol`); such a call
  is pending only while its rank waits for its result (``wait_tensor``, which using the result
  calls), from the moment the wait began: a result waited for late (an overlap), or never, is
  no hang.
* **Watching, in one daemon thread** every ``after / 4`` seconds (0.05 s to 1 s): it posts this
  rank's progress (per group: the number of calls entered and the last call, worded as
  ``all_reduce(float32[4])``, and what every member must give alike in it where that is less)
  to the launch's store when it changed (one write per tick, off the hot path; a call is worded
  here, once, never on the hot path), and looks for the oldest call on a watched group that
  has not completed (``Work.is_completed()``; with ``async_op=True`` later calls wait behind
  it) ``after`` seconds after it was entered. For such a call it reads the other members' progress from the
  store, and makes a :class:`HangReport`: members that entered fewer calls are missing (read a
  second time two ticks later, since a member posts its progress a tick late at most; a call
  that completed meanwhile is not reported), members that entered as many but a different call
  are mismatched: another op, or the same op where what every member must give alike differs
  (an all-reduce's shape, a root; see :func:`_agreed_call`); calls that differ only in shapes
  a rank may choose alone (all-to-all splits, a gather's or scatter's root list, an uneven
  all-gather's input) are the same call. Members that entered more calls entered this one and
  are neither. The report is logged (once per call) and handed to every handler of
  ``gpc.on_hang``, in this thread (a handler may call ``gpc.abort()``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..planning.layout import ParallelMode
from .funcol import FunctionalCall, watch_functional
from .ledger import agreed_dims, tensor_words
from .patch import Patches

__all__ = ["OPS", "P2P_OPS", "HangReport", "HangWatch", "describe_call"]

logger = logging.getLogger("parallelctx")
_T = TypeVar("_T")

OPS: dict[str, str] = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all_single",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
}
"""``ProcessGroup`` method -> the ``torch.distributed`` function that calls it (the op named)."""

P2P_OPS: dict[str, str] = {"send": "send", "recv": "recv", "recv_anysource": "recv"}
"""``ProcessGroup`` point-to-point method -> its direction (``send``/``isend`` call ``send``,
``recv``/``irecv`` call ``recv`` or, from any source, ``recv_anysource``)."""


@dataclass(frozen=True)
class HangReport:
    """A collective on one of gpc's groups that has waited longer than ``dist.hang_report.after``.

    Attributes:
        mode: the parallel mode of the group (the first, in :class:`ParallelMode` order, of
            ``modes``).
        modes: every mode this group serves (modes with the same members share one group).
        cpu: True for the gloo CPU twin of the mode's group (``gpc.get_cpu_group``).
        op: the ``torch.distributed`` function, e.g. ``"all_reduce"``.
        call: the call with its tensors' dtypes and shapes, e.g. ``"all_reduce(float32[4])"``.
        count: which call this is on the group, on this rank (1 = the first since launch).
        rank: this process's global rank.
        ranks: the group's global ranks.
        missing: sorted global ranks of the group that have not entered this call.
        mismatched: global rank -> the call it entered instead (as many calls as this rank but
            another one: another op, or the same op with another dtype, another root or another
            shape where the op needs the same shape on every rank; shapes that may differ by
            rank, as all-to-all splits, a gather's or scatter's list on the root only and an
            uneven all-gather's input, make no mismatch; a rank that entered more calls entered
            this one and is not named).
        waited: seconds this rank has waited in the call.
        progress_known: False when the other ranks' progress could not be read from the store
            (``missing`` and ``mismatched`` are then empty).
        peer: for a point-to-point call (``op`` ``"send"`` or ``"recv"``; ``count`` counts this
            rank's calls of that direction with that peer), the peer's global rank (None: a
            receive from any rank); ``missing`` is ``(peer,)`` when the peer made fewer of the
            matching calls.
        peer_count: how many matching calls the peer made (sends to this rank for a receive,
            receives from it for a send), when read.
        peer_last: the peer's last point-to-point call and last collective on this group.
        where: global rank -> its place (``"pipeline stage 1, tensor rank 0"``) for this rank,
            the peer and the ranks of ``skipped``.
        flight_recorder: when torch's flight recorder is on (``TORCH_FR_BUFFER_SIZE``) and every
            member posted its numbers: global rank -> (last collective enqueued, last completed)
            on this group; ``missing`` then holds the members that enqueued fewer collectives
            than this rank.
        store_stalled: True when the progress could not be read because the launch's store did
            not answer within its bound (``max(1 s, after / 2)``).
        skipped: when the peer never made the matching call, the sends to the peer it did not
            receive: ``(sender, peer, sent, received)`` for each other member of the group that
            sent the peer more than the peer received from it (for a receive that waits: the
            receive the peer skipped one stage up, which holds the peer's own send back).

    :meth:`abort` aborts the launch that made the report, and nothing once it was destroyed.
    """

    mode: ParallelMode
    modes: tuple[ParallelMode, ...]
    cpu: bool
    op: str
    call: str
    count: int
    rank: int
    ranks: tuple[int, ...]
    missing: tuple[int, ...]
    mismatched: dict[int, str] = field(default_factory=dict)
    waited: float = 0.0
    progress_known: bool = True
    aborter: Callable[[], int] | None = field(default=None, repr=False, compare=False)
    peer: int | None = None
    peer_count: int | None = None
    peer_last: tuple[str, ...] = ()
    where: dict[int, str] = field(default_factory=dict)
    skipped: tuple[tuple[int, int, int, int], ...] = ()
    store_stalled: bool = False
    flight_recorder: dict[int, tuple[int, int]] = field(default_factory=dict)

    def abort(self) -> int:
        """Call ``gpc.abort()`` if the launch that made this report is still the current one
        (a handler that aborts later, from a timer, cannot hit the relaunch).

        Returns:
            What ``gpc.abort()`` returned, or 0 when that launch is gone. Never raises.
        """
        return self.aborter() if self.aborter is not None else 0

    def __str__(self) -> str:
        group = f"the {self.mode.value} group{' (CPU twin)' if self.cpu else ''} (ranks {_ranks(self.ranks)})"
        if self.op in P2P_OPS.values():
            return self._p2p_text(group)
        head = f"rank {self.rank} has waited {self.waited:.1f} s in {self.call}, call {self.count} on {group}"
        if not self.progress_known:
            return f"{head}; the other ranks' progress could not be read from the launch's store{self._stall}"
        parts = []
        if self.missing:
            parts.append(
                f"rank{'s' if len(self.missing) > 1 else ''} {_ranks(self.missing)} never entered it"
            )
        for r, other in sorted(self.mismatched.items()):
            parts.append(f"rank {r} entered a different call: {other} (mismatch)")
        text = f"{head}: " + (
            "; ".join(parts) if parts else "every rank entered it (it is slow, not missing)"
        )
        if self.flight_recorder:
            numbers = ", ".join(f"rank {r} {e}/{c}" for r, (e, c) in sorted(self.flight_recorder.items()))
            text += (
                f" (by torch's flight recorder, TORCH_FR_BUFFER_SIZE: collectives enqueued/completed "
                f"on this group: {numbers})"
            )
        return text

    @property
    def _stall(self) -> str:
        return (
            " (it did not answer in time: its server, on rank 0 or the torchrun agent, may be hung)"
            if self.store_stalled
            else ""
        )

    def _at(self, rank: int | None) -> str:
        place = self.where.get(rank) if rank is not None else None
        return f" ({place})" if place else ""

    def _p2p_text(self, group: str) -> str:
        send = self.op == "send"
        which = f"{'send' if send else 'receive'} {self.count} {'to' if send else 'from'} " + (
            "any rank" if self.peer is None else f"rank {self.peer}"
        )
        head = f"rank {self.rank}{self._at(self.rank)} has waited {self.waited:.1f} s in {self.call}, {which} on {group}"
        if self.peer is None:
            return f"{head}: no rank of the group has sent to it"
        if not self.progress_known or self.peer_count is None:
            return (
                f"{head}; rank {self.peer}'s progress could not be read from the launch's store{self._stall}"
            )
        theirs = (
            f"it {'received' if send else 'sent'} {self.peer_count} time{'s' if self.peer_count != 1 else ''} "
            f"{'from' if send else 'to'} rank {self.rank}; its last calls on this group: "
            + (", ".join(self.peer_last) if self.peer_last else "none")
        )
        if self.missing:
            text = f"{head}: rank {self.peer}{self._at(self.peer)} never {'received' if send else 'sent'} it ({theirs})"
            for sender, peer, sent, got in self.skipped:
                text += (
                    f"; rank {sender}{self._at(sender)} sent {sent} times to rank {peer}, which received "
                    f"{got}: rank {peer} skipped a receive from rank {sender}"
                )
            return text
        return f"{head}: rank {self.peer}{self._at(self.peer)} made the matching call ({theirs}); it is slow, not missing"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


_ROOTS: dict[str, str] = {"broadcast": "src", "scatter": "src", "reduce": "dst", "gather": "dst"}
"""The ops that have a root -> torch's keyword for it."""


def _root_text(op: str, args: Sequence[Any], ranks: Sequence[int] | None) -> str | None:
    """``src=5`` (``dst=5``) for a call with a root: its global rank where ``ranks`` (the group's
    global ranks in group-rank order) has it, else ``group_src=1``; None for other calls."""
    keyword = _ROOTS.get(op)
    root = next((a.rootRank for a in reversed(args) if hasattr(a, "rootRank")), None)
    if keyword is None or not isinstance(root, int):
        return None
    if ranks is not None and 0 <= root < len(ranks):
        return f"{keyword}={ranks[root]}"
    return f"group_{keyword}={root}"


def _worded(op: str, values: Sequence[Any], root: str | None, dims: str = "all") -> str:
    texts = [t for t in (tensor_words(v, dims) for v in values) if t is not None]
    return f"{op}({', '.join([*texts, *([root] if root else [])])})"


def describe_call(op: str, args: Sequence[Any], ranks: Sequence[int] | None = None) -> str:
    """Word a collective call: ``op``, its tensor arguments' dtypes and shapes and its root, e.g.
    ``"all_reduce(float32[4])"``, ``"all_gather(8 x float32[2], float32[2])"`` or
    ``"broadcast(float32[3], src=1)"``. ``args`` are those of the ``ProcessGroup`` method;
    ``ranks``, the group's global ranks in group-rank order, names a root by its global rank
    (without it, ``group_src=``/``group_dst=`` names its group rank).

    Returns:
        The wording. Never raises.
    """
    try:
        return _worded(op, args, _root_text(op, args, ranks))
    except Exception:  # a describing error must never hide the report
        return f"{op}()"


_PG_TENSOR: dict[str, int] = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather_into_tensor": 1,
                               "reduce_scatter_tensor": 1, "all_to_all_single": 1, "all_to_all": 1,
                               "gather": 1, "scatter": 0, "all_gather": 0, "reduce_scatter": 1}  # fmt: skip
"""The op -> where the ``ProcessGroup`` method takes the tensor of :data:`~parallelctx.guard.ledger.AGREED_TENSOR`."""


def _agreed_call(op: str, args: Sequence[Any], ranks: Sequence[int] | None = None) -> str:
    """What every member of the group must give alike in this call, worded as
    :func:`describe_call` words the call: the op, the root and the tensor and as much of its
    shape as :data:`parallelctx.guard.ledger.AGREED` (the dry run's policy too) says every
    member must give alike. Two members whose calls at the same count differ here entered
    different calls; calls that differ only in what is left out are the same call. ``args``
    are those of the ``ProcessGroup`` method.

    Returns:
        The wording. Never raises.
    """
    try:
        root = _root_text(op, args, ranks)
        index = _PG_TENSOR.get(op)
        split = op == "all_to_all_single" and len(args) >= 4 and bool(args[2] or args[3])
        dims = agreed_dims(op, split)
        if dims is None or index is None or len(args) <= index:
            return _worded(op, args, root)
        return _worded(op, [args[index]], root, dims)
    except Exception:  # a describing error must never hide the report
        return f"{op}()"


class _Slot:
    """One watched process group: its calls (written by the collective's thread)."""

    __slots__ = ("call", "calls", "count", "cpu", "key", "modes", "order", "p2p", "p2p_calls", "p2p_last",
                 "p2p_reported", "p2p_words", "ranks", "reported", "words")  # fmt: skip

    def __init__(
        self,
        key: str,
        modes: tuple[ParallelMode, ...],
        cpu: bool,
        ranks: tuple[int, ...],
        order: tuple[int, ...],
    ) -> None:
        self.key, self.modes, self.cpu, self.ranks = key, modes, cpu, ranks
        self.order = order  # the global ranks in group-rank order (a root's rank -> global)
        self.count = 0
        # A call: [count, op, args, entered, Work] (the Work None while torch has not returned it).
        self.call: list[Any] | None = None  # the last call
        # The calls not known to be complete, oldest first (several with async_op=True): the
        # hot path drops the completed ones at its head; the watching thread only reads it.
        self.calls: deque[list[Any]] = deque()
        self.reported = 0  # the count last reported
        # The watching thread's wording of a call: (call, describe_call, _agreed_call), so
        # a call is worded once however many ticks it stays the last.
        self.words: tuple[list[Any] | None, str, str] = (None, "", "")
        # Point-to-point: calls per "send <group rank>" / "recv <group rank>" / "recv any", and
        # the pending ones ([count, direction, args, entered, Work, peer's group rank or None]).
        self.p2p: dict[str, int] = {}
        self.p2p_calls: deque[list[Any]] = deque()
        self.p2p_last: list[Any] | None = None
        self.p2p_reported: list[Any] | None = None
        self.p2p_words: tuple[list[Any] | None, str] = (None, "")

    def p2p_worded(self, call: list[Any]) -> str:
        """``call``'s wording, ``recv(float32[4, 8] from rank 5)`` (watching thread)."""
        last, text = self.p2p_words
        if last is not call:
            peer = call[5]
            other = (
                "any rank" if peer is None else f"rank {self.order[peer] if peer < len(self.order) else peer}"
            )
            tensors = tensor_words(call[2][0]) if call[2] else None
            text = f"{call[1]}({tensors or ''} {'to' if call[1] == 'send' else 'from'} {other})"
            self.p2p_words = (call, text)
        return text

    def worded(self, call: list[Any]) -> tuple[str, str]:
        """``call``'s wording and what every member must give alike in it (watching thread)."""
        last, text, agreed = self.words
        if last is not call:
            text = describe_call(call[1], call[2], self.order)
            agreed = _agreed_call(call[1], call[2], self.order)
            self.words = (call, text, agreed)
        return text, agreed

    def oldest_pending(self, p2p: bool = False) -> list[Any] | None:
        """The oldest collective (``p2p``: point-to-point call) of this group that has not
        completed, or None (any thread)."""
        calls = self.p2p_calls if p2p else self.calls
        for _ in range(3):
            try:
                return next((c for c in tuple(calls) if _pending(c[4])), None)
            except RuntimeError:  # the hot path changed the deque while it was copied
                continue
        return None


_DONE = object()  # stands for the Work of a call that raised or gave none


def _wrap(name: str, original: Callable[..., Any], slots: Mapping[Any, _Slot]) -> Callable[..., Any]:
    op = OPS[name]
    clock = time.monotonic

    def collective(self: Any, *args: Any, **kwargs: Any) -> Any:
        slot = slots.get(self)
        if slot is None:
            return original(self, *args, **kwargs)
        calls = slot.calls
        while calls and not _pending(calls[0][4]):
            calls.popleft()  # completed: one is_completed() per call when calls are waited for
        slot.count = count = slot.count + 1
        slot.call = call = [count, op, args, clock(), None]
        calls.append(call)
        return _entered(call, original, self, args, kwargs)

    return _named(collective, name, original)


def _entered(call: list[Any], original: Callable[..., Any], pg: Any, args: Any, kwargs: Any) -> Any:
    """Run torch's ``original`` method and keep the ``Work`` it returns in ``call`` (``_DONE``
    when it raised or gave none: a coalesced call has nothing to wait for); return the Work."""
    try:
        work = original(pg, *args, **kwargs)
    except BaseException:
        call[4] = _DONE
        raise
    call[4] = _DONE if work is None else work
    return work


def _named(wrapper: Callable[..., Any], name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper.__doc__ = getattr(original, "__doc__", None)
    return wrapper


def _wrap_p2p(name: str, original: Callable[..., Any], slots: Mapping[Any, _Slot]) -> Callable[..., Any]:
    direction = P2P_OPS[name]
    clock = time.monotonic

    def p2p(self: Any, *args: Any, **kwargs: Any) -> Any:
        slot = slots.get(self)
        if slot is None:
            return original(self, *args, **kwargs)
        peer = args[1] if name != "recv_anysource" and len(args) > 1 else None
        key = f"{direction} {'any' if peer is None else peer}"
        calls = slot.p2p_calls
        while calls and not _pending(calls[0][4]):
            calls.popleft()
        slot.p2p[key] = count = slot.p2p.get(key, 0) + 1
        slot.p2p_last = call = [count, direction, args, clock(), None, peer]
        calls.append(call)
        return _entered(call, original, self, args, kwargs)

    return _named(p2p, name, original)


def _order(group: Any, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The global ranks of ``group`` in group-rank order (torch's own record of the group), or
    ``ranks`` where torch has none for it."""
    try:
        return tuple(dist.get_process_group_ranks(group))
    except Exception:
        return ranks


class _Waited:
    """The ``Work`` of a functional collective, which torch keeps in C++. Such a call counts as
    pending only while its rank waits for it (``wait_tensor``, which using the result calls):
    a result waited for late, or never, is no hang of this rank."""

    __slots__ = ("call", "slot", "waiting")

    def __init__(self, slot: _Slot, call: list[Any]) -> None:
        self.slot, self.call = slot, call
        self.waiting = False

    def is_completed(self) -> bool:
        return not self.waiting


def _storage(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:
        return -1


def _pending(work: Any) -> bool:
    if work is _DONE:
        return False
    if work is None:
        return True
    try:
        return not work.is_completed()
    except Exception:
        return False


def flight_recorder(names: dict[str, str]) -> dict[str, tuple[int, int]] | None:
    """Torch's flight recorder's sequence numbers per process group name (``group_name``):
    (last collective enqueued, last completed). The recorder keys its numbers by its own id of
    a group; ``names`` (id -> group name) caches what its entries said, and is filled from them
    when an id is new.

    Returns:
        The numbers of the groups whose name is known, or None when the recorder is off
        (``TORCH_FR_BUFFER_SIZE`` unset or 0) or could not be read. Never raises.
    """
    try:
        if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0:
            return None
        dump_trace = getattr(torch._C._distributed_c10d, "_dump_fr_trace")  # noqa: B009 - private, torch 2.13
        status = pickle.loads(dump_trace(includeCollectives=False, includeStackTraces=False)).get(
            "pg_status", {}
        )
        if any(str(pg) not in names for pg in status):
            for entry in pickle.loads(dump_trace(includeStackTraces=False)).get("entries", []):
                names.setdefault(str(entry["pg_id"]), str(entry["process_group"][0]))
        return {
            names[str(pg)]: (
                int(v.get("last_enqueued_collective", -1)),
                int(v.get("last_completed_collective", -1)),
            )
            for pg, v in status.items()
            if str(pg) in names
        }
    except Exception:
        return None


class StoreStalled(TimeoutError):
    """The launch's store did not answer the hang report within its bound."""


class _BoundedStore:
    """The watch's store requests, made in a helper thread and awaited at most ``wait`` seconds
    each, so that a stalled store (its server hung, or a network partition) never stops the
    watch: a request that does not finish in time raises :class:`StoreStalled`, and the next
    ones wait behind it (they stall as well until the store answers again). With ``clone``, the
    helper thread first makes a connection of its own (``store.clone()``; ``store`` itself when
    it has none), so that no caller waits for it: a new connection can take the resolver's
    timeout (docs/performance.md), and the launch that starts the watch must not."""

    def __init__(self, store: Any, wait: float, clone: bool = False) -> None:
        self.store, self.wait = store, wait
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self.pending = 0  # requests queued or running (the helper thread ends one at a time)
        self._lock = threading.Lock()
        if clone:
            self.pending = 1
            self._jobs.put((self._clone, {}, threading.Event()))
        self._thread = threading.Thread(target=self._serve, name="parallelctx-hang-store", daemon=True)
        self._thread.start()

    def _clone(self) -> None:
        try:
            self.store = self.store.clone()
        except Exception:
            pass  # no connection of its own (a FileStore, a HashStore): share the launch's

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the waiting thread
                box["error"] = exc
            with self._lock:
                self.pending -= 1
            done.set()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (store requests) in the helper thread; return what it returns.

        Raises:
            StoreStalled: it did not finish within ``wait`` seconds.
            Exception: what ``fn`` raised.
        """
        with self._lock:
            if self.pending:  # a request that stalled is still running: do not queue behind it
                raise StoreStalled(f"the launch's store did not answer within {self.wait:g} s")
            self.pending += 1
        box: dict[str, Any] = {}
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(self.wait):
            raise StoreStalled(f"the launch's store did not answer within {self.wait:g} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def set(self, key: str, value: str) -> None:
        """Post ``value`` under ``key``; raises as :meth:`call`."""
        self.call(lambda: self.store.set(key, value))

    def read(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The values of those of ``keys`` the store holds, in one bounded wait; raises as
        :meth:`call`."""
        return self.call(lambda: {k: self.store.get(k) for k in keys if self.store.check([k])})

    def close(self) -> None:
        """Let the helper thread end once its current request returns; returns None."""
        self._jobs.put(None)


class HangWatch:
    """The hang report of one launch: counts calls on the given groups and reports a call that
    waited longer than ``after`` (see the module docstring). :meth:`start` and :meth:`stop`;
    ``gpc`` owns one per launch."""

    def __init__(
        self,
        after: timedelta,
        rank: int,
        store: Any,
        groups: Sequence[tuple[Any, tuple[ParallelMode, ...], bool, tuple[int, ...]]],
        handlers: Sequence[Callable[[HangReport], Any]],
        log: bool = True,
        aborter: Callable[[], int] | None = None,
        where: Callable[[int], str] | None = None,
        store_wait: timedelta = timedelta(seconds=10),
        clone: bool = False,
    ) -> None:
        self.after = after.total_seconds()
        self.store_wait = store_wait.total_seconds()  # a report reads a silent store again this long
        self._where = where
        self.tick = min(max(self.after / 4, 0.05), 1.0)
        self.rank = rank
        self.log = log
        self._store = _BoundedStore(store, max(1.0, 2 * self.tick), clone)
        self._stalled = False  # the store did not answer the last post (logged once a stall)
        self._read_stalled = False  # the last failed read of the progress timed out (not refused)
        self._fr_names: dict[str, str] = {}  # the flight recorder's id of a group -> its name
        self._handlers = handlers
        self._aborter = aborter
        self._slots: dict[Any, _Slot] = {}
        for group, modes, cpu, ranks in groups:
            if group is not None and group not in self._slots and len(ranks) > 1:
                self._slots[group] = _Slot(str(group.group_name), modes, cpu, ranks, _order(group, ranks))
        self._patches = Patches()
        self._waits: dict[int, list[_Waited]] = {}  # a functional result's storage -> its calls
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reports: list[HangReport] = []

    def start(self) -> None:
        """Wrap the collective methods and start the watching thread; returns None."""
        pg = dist.ProcessGroup
        for name in OPS:
            if name in vars(pg):
                self._patches.replace(pg, name, functools.partial(_wrap, name, slots=self._slots))
        for name in P2P_OPS:
            if name in vars(pg):
                self._patches.replace(pg, name, functools.partial(_wrap_p2p, name, slots=self._slots))
        watch_functional(self._patches, self._functional, self._waiting)
        self._thread = threading.Thread(target=self._run, name="parallelctx-hang-report", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread (waiting at most ``timeout`` s) and restore the methods wrapped by
        :meth:`start` (a method someone wrapped again since is left alone); returns None."""
        self._stop.set()
        self._patches.restore()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._store.close()
        if thread is None or not thread.is_alive():
            # the groups and the abort closure go now, not at the next garbage collection
            self._slots.clear()
            self._waits.clear()
            self._aborter = None

    def _functional(self, fc: FunctionalCall) -> None:
        """Count a functional collective on a watched group (the calling thread, once the op
        returned: it only enqueued the collective). It joins the group's pending calls when its
        rank starts to wait for it (:meth:`_waiting`)."""
        slot = self._slots.get(fc.group)
        if slot is None:
            return
        slot.count = count = slot.count + 1
        call: list[Any] = [count, fc.op, fc.shapes(), time.monotonic(), None]
        call[4] = work = _Waited(slot, call)
        slot.call = call
        waits = self._waits
        while len(waits) > 4096:  # results never waited for (torch warns of them at exit)
            del waits[next(iter(waits))]
        for tensor in fc.outputs:
            waits.setdefault(_storage(tensor), []).append(work)

    def _waiting(self, tensor: torch.Tensor, start: bool) -> None:
        """This rank starts (``start``) or ends a wait for a functional collective's result:
        its calls on that storage are pending while it waits, from the moment it began."""
        if not self._waits:
            return
        key = _storage(tensor)
        if start:
            now = time.monotonic()
            for work in self._waits.get(key, ()):
                if not work.waiting:  # a second thread waiting for it adds nothing
                    work.waiting = True
                    work.call[3] = now
                    work.slot.calls.append(work.call)
            return
        for work in self._waits.pop(key, ()):
            work.waiting = False

    # ------------------------------------------------------------------ the thread    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        posted: dict[str, Any] | None = None
        while not self._stop.wait(self.tick):
            try:
                progress = self._progress()
                if progress != posted:
                    self._store.set(f"hang/{self.rank}", json.dumps(progress))
                    posted = progress
                self._stalled = False
            except StoreStalled as exc:  # reports still name the call, and say the store stalled
                posted = None
                if not self._stalled and self.log:
                    logger.warning(
                        "parallelctx hang report: rank %d: %s; the other ranks' progress cannot be "
                        "read until it does (its server, on rank 0 or the torchrun agent, may be hung)",
                        self.rank,
                        exc,
                    )
                self._stalled = True
            except Exception:  # the store is gone: reports still name the call
                posted = None
            now = time.monotonic()
            for slot in list(self._slots.values()):
                call = slot.oldest_pending()  # with async_op=True, later calls wait behind it
                if call is None or slot.reported >= call[0]:
                    continue
                if now - call[3] >= self.after:
                    slot.reported = call[0]
                    self._report(slot, call, now - call[3])
            for slot in list(self._slots.values()):
                call = slot.oldest_pending(p2p=True)
                if call is not None and slot.p2p_reported is not call and now - call[3] >= self.after:
                    slot.p2p_reported = call
                    self._report_p2p(slot, call, now - call[3])

    def _progress(self) -> dict[str, Any]:
        """Per group: [calls entered, the last call's wording], and what every member must give
        alike in it where that differs from the wording (see :func:`_agreed_call`)."""
        out: dict[str, Any] = {}
        recorded = flight_recorder(self._fr_names)
        if recorded is not None:
            out["fr"] = True  # the recorder is on here (a group it has no entry for made no collective)
        for slot in self._slots.values():
            if recorded is not None and slot.key in recorded:
                out[slot.key + "/fr"] = list(recorded[slot.key])
            call = slot.call
            if call is not None:
                text, agreed = slot.worded(call)
                out[slot.key] = [call[0], text] if agreed == text else [call[0], text, agreed]
            if slot.p2p_last is not None:
                out[slot.key + "/p2p"] = [dict(slot.p2p), slot.p2p_worded(slot.p2p_last)]
        return out

    def _peers(
        self, slot: _Slot, recorded: dict[int, tuple[int, int]] | None = None
    ) -> dict[int, tuple[int, str, str]] | None:
        """Each other member's (calls entered, last call, what must agree in it) on ``slot``'s
        group, from the store (and into ``recorded`` its flight recorder's numbers on the group,
        where it posted them); None when the store could not be read."""
        out: dict[int, tuple[int, str, str]] = {}
        try:
            posted = self._store.read([f"hang/{r}" for r in slot.ranks if r != self.rank])
            for r in slot.ranks:
                if r == self.rank:
                    continue
                key = f"hang/{r}"
                progress = json.loads(posted[key]) if key in posted else {}
                entry = progress.get(slot.key)
                if recorded is not None and progress.get("fr"):
                    enqueued, completed = progress.get(slot.key + "/fr", (0, 0))
                    recorded[r] = (int(enqueued), int(completed))
                if entry:
                    out[r] = (int(entry[0]), str(entry[1]), str(entry[2] if len(entry) > 2 else entry[1]))
                else:
                    out[r] = (0, "", "")
        except StoreStalled:
            self._stalled = self._read_stalled = True
            return None
        except Exception:
            self._read_stalled = False  # refused, not slow: reading again would not help
            return None
        return out

    def _recorded(self, slot: _Slot, peers: Any) -> dict[int, tuple[int, int]]:
        """Every member's flight-recorder numbers on ``slot``'s group (this rank's read now),
        or {} unless the recorder is on and every member posted them."""
        own = flight_recorder(self._fr_names)
        if own is None or peers is None or slot.key not in own:
            return {}  # off, or it has no entry of this group: the counts speak
        recorded: dict[int, tuple[int, int]] = {self.rank: own[slot.key]}
        if self._peers(slot, recorded) is None or len(recorded) < len(slot.ranks):
            return {}
        return recorded

    def _patiently(self, read: Callable[[], _T | None], call: list[Any]) -> tuple[_T | None, bool]:
        """``read()``, and while it gives None because the store did not answer in time (a
        loaded host's store is slow, not gone; a store that refuses is not read again) again
        each tick for up to ``store_wait`` seconds more; returns (what it read last, whether
        the watch stopped or ``call`` completed meanwhile: then no report)."""
        got = read()
        deadline = time.monotonic() + self.store_wait
        while got is None and self._read_stalled and time.monotonic() < deadline:
            if self._stop.wait(self.tick) or not _pending(call[4]):
                return None, True
            got = read()
        return got, False

    def _report(self, slot: _Slot, call: list[Any], waited: float) -> None:
        count, op = call[0], call[1]
        text, agreed = slot.worded(call)
        peers, gone = self._patiently(lambda: self._peers(slot), call)
        if gone:
            return
        if peers is not None and any(theirs < count for theirs, _, _ in peers.values()):
            # A member's watch posts its progress once a tick, so one that entered this call
            # less than a tick ago reads as behind. Read again two ticks later: a member that had
            # entered the call by the first read is then never named missing (one that enters
            # later, a straggler, can be: its post may come after the second read). A call
            # that completed meanwhile was slow, not hung: it is not reported.
            if self._stop.wait(2 * self.tick) or not _pending(call[4]):
                return
            peers, gone = self._patiently(lambda: self._peers(slot), call)
            if gone:
                return
        waited = max(waited, time.monotonic() - call[3])
        missing: list[int] = []
        mismatched: dict[int, str] = {}
        for r, (theirs, last, their_agreed) in (peers or {}).items():
            if theirs < count:
                missing.append(r)
            elif theirs == count and their_agreed != agreed:
                # Another call: another op, or what every member must give alike differs (a
                # shape of an all-reduce, a root). Shapes a rank may choose alone (all-to-all
                # splits, a gather's root list, an uneven all-gather's input) are no mismatch.
                mismatched[r] = last
            # More calls: it entered this one and went on (async_op=True, or a broadcast's
            # root); its call number `count` is not posted, so it is not called a mismatch.
        recorded = self._recorded(slot, peers)
        if recorded:  # torch's own sequence numbers: a member that enqueued fewer is missing
            mine = recorded[self.rank][0]
            missing = [r for r in slot.ranks if r != self.rank and recorded[r][0] < mine]
        report = HangReport(
            mode=slot.modes[0],
            modes=slot.modes,
            cpu=slot.cpu,
            op=op,
            call=text,
            count=count,
            rank=self.rank,
            ranks=slot.ranks,
            missing=tuple(sorted(missing)),
            mismatched=mismatched,
            waited=waited,
            progress_known=peers is not None,
            store_stalled=peers is None and self._stalled,
            flight_recorder=recorded,
            aborter=self._aborter,
        )
        self._emit(report)

    def _emit(self, report: HangReport) -> None:
        self.reports.append(report)
        if self.log:
            logger.warning("parallelctx hang report: %s", report)
        for handler in list(self._handlers):
            try:
                handler(report)
            except Exception:
                logger.exception("parallelctx: hang report handler %r failed", handler)

    def _read(self, rank: int) -> dict[str, Any] | None:
        """``rank``'s posted progress ({} before its first post); None when the store fails."""
        key = f"hang/{rank}"
        try:
            posted = self._store.read([key])
            return json.loads(posted[key]) if key in posted else {}
        except StoreStalled:
            self._stalled = self._read_stalled = True
            return None
        except Exception:
            self._read_stalled = False
            return None

    def _peer_p2p(self, slot: _Slot, call: list[Any]) -> tuple[int, tuple[str, ...], dict[str, int]] | None:
        """The peer's count of the calls matching ``call`` (its sends to this rank for a
        receive, its receives from this rank for a send), its last point-to-point call and last
        collective on the group, and all its point-to-point counts; None when the store could
        not be read."""
        mine = slot.order.index(self.rank) if self.rank in slot.order else self.rank
        entry = self._read(slot.order[call[5]])
        if entry is None:
            return None
        counts, last_p2p = entry.get(slot.key + "/p2p", [{}, ""])
        other = "send" if call[1] == "recv" else "recv"
        theirs = int(counts.get(f"{other} {mine}", 0))
        if other == "recv":
            theirs += int(counts.get("recv any", 0))
        collective = entry.get(slot.key)
        return theirs, tuple(t for t in (last_p2p, collective[1] if collective else "") if t), counts

    def _skipped(
        self, slot: _Slot, peer_local: int, counts: Mapping[str, int], send_side: bool
    ) -> tuple[tuple[int, int, int, int], ...]:
        """The members that sent the peer (group rank ``peer_local``, its counts ``counts``)
        more than it received from them: (sender, peer, sent, received); this rank is left out
        when it is the sender whose send waits (``send_side``: the report says so already)."""
        out = []
        peer = slot.order[peer_local]
        for local, member in enumerate(slot.order):
            if member == peer or (member == self.rank and send_side):
                continue
            entry = (
                dict(slot.p2p)
                if member == self.rank
                else (self._read(member) or {}).get(slot.key + "/p2p", [{}])[0]
            )
            sent = int(entry.get(f"send {peer_local}", 0))
            got = int(counts.get(f"recv {local}", 0))
            if sent > got:
                out.append((member, peer, sent, got))
        return tuple(out)

    def _report_p2p(self, slot: _Slot, call: list[Any], waited: float) -> None:
        count, direction, peer_local = call[0], call[1], call[5]
        peer = None if peer_local is None else slot.order[peer_local]
        got, gone = (
            (None, False) if peer is None else self._patiently(lambda: self._peer_p2p(slot, call), call)
        )
        if gone:
            return
        if got is not None and got[0] < count:
            # as for a collective: the peer posts its progress a tick late at most
            if self._stop.wait(2 * self.tick) or not _pending(call[4]):
                return
            got, gone = self._patiently(lambda: self._peer_p2p(slot, call), call)
            if gone:
                return
        waited = max(waited, time.monotonic() - call[3])
        missing = peer is not None and got is not None and got[0] < count
        skipped = (
            self._skipped(slot, peer_local, got[2], direction == "send")
            if missing and got is not None
            else ()
        )
        where = {}
        if self._where is not None:
            for r in (self.rank, peer, *(s[0] for s in skipped)):
                if r is not None:
                    try:
                        where[r] = self._where(r)
                    except Exception:
                        pass
        self._emit(
            HangReport(
                mode=slot.modes[0],
                modes=slot.modes,
                cpu=slot.cpu,
                op=direction,
                call=slot.p2p_worded(call),
                count=count,
                rank=self.rank,
                ranks=slot.ranks,
                missing=(peer,) if missing and peer is not None else (),
                waited=waited,
                progress_known=peer is None or got is not None,
                store_stalled=peer is not None and got is None and self._stalled,
                aborter=self._aborter,
                peer=peer,
                peer_count=None if got is None else got[0],
                peer_last=() if got is None else got[1],
                where=where,
                skipped=skipped,
            )
        )
