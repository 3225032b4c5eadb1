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

Those two connections are made once per process and store, not once per launch: the next attempt
takes over the last one's line (:class:`Line`'s ``spare``) and its bell's connection
(:meth:`Bell.spare`) when they are still whole, so relaunches in the same processes (the pytest
plugin, in-process restarts) make no new store connection. A new one is not free: torch formats
the other end's address of every new store connection with ``getnameinfo``, a reverse DNS
lookup, at both ends (the store server in its only thread). For a store on the same host that
address is ``::ffff:127.0.0.1`` (torch connects over IPv6 first, to a dual-stack listener),
which no ``/etc/hosts`` names, so each lookup asks the DNS server; one query it drops holds that
end for the resolver's timeout (glibc: 5 s), and at the server that is every rank's request.

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

from ..guard.sockets import is_stream, shut_down_fd, socket_at
from .rendezvous import ABANDONED

__all__ = ["Abandoned", "Bell", "Line", "abandon"]

logger = logging.getLogger("parallelctx")

_DONE = b"done"
_LOOK = 8  # descriptors looked at from the lowest free one for a new store connection
# How long an earlier attempt's line gets to answer one request before a new attempt takes it
# over (a request of torch's still waiting on it would hold it until dist.timeout)
_PROBE_S = 2.0


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
        with socket_at(fd, inode) as sock:
            if sock is None or not is_stream(sock):
                return None
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            return int(sock.getpeername()[1])
    except (OSError, ValueError):
        return None


def _idle(fd: int, inode: int) -> bool:
    """Whether the socket at ``fd`` (inode ``inode``) is still connected with nothing unread: a
    store connection between two requests, fit for another attempt. Never raises."""
    try:
        with socket_at(fd, inode) as sock:
            if sock is None:
                return False
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return False  # a byte nobody asked for (the stream is out of step), or the peer closed it
    except BlockingIOError:
        return True
    except (OSError, ValueError):
        return False


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
    nothing).

    ``spare``, an earlier attempt's line on the same ``base`` whose groups are gone: its
    connection is taken over when it was never cut and is still whole (:meth:`reusable`), so
    that a relaunch makes no new store connection (see the module docstring); else a new one is
    made. ``reused`` says which."""

    def __init__(self, base: Any, spare: Line | None = None) -> None:
        self.store = base
        self.base = base
        self.reused = False
        self._lock = threading.Lock()
        self._held = False  # torch connects the default group's pairs: no cut (see :meth:`hold`)
        self._was_cut = False
        self._wanted = False  # a cut came while held: made on release
        self._sockets: dict[int, int] = {}
        if not isinstance(base, dist.TCPStore):
            return
        if spare is not None and spare.base is base and spare.reusable():
            self.store, self._sockets, self.reused = spare.store, dict(spare._sockets), True
            # as a clone made now would be: base's timeout, this launch's dist.timeout (torch's
            # groups wait on the line with it), not the one of the launch that made it
            self.store.set_timeout(base.timeout)
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

    def reusable(self) -> bool:
        """Whether another attempt may take over this line's connection: a connection of its
        own, never cut (nor about to be), still connected with nothing unread (a request of
        torch's cut short would leave its answer there), and free: it answers a request within
        :data:`_PROBE_S` (a wait of torch's left running on it, by a group that outlived its
        launch, would hold it). Never raises."""
        with self._lock:
            if self._was_cut or self._wanted or self._held:
                return False
        if self.store is self.base or len(self._sockets) != 1:
            return False  # no connection of its own, or its socket was not found (never checked)
        if not all(_idle(fd, inode) for inode, fd in self._sockets.items()):
            return False
        ended, answered = threading.Event(), []
        store = self.store

        def probe() -> None:  # in a thread: a busy connection blocks it, not the launch
            try:
                store.check(["parallelctx/line"])
                answered.append(True)
            except Exception:
                pass  # a failed request: not reusable, known at once
            finally:
                ended.set()

        threading.Thread(target=probe, name="parallelctx-line-probe", daemon=True).start()
        return ended.wait(_PROBE_S) and bool(answered)

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
    (the launch's: a launch that runs longer fails on its own). ``ear``: the connection to wait
    on, an earlier bell's (:meth:`spare`) on the same ``base``; a new one is made without it."""

    def __init__(
        self,
        base: Any,
        prefix: str,
        rank: int,
        line: Line,
        halted: threading.Event,
        timeout: timedelta,
        ear: Any = None,
    ) -> None:
        self.heard: Abandoned | None = None
        self.base, self._prefix, self._rank = base, prefix, rank
        self.line, self._halted = line, halted
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._ear: Any = None
        self._whole = False  # the wait and the read both answered: the ear is fit for another bell
        if not isinstance(base, dist.TCPStore):
            return
        if ear is not None:
            ear.set_timeout(base.timeout)  # type: ignore[attr-defined]  # as a clone made now would be
        self._ear = ear if ear is not None else base.clone()  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._listen, args=(self._ear, timeout), name="parallelctx-launch-bell", daemon=True
        )
        self._thread.start()

    def _listen(self, ear: Any, timeout: timedelta) -> None:
        key = _bell_key(self._prefix, self._rank)
        try:
            ear.wait([key], timeout)
            value = ear.get(key)
        except Exception:
            return  # the launch's own deadline speaks for it
        self._whole = True
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
                self.base.set(_bell_key(self._prefix, self._rank), _DONE)
            self._thread.join(5.0)
        return self.heard

    def spare(self) -> Any:
        """This bell's connection, for the next attempt's bell (``ear``), once :meth:`stop`
        ended its thread after a wait and a read that both answered; else None (a thread still
        waiting, or a connection whose last request failed, is left alone)."""
        thread = self._thread
        if thread is None or thread.is_alive() or not self._whole:
            return None
        return self._ear
