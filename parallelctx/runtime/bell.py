"""A launch attempt's bell: when one rank abandons an attempt, every other rank of it is told
at once, even while it waits inside torch.

A launch attempt is one key prefix on the rendezvous store (``parallelctx/launch-<n>/``, agreed by
:func:`parallelctx.runtime.rendezvous.meet`). Ranks that abort and relaunch on their own, without
coordinating, can pair one rank's relaunch with another rank's attempt that is about to be aborted:
the ranks that went on then wait for the aborted rank inside torch (``init_process_group``'s
address exchange, a group's connection), where no Python check runs, until ``dist.timeout``. So:

* a rank whose attempt fails or is aborted after it answered a prefix *abandons* it
  (:func:`abandon`): it adds :data:`~parallelctx.runtime.rendezvous.ABANDONED` to the prefix's answer count (rank 0, still
  counting answers, starts over under a new prefix) and rings every rank's bell key;
* every rank that got past the meeting keeps a :class:`Bell` until its launch is done: a thread
  blocked in a store ``wait`` on its own bell key, on a connection of its own. When it rings, it
  shuts down the connection torch's groups use for this attempt (:class:`Line`), so a wait inside
  torch raises within milliseconds, and sets ``halted``, so a wait in Python stops at its next
  store call. The start-up then meets the others again under a new prefix.

A normal launch costs two more store connections per rank while it runs, one thread and two store
requests. Stores without their own connections (``FileStore``, ``HashStore``) get no bell.

Imports nothing from parallelctx outside ``guard`` and ``runtime.rendezvous``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..guard.sockets import shut_down_fd
from .rendezvous import ABANDONED

__all__ = ["Abandoned", "Bell", "Line", "abandon"]

logger = logging.getLogger("parallelctx")

_DONE = b"done"
_LOOK = 8  # descriptors looked at from the lowest free one for a new store connection


@dataclass(frozen=True)
class Abandoned:
    """A peer's abandonment of a launch attempt, as this rank's bell heard it: the rank and the
    attempt's prefix."""

    rank: int
    prefix: str

    def words(self) -> str:
        """Return the abandonment in words, for a log line or an error."""
        who = f"rank {self.rank}" if self.rank >= 0 else "a rank"
        return f"{who} abandoned the launch attempt {self.prefix.rstrip('/')} (gpc.abort() or an error on that rank)"


def _bell_key(prefix: str, rank: int) -> str:
    return f"{prefix}bell/{rank}"


def abandon(store: Any, prefix: str, rank: int, world_size: int) -> None:
    """Tell every rank of the attempt under ``prefix`` that ``rank`` abandoned it: add
    :data:`ABANDONED` to its answer count and ring every rank's bell. Never raises (the store may
    be gone with the rank that served it); returns None."""
    with contextlib.suppress(Exception):
        store.add(prefix + "answers", ABANDONED)
        keys = [_bell_key(prefix, r) for r in range(world_size) if r != rank]
        if keys:
            store.multi_set(keys, [str(rank).encode()] * len(keys))


def _peer_port(fd: int, inode: int) -> int | None:
    """The remote port of the connected TCP socket at ``fd`` (inode ``inode``), else None."""
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(copy).st_ino != inode:
            return None
        with socket.socket(fileno=copy) as sock:
            copy = -1
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            return int(sock.getpeername()[1])
    except (OSError, ValueError):
        return None
    finally:
        if copy >= 0:
            os.close(copy)


def _store_sockets(fds: range, port: int) -> dict[int, int]:
    """The connected TCP sockets among ``fds`` whose remote port is ``port``: inode -> fd."""
    found: dict[int, int] = {}
    for fd in fds:
        with contextlib.suppress(OSError):
            inode = os.fstat(fd).st_ino
            if _peer_port(fd, inode) == port:
                found[inode] = fd
    return found


