"""The one guard of a process's launches: every group parallelctx made, held from the moment it
exists, and what ``gpc.abort()`` and the hang report need.

The group maker (:mod:`parallelctx.runtime.groups`) reads the free descriptor slots before each
``new_group`` and hands the group to :meth:`Guard.hold` right after, so an abort from another
thread finds a group while the launch that made it is still running, before ``gpc`` has adopted
anything. What each gloo group's creation opened is noted then, once (a ``fstat`` a slot); its
event loop (:class:`~parallelctx.guard.sockets.GlooLoop`) is found among those descriptors the
first time an abort or a teardown needs it, so the launch does not pay for it.
:meth:`Guard.abort` reaches each group's connections through the loop and never scans the
process's descriptors. ``gpc`` keeps one guard for the life of the process: the hang report's
handlers and the abort flag outlive ``destroy()``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..planning.layout import ParallelMode
from .abort import abort_groups, wake
from .hang import HangReport, HangWatch
from .sockets import FdSlots, GlooLoop, Opened

__all__ = ["Guard", "Held"]

logger = logging.getLogger("parallelctx")


@dataclass(frozen=True)
class Held:
    """One group the guard holds: the process group, this rank's index in it and its size, and
    the descriptors its creation opened, among which its gloo event loop is found when first
    needed (None for a group of another backend)."""

    group: Any
    rank: int
    size: int
    opened: Opened | None


class Guard:
    """Every group parallelctx made in this process, held from the moment it exists, with
    what :meth:`abort` and the hang report need. Thread-safe: :meth:`abort` may run in any
    thread (a watchdog) while a launch makes groups."""

    def __init__(self) -> None:
        #: Set by :meth:`abort`: a launch under way stops at its next call to its store
        #: (:class:`parallelctx.guard.abort.AbortableStore`); cleared by :meth:`begin`.
        self.aborted = threading.Event()
        # abort() and a teardown never overlap (a watchdog's abort may still be shutting down
        # connections when the main thread, its collective ended, destroys the groups).
        self._lock = threading.RLock()
        self._held: dict[int, Held] = {}
        self._loops: dict[int, tuple[GlooLoop, ...]] = {}  # a held group's loops, once looked for
        # Listener inodes of every loop seen in a held group's note, kept for the process's life:
        # each was alive before any group made after it, so it is never a later group's
        self._seen: set[int] = set()
        self._handlers: list[Callable[[HangReport], Any]] = []
        self._watch: HangWatch | None = None
        # What else an abort ends: the launch's own store connection while a launch waits
        # inside torch (set by the meeting, runtime/bell.py), else None.
        self.cut: Callable[[], Any] | None = None

    # ------------------------------------------------------------------ groups
    def begin(self) -> None:
        """A launch starts: an abort from now on stops it (clears :attr:`aborted`)."""
        self.aborted.clear()

    def hold(self, group: Any, slots: FdSlots | None = None) -> Held | None:
        """Hold ``group`` (a process group just made; anything else is ignored) until
        :meth:`release`; ``slots`` (read just before it was made) find its gloo event loop.

        Returns:
            What is held, or None for a value that is no process group.
        """
        if not isinstance(group, dist.ProcessGroup):
            return None
        size = group.size()
        opened = slots.opened() if slots is not None and _is_gloo(group) else None
        held = Held(group, group.rank(), size, opened)
        with self._lock:
            self._held[id(group)] = held
            self._loops.pop(id(group), None)
        return held

    def _found_loops(self) -> list[tuple[Held, GlooLoop]]:
        """Every held group with each of its gloo loops, looking for the loops of the groups not
        looked at yet among the descriptors their creation opened, in the order the groups were
        made (a loop seen in an earlier group's note is no later group's). Call with the lock
        held. Never raises."""
        found: list[tuple[Held, GlooLoop]] = []
        for key, held in self._held.items():
            if held.opened is None:
                continue
            if key not in self._loops:
                candidates = held.opened.loops(self._seen)
                loops = held.opened.pick(candidates)
                self._seen.update(candidate.listener_inode for candidate in candidates)
                self._loops[key] = loops
                if not loops:
                    logger.warning(
                        "parallelctx: the gloo event loop of group %s was not found among the "
                        "descriptors it opened; gpc.abort() cannot shut down its connections (its "
                        "collectives end at the group's timeout instead)",
                        getattr(held.group, "group_name", "?"),
                    )
            found.extend((held, loop) for loop in self._loops[key])
        return found

    def release(self, groups: Iterable[Any] | None = None) -> None:
        """Stop holding ``groups`` (every group when None) right before they are destroyed,
        first quieting every pair registration on their gloo loops (:meth:`GlooLoop.quiet`), so
        that no group's destructor waits forever on its loop; returns None."""
        with self._lock:
            ids = None if groups is None else {id(g) for g in groups}
            for held, loop in self._found_loops():
                if (ids is None or id(held.group) in ids) and loop.alive():
                    loop.quiet()
            for key in [k for k in self._held if ids is None or k in ids]:
                del self._held[key]
                self._loops.pop(key, None)

    def held(self) -> list[Held]:
        """Return what is held now, in the order the groups were made."""
        with self._lock:
            return list(self._held.values())

    @contextlib.contextmanager
    def serial(self) -> Iterator[None]:
        """Hold the guard's lock for the body (a teardown): no :meth:`abort` runs meanwhile."""
        with self._lock:
            yield

    def abort(self, timeout: float = 2.0) -> int:
        """Abort every held group from any thread, without waiting on a hung collective: set
        :attr:`aborted` (a launch under way stops at its next store call, and :attr:`cut` ends a
        wait of its inside torch), ``ProcessGroup.abort()``
        on each (NCCL), then for each gloo group a connection to its listener in each peer's
        name (:func:`~parallelctx.guard.abort.wake`: a pair waiting for a peer that never
        connected takes it and raises) and a shutdown of every connection of its loop. A
        collective pending on one of them raises within milliseconds, here and on the peers.

        ``timeout`` bounds each wake connection (at most 0.5 s).

        Returns:
            The number of gloo connections shut down. Never raises (a group that fails to abort
            is logged).
        """
        with self._lock:
            self.aborted.set()
            cut = self.cut
            if cut is not None:
                cut()
            held = list(self._held.values())
            if not held:
                return 0
            abort_groups([h.group for h in held], include_default=False)
            loops = [(h, loop) for h, loop in self._found_loops() if loop.alive()]
            listeners = {(h.rank, h.size, loop.listener) for h, loop in loops}
            wake({at: (rank, size) for rank, size, at in listeners if at is not None}, min(timeout, 0.5))
            return sum(loop.shut_down() for _, loop in loops)

    # ------------------------------------------------------------------ hang report
    def on_hang(self, handler: Callable[[HangReport], Any]) -> Callable[[HangReport], Any]:
        """Keep ``handler`` for every hang report (once, across launches); returns it.

        Raises:
            TypeError: ``handler`` is not callable.
        """
        if not callable(handler):
            raise TypeError(f"on_hang takes a function of one argument (the report), not {handler!r}")
        if handler not in self._handlers:
            self._handlers.append(handler)
        return handler

    def watch(
        self,
        after: timedelta,
        log: bool,
        rank: int,
        store: Any,
        groups: Mapping[ParallelMode, Any] | Iterable[tuple[ParallelMode, Any]],
        where: Callable[[int], str] | None = None,
        store_wait: timedelta = timedelta(seconds=10),
    ) -> None:
        """Start the hang report of a launch: watch ``groups`` (mode -> a group with ``ranks``,
        ``group`` and ``cpu_group``, as :class:`parallelctx.runtime.groups.ModeGroup`; or pairs
        of them, the groups of every module of ``parallel.modules``) and report
        a call that waited longer than ``after`` to the handlers, reading the peers' progress
        from ``store`` (a silent store again for up to ``store_wait``); ``where(rank)`` words a
        rank's place in a point-to-point report. A report's ``abort()`` aborts this launch
        only. Returns None."""
        watched: dict[int, tuple[Any, list[ParallelMode], bool, tuple[int, ...]]] = {}
        for mode, g in groups.items() if isinstance(groups, Mapping) else groups:
            for group, cpu in ((g.group, False), (g.cpu_group, True)):
                if id(group) in watched:
                    if mode not in watched[id(group)][1]:
                        watched[id(group)][1].append(mode)
                else:
                    watched[id(group)] = (group, [mode], cpu and g.cpu_group is not g.group, tuple(g.ranks))
        order = list(ParallelMode).index
        watch: HangWatch | None = None

        def abort_this_launch() -> int:
            with self._lock:
                return self.abort() if watch is not None and self._watch is watch else 0

        watch = HangWatch(
            after,
            rank,
            store,
            [(g, tuple(sorted(m, key=order)), cpu, r) for g, m, cpu, r in watched.values()],
            self._handlers,
            log=log,
            aborter=abort_this_launch,
            store_wait=store_wait,
            where=where,
            clone=True,  # a connection of its own, made in the watch's thread
        )
        self._watch = watch
        watch.start()

    def unwatch(self) -> None:
        """Stop the hang report of the launch, if one runs; returns None."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()


def _is_gloo(group: Any) -> bool:
    """True for a process group whose backend is gloo."""
    try:
        return str(group._get_backend_name()) == "gloo"
    except Exception:
        return False
