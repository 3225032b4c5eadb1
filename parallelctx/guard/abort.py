"""Abort a launch's process groups from any thread, without waiting on a hung collective.

``ProcessGroup.abort()`` ends NCCL communicators, but gloo does not implement it (in torch 2.13
``abort()``, ``shutdown()`` and ``suspend()`` of a gloo group all leave a pending collective
waiting until its timeout). A gloo group is a set of TCP connections between the ranks' gloo
listeners, so what ends a pending gloo collective is shutting those connections down: the
collective then raises ``RuntimeError: ... Connection closed by peer`` within milliseconds, on
this rank and on the peers at the other end. ``gpc.abort()`` (:class:`parallelctx.guard.core.Guard`)
is made of :func:`abort_groups`, :func:`wake` (for a pair that waits for a peer that never
connected) and each group's :class:`~parallelctx.guard.sockets.GlooLoop`, found when the group
was made, which knows the group's connections without looking at any other descriptor.

Also here, for a process's own use (``gpc`` needs none of them since each group's loop is known):
:func:`listening` (this process's TCP listeners), :func:`new_listeners`, :func:`shut_down`
(every connection to or from given listeners, found by a scan of ``/proc/self/fd``),
:func:`socket_inodes`, and :func:`post_listeners` / :func:`read_listeners` (listeners carried
over a store). Linux only: elsewhere they find nothing.

Imports nothing from parallelctx outside this package.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .sockets import Endpoint, endpoint_of, shut_down_fd

__all__ = [
    "AbortableStore",
    "Endpoint",
    "LaunchAborted",
    "abort_groups",
    "listening",
    "new_listeners",
    "post_listeners",
    "read_listeners",
    "shut_down",
    "socket_inodes",
    "wake",
]

_LISTEN = "0A"


def _socket_fds() -> dict[int, int]:
    """inode -> one file descriptor of this process for every socket it holds."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:  # a plain try, not contextlib.suppress: this runs once per descriptor, per group
            target = os.readlink("/proc/self/fd/" + name)
            if target.startswith("socket:["):
                out[int(target[8:-1])] = int(name)
        except (OSError, ValueError):
            continue  # closed meanwhile
    return out


def socket_inodes() -> frozenset[int]:
    """Return the inodes of every socket this process holds (cheap: ``/proc/self/fd`` only)."""
    return frozenset(_socket_fds())


def _endpoint(text: str) -> Endpoint:
    address, port = text.split(":")
    return address, int(port, 16)


def _tcp_sockets() -> list[tuple[int, int, Endpoint, Endpoint, str]]:
    """(inode, fd, local, remote, state) of every TCP socket of this process."""
    fds = _socket_fds()
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[9].isdigit() and int(fields[9]) in fds:
                    inode = int(fields[9])
                    rows.append((inode, fds[inode], _endpoint(fields[1]), _endpoint(fields[2]), fields[3]))
    return rows


def listening(exclude: Collection[int] = ()) -> dict[int, Endpoint]:
    """Return the TCP listeners of this process: inode -> (address in hex, port), as
    /proc/net/tcp[6] would give them, but asked of this process's own sockets (one duplicate of
    each; a scan of every descriptor). Sockets whose inode is in ``exclude`` are not looked at."""
    out: dict[int, Endpoint] = {}
    for inode, fd in _socket_fds().items():
        if inode not in exclude:
            endpoint = endpoint_of(fd, inode)
            if endpoint is not None:
                out[inode] = endpoint
    return out


def new_listeners(before: Collection[int], exclude_ports: Collection[int] = ()) -> list[Endpoint]:
    """Return the listeners of this process that are not in ``before`` (socket inodes from
    :func:`listening` or :func:`socket_inodes`), leaving out ``exclude_ports`` (e.g. a
    rendezvous store served here)."""
    return sorted(local for local in listening(before).values() if local[1] not in exclude_ports)


def _matches(endpoint: Endpoint, listeners: Collection[Endpoint]) -> bool:
    address, port = endpoint
    return any(port == p and (a == address or not a.strip("0")) for a, p in listeners)


def shut_down(listeners: Collection[Endpoint]) -> int:
    """Shut down (``SHUT_RDWR``, without closing the descriptor) every established TCP
    connection of this process whose local end is one of ``listeners`` (accepted by it) or
    whose remote end is one (connected to it).

    Returns:
        The number of connections shut down. Never raises for a socket that closed meanwhile.
    """
    return sum(
        shut_down_fd(fd, inode)
        for inode, fd, local, remote, state in _tcp_sockets()
        if state != _LISTEN and (_matches(local, listeners) or _matches(remote, listeners))
    )


def _host(address: str) -> str:
    """The IP address to reach a listener of this process at, from its /proc address in hex."""
    if not address.strip("0"):
        return "127.0.0.1"  # bound to every address (0.0.0.0)
    if len(address) == 8:
        return socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1])
    raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, 32, 8))
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntop(socket.AF_INET, raw[12:])
    return "::1" if raw == b"\0" * 15 + b"\1" else socket.inet_ntop(socket.AF_INET6, raw)