class Line:
    """A connection of this rank's own to a TCP store, for one launch attempt: torch's groups of
    the attempt wait on it, and :meth:`cut` shuts it down from any thread, so that such a wait
    raises within milliseconds. For any other store, the store itself (and :meth:`cut` does
    nothing)."""

    def __init__(self, base: Any) -> None:
        self.store = base
        self._lock = threading.Lock()
        self._held = False  # torch connects the default group's pairs: no cut (see :meth:`hold`)
        self._was_cut = False
        self._wanted = False  # a cut came while held: made on release
        self._sockets: dict[int, int] = {}
        if not isinstance(base, dist.TCPStore):
            return
        # The clone's socket takes the lowest free descriptors (no scan of /proc/self/fd, which
        # costs with many open files): look at the few from the lowest free one up, and take
        # only a socket that was not there before the clone (the rank's own connection to the
        # store, or an earlier attempt's line, may sit among them).
        port = base.port
        probe = os.open(os.devnull, os.O_RDONLY)
        os.close(probe)
        window = range(probe, probe + _LOOK)
        before = _store_sockets(window, port)
        self.store = base.clone()  # type: ignore[attr-defined]  # in torch, not in its stubs
        self._sockets = {
            inode: fd for inode, fd in _store_sockets(window, port).items() if before.get(inode) != fd
        }

    def hold(self) -> bool:
        """Keep the line uncut from now until :meth:`release`: torch is about to connect the
        default group's pairs, every rank together, so that ends within moments, and a rank
        that left it then would leave a peer connecting to its closed listener, which gloo
        retries in C++ for minutes. Returns False, holding nothing, when the line was already
        cut (the attempt is over on this rank)."""
        with self._lock:
            if self._was_cut:
                return False
            self._held = True
            return True

    def release(self) -> None:
        """End :meth:`hold`, and make the cut that came meanwhile, if one did; returns None."""
        with self._lock:
            self._held = False
            wanted = self._wanted
        if wanted:
            self.cut()

    def cut(self) -> int:
        """Shut down the connection (the descriptor stays the store's); while it is held
        (:meth:`hold`), on release instead. Returns how many sockets were shut down now.
        Never raises."""
        with self._lock:
            if self._held:
                self._wanted = True
                return 0
            self._was_cut = True
            return sum(shut_down_fd(fd, inode) for inode, fd in self._sockets.items())


class Bell:
    """Waits, in a thread on its own store connection, until a peer abandons the attempt under
    ``prefix`` (:func:`abandon`) or :meth:`stop` is called; when a peer abandons it, sets
    ``halted``, cuts ``line`` and keeps who it was (:attr:`heard`). ``timeout`` bounds the wait
    (the launch's: a launch that runs longer fails on its own)."""

    def __init__(
        self, base: Any, prefix: str, rank: int, line: Line, halted: threading.Event, timeout: timedelta
    ) -> None:
        self.heard: Abandoned | None = None
        self._base, self._prefix, self._rank = base, prefix, rank
        self.line, self._halted = line, halted
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        if not isinstance(base, dist.TCPStore):
            return
        ear = base.clone()  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._listen, args=(ear, timeout), name="parallelctx-launch-bell", daemon=True
        )
        self._thread.start()

    def _listen(self, ear: Any, timeout: timedelta) -> None:
        key = _bell_key(self._prefix, self._rank)
        try:
            ear.wait([key], timeout)
            value = ear.get(key)
        except Exception:
            return  # the launch's own deadline speaks for it
        if value == _DONE or self._stopping.is_set():
            return
        with contextlib.suppress(ValueError):
            self.heard = Abandoned(int(value), self._prefix)
        self._halted.set()
        self.line.cut()

    def cut(self) -> None:
        """Cut this attempt's line (``gpc.abort()`` during the launch); returns None."""
        self.line.cut()

    def stop(self) -> Abandoned | None:
        """Stop listening (the launch is done or failed on its own); returns what was heard
        before, if anything. Never raises."""
        self._stopping.set()
        if self._thread is not None:
            with contextlib.suppress(Exception):
                self._base.set(_bell_key(self._prefix, self._rank), _DONE)
            self._thread.join(5.0)
        return self.heard