def wake(listeners: Mapping[Endpoint, tuple[int, int]], timeout: float = 0.5) -> int:
    """End the waits of gloo pairs that wait for a peer that never connected.

    With lazy connection (``TORCH_GLOO_LAZY_INIT``), a pair connects on its first use, and of
    the two ranks of a pair the one with the lower address waits, with no socket yet, for the
    other to connect to its group's listener and name itself by its rank in the group (a
    native 64-bit number). A pending collective waits there until the group's timeout when
    that peer never comes, and no connection exists to shut down. For every listener of
    ``listeners`` (endpoint -> this rank's index in the group, group size), this connects
    once in each peer's name, sends the peer's rank and closes: a waiting pair takes the
    connection, reads its end at once and raises (``Connection closed by peer``); a
    connection no pair waits for is held by gloo until the group is destroyed, so a later
    wait on the aborted group ends the same way. Only a group being aborted may be woken.

    Returns:
        The number of connections made. Never raises (a listener that refuses is skipped).
    """
    done = 0
    for (address, port), (own, size) in listeners.items():
        host = _host(address)
        for peer in range(size):
            if peer == own:
                continue  # a pair never waits for its own rank
            try:
                with socket.create_connection((host, port), timeout=timeout) as sock:
                    sock.sendall(struct.pack("=Q", peer))
                    sock.shutdown(socket.SHUT_WR)
                done += 1
            except OSError:
                break  # this listener is gone or refuses: the next one
    return done


def post_listeners(store: Any, rank: int, listeners: Collection[Endpoint]) -> None:
    """Post ``listeners`` (this rank's gloo listeners) on the launch's ``store``, where the other
    ranks' :func:`read_listeners` finds them: one write, no wait; a store error is ignored (abort
    then shuts down fewer connections)."""
    with contextlib.suppress(Exception):
        store.set(f"listeners/{rank}", json.dumps(sorted(listeners)))


def read_listeners(store: Any, rank: int, world_size: int, timeout: float) -> list[Endpoint] | None:
    """Return the gloo listeners every other rank posted on the launch's ``store``, read on a new
    connection in a helper thread within ``timeout`` seconds (the calling thread's own store
    connection may be busy in a hung call). Returns None when the store did not answer in time or
    could not be read (e.g. a store that cannot be cloned)."""
    box: list[Endpoint] = []
    failed: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        try:
            fresh = store.clone()
            keys = [
                f"listeners/{r}" for r in range(world_size) if r != rank and fresh.check([f"listeners/{r}"])
            ]
            for value in fresh.multi_get(keys) if keys else []:
                box.extend((address, int(port)) for address, port in json.loads(value))
        except Exception as exc:  # a store that cannot be cloned or read: the caller is told
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=read, name="parallelctx-abort", daemon=True).start()
    return box if done.wait(timeout) and not failed else None


def abort_groups(groups: Collection[Any], include_default: bool) -> None:
    """Call ``abort()`` on each distinct group of ``groups`` (None skipped), and on the default
    group when ``include_default`` and it exists: NCCL ends its communicators; gloo, which does
    not implement abort, does nothing (:func:`shut_down` ends its collectives). A group that
    fails to abort is logged; returns None."""
    distinct: dict[int, Any] = {id(g): g for g in groups if g is not None}
    if include_default and dist.is_initialized() and dist.group.WORLD is not None:
        distinct[id(dist.group.WORLD)] = dist.group.WORLD
    for g in distinct.values():
        try:
            g.abort()
        except Exception:
            logging.getLogger("parallelctx").exception("parallelctx: abort of process group %r failed", g)


class LaunchAborted(RuntimeError):
    """``gpc.abort()`` was called while this rank's launch waited at the rendezvous."""


class AbortableStore(dist.Store):
    """A store that refuses every call once ``aborted`` is set, raising :class:`LaunchAborted`:
    the launch's waits call the store every 0.25 s at most, so ``gpc.abort()`` ends them; and
    once ``halted`` is set (a peer abandoned the launch attempt), raising RuntimeError.
    Everything else is passed to ``inner`` unchanged (a wait already inside ``inner`` runs to its
    own end); :meth:`clone` gives a plain clone of ``inner``. torch holds a store made in Python
    without keeping the Python object alive: keep a reference for as long as it is used."""

    def __init__(self, inner: Any, aborted: threading.Event, halted: threading.Event | None = None) -> None:
        super().__init__()
        self._inner = inner
        self._aborted = aborted
        self._halted = halted

    def _check(self) -> None:
        if self._aborted.is_set():
            raise LaunchAborted("parallelctx: gpc.abort() was called during the launch")
        if self._halted is not None and self._halted.is_set():
            raise RuntimeError("parallelctx: another rank abandoned this launch attempt")

    def set(self, key: str, value: Any) -> None:
        self._check()
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._check()
        return self._inner.get(key)

    def add(self, key: str, value: int) -> int:
        self._check()
        return self._inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        self._check()
        return self._inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._check()
        return self._inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._check()
        self._inner.multi_set(keys, values)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self._check()
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        self._check()
        return self._inner.delete_key(key)

    def wait(self, keys: list[str], *timeout: Any) -> None:
        self._check()
        self._inner.wait(keys, *timeout)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: Any) -> None:
        self._inner.set_timeout(timeout)

    def clone(self) -> Any:
        # A plain clone of the inner store: abort() itself reads the peers' listeners through it.
        return self._inner.clone()
