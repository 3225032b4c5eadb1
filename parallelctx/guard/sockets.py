"""Each gloo group's event loop in this process, found once when the group is made.

A gloo process group runs one event loop per group (gloo's TCP device): an ``epoll`` descriptor
on which gloo registers the group's listener and every connection of the group as it is made,
eager or lazy. Knowing that descriptor is knowing the group's sockets: ``/proc/self/fdinfo/<epoll>``
lists each registered descriptor with its inode, so :meth:`GlooLoop.shut_down` reaches exactly the
group's connections, however many other descriptors the process holds (sharded datasets,
IPC handles), without scanning them.

The loop is found without a scan too. The kernel gives every new descriptor the lowest free
number, so the descriptors a group's creation opens (gloo's pipe, its epoll, its listener) land
in the lowest numbers that were free just before: :meth:`FdSlots.reserve` reads them (one
``open`` and a few ``dup``), :meth:`FdSlots.gloo_loop` looks at those numbers only, after the group
is made. A descriptor another thread opens meanwhile takes one of the slots and shifts gloo's by
one: :data:`SLOTS` leaves room for many. When more than that were opened (a thread opening
sockets without pause while a group that waits on its peers is made), the slots do not hold the
whole loop; :meth:`FdSlots.opened` sees that (one read of the noted epoll's registrations) and
notes every descriptor of the process instead, among which the group's loop is taken only when
it is the one gloo loop not found before (:meth:`Opened.gloo_loop`).

Linux only (``/proc``); elsewhere no loop is found and abort falls back to ``ProcessGroup.abort``.
Imports nothing from parallelctx.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import socket
import stat
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

__all__ = [
    "SLOTS",
    "Endpoint",
    "FdSlots",
    "GlooLoop",
    "Opened",
    "endpoint_of",
    "loops_per_group",
    "shut_down_fd",
    "socket_at",
]

Endpoint = tuple[str, int]
"""A TCP endpoint as /proc/net/tcp[6] writes it: (address in hex, port)."""

SLOTS = 10
"""Free descriptor numbers read before each group is made: gloo opens its loop's pipe, epoll and
listener first (4 descriptors), so up to 6 opened meanwhile by other threads still leave them
among the slots (reading a slot costs a ``dup``); past that, every descriptor of the process
is noted (:meth:`FdSlots.opened`). A group with several loops gets 4 more slots for each
(:func:`loops_per_group`)."""


def loops_per_group() -> int:
    """Return how many gloo event loops a gloo group's creation opens in this process: one per
    device, and gloo makes a device per interface named in ``GLOO_SOCKET_IFNAME`` (``eth0,eth1``:
    torch spreads a group's collectives over them); twice that with
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, where torch makes a gloo helper group beside each group
    (its collectives' checks run there). Never raises."""
    names = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name.strip()]
    detail = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    return max(1, len(names)) * (2 if detail else 1)


_EPOLL = "anon_inode:[eventpoll]"
_NONBLOCK = getattr(socket, "SOCK_NONBLOCK", 0)  # Linux, where /proc is read
_TFD = re.compile(
    r"^tfd:\s*(\d+)\s+events:\s*([0-9a-f]+)\s+data:\s*([0-9a-f]+).*?\sino:([0-9a-f]+)", re.MULTILINE
)
_EPOLLIN, _EPOLLOUT, _EPOLLONESHOT, _EPOLL_CTL_MOD = 0x001, 0x004, 1 << 30, 3


_LIBC = ctypes.CDLL(None, use_errno=True)  # this process's C library (epoll_ctl, getsockopt)


class _EpollEvent(ctypes.Structure):
    """``struct epoll_event``: packed on x86-64 (the kernel's ABI there), natural elsewhere."""

    _pack_ = 1 if platform.machine() in ("x86_64", "AMD64") else 0
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


def _proc_hex(family: int, address: str) -> str:
    """``address`` written as /proc/net/tcp[6] writes it (each 32-bit word in host order)."""
    packed = socket.inet_pton(family, address)
    return "".join(packed[i : i + 4][::-1].hex() for i in range(0, len(packed), 4)).upper()


def _wrap(fd: int, inode: int) -> socket.socket | None:
    try:
        copy = os.dup(fd)
    except OSError:
        return None  # closed meanwhile
    try:
        info = os.fstat(copy)
        if info.st_ino != inode or not stat.S_ISSOCK(info.st_mode):
            os.close(copy)  # the number was reused for another file
            return None
        # The duplicate shares its open file, and so O_NONBLOCK, with the owner's descriptor,
        # which the owner's threads may be using meanwhile (torch's waits, gloo's event loop): its
        # mode must not change, not even for a moment. A socket object made the usual way sets
        # socket.setdefaulttimeout's mode, and settimeout() its own (a gloo socket, non-blocking,
        # turned blocking meanwhile: gloo's loop reads until EAGAIN). SOCK_NONBLOCK in ``type``
        # gives an object of timeout 0 that sets no mode; the family is read from the socket,
        # the type is not (see is_stream).
        kind = socket.SOCK_STREAM | _NONBLOCK if _NONBLOCK else -1
        sock = socket.socket(type=kind, fileno=copy)  # owns (and closes) the duplicate from here
    except (OSError, ValueError):
        os.close(copy)
        return None
    return sock


def is_stream(sock: socket.socket) -> bool:
    """Whether ``sock`` (from :func:`socket_at`, whose ``type`` says nothing) is a stream socket."""
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_STREAM


@contextlib.contextmanager
def socket_at(fd: int, inode: int) -> Iterator[socket.socket | None]:
    """A socket object over a duplicate of descriptor ``fd`` while it is the socket with inode
    ``inode`` (a number reused meanwhile for another file is not mistaken), else None; closed
    on exit, leaving ``fd`` and its blocking mode to their owner (torch, gloo), never changed,
    not even while the body runs. The object has timeout 0 (a call that would wait raises
    BlockingIOError when the owner's socket is non-blocking) whose ``type`` may say SOCK_STREAM
    for any socket: :func:`is_stream` asks the socket. Raises only what the body raises."""
    sock = _wrap(fd, inode)
    try:
        yield sock
    finally:
        if sock is not None:
            sock.close()


def endpoint_of(fd: int, inode: int) -> Endpoint | None:
    """Return the local endpoint of descriptor ``fd`` if it is a listening TCP socket with inode
    ``inode`` (checked on a duplicate, so a number reused meanwhile is not mistaken), else None.
    Never raises."""
    try:
        with socket_at(fd, inode) as sock:
            if (
                sock is not None
                and sock.family in (socket.AF_INET, socket.AF_INET6)
                and is_stream(sock)
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            ):
                address, port = sock.getsockname()[:2]
                return _proc_hex(sock.family, address.split("%")[0]), int(port)
            return None
    except (OSError, ValueError):
        return None


def shut_down_fd(fd: int, inode: int) -> bool:
    """Shut down (``SHUT_RDWR``, without closing the descriptor, which stays its owner's) the
    socket at ``fd`` if its inode is still ``inode``; returns whether it was. Never raises."""
    try:
        with socket_at(fd, inode) as sock:
            if sock is None:
                return False
            sock.shutdown(socket.SHUT_RDWR)
            return True
    except OSError:
        return False


def _registered(epoll: int) -> list[tuple[int, int]]:
    """(descriptor, inode) of everything registered on the epoll descriptor ``epoll``."""
    return [(fd, inode) for fd, _, _, inode in _registrations(epoll)]


def _registrations(epoll: int) -> list[tuple[int, int, int, int]]:
    """(descriptor, events, data, inode) of everything registered on the epoll descriptor
    ``epoll``, as ``/proc/self/fdinfo`` gives them."""
    try:  # os-level reads: a text file object costs more than the read (once per group made)
        info = os.open(f"/proc/self/fdinfo/{epoll}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        chunks = []
        while chunk := os.read(info, 65536):
            chunks.append(chunk)
    except OSError:
        return []
    finally:
        os.close(info)
    return [
        (int(fd), int(events, 16), int(data, 16), int(ino, 16))
        for fd, events, data, ino in _TFD.findall(b"".join(chunks).decode())
    ]


def _by_number(registrations: Iterable[tuple[int, int, int, int]]) -> bool:
    """Whether any of ``registrations`` (from :func:`_registrations`) carries its own descriptor
    number as its data, as Python's ``select.epoll`` and libuv register every descriptor (the
    ``fd`` member of the data union: its low 32 bits; Python leaves the rest as it found it);
    gloo registers the address of a handler object."""
    return any(data & 0xFFFFFFFF == fd for fd, _, data, _ in registrations)


def _disarm(epoll: int, fd: int, data: int) -> bool:
    """Leave ``fd``'s registration on ``epoll`` in place but report at most one more event
    (EPOLLONESHOT and no events asked; the owner's ``data`` kept): the owner's later removal of
    it still succeeds. Returns whether the kernel took the change."""
    event = _EpollEvent(_EPOLLONESHOT, data)
    return bool(_LIBC.epoll_ctl(epoll, _EPOLL_CTL_MOD, fd, ctypes.byref(event)) == 0)


def _anonymous(info: os.stat_result) -> bool:
    """Whether ``info`` (an ``fstat``) is of an anonymous-inode descriptor (epoll, eventfd,
    timerfd: no file type bits), as no pipe, socket or file is."""
    return stat.S_IFMT(info.st_mode) == 0


def _anonymous_pipe(fd: int) -> bool:
    """Whether descriptor ``fd`` (a FIFO by ``fstat``) is an anonymous pipe, as gloo's wake-up
    pipe is, and not a named FIFO (``mkfifo``) that another thread's loop may watch."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    except OSError:
        return False


@dataclass(frozen=True)
class GlooLoop:
    """A gloo group's event loop in this process: the number of its ``epoll`` descriptor, and
    its listener's descriptor and inode, where the group's peers connect."""

    epoll: int
    listener_fd: int
    listener_inode: int

    @classmethod
    def at(
        cls, fd: int, known: Collection[int] = (), noted: Collection[tuple[int, int]] | None = None
    ) -> GlooLoop | None:
        """Return the gloo loop whose epoll descriptor is ``fd``: an epoll that registers gloo's
        wake-up pipe and a listening TCP socket (its listener) whose inode is not in ``known``
        (the listeners of loops found before); else None. Another thread's event loop opened
        meanwhile in the same slots is not taken for it: gloo registers each descriptor with the
        address of its handler, where Python's ``select.epoll`` (``selectors``, asyncio) and
        libuv (a TCPStore server) register it with its own number, even with a pipe and a
        listener registered like gloo's; nor is a loop that registers an anonymous descriptor
        (an eventfd). With ``noted`` (descriptor, inode) pairs, the loop's wake-up pipe and
        listener must be among them: an epoll's own inode is the same for every anonymous
        descriptor, so only what it registers tells one loop from another. Never raises."""
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != _EPOLL:
                return None
        except OSError:
            return None
        registrations = _registrations(fd)
        if _by_number(registrations):
            return None  # Python's select.epoll (selectors, asyncio) or libuv: not gloo's loop
        registered = sorted((tfd, inode) for tfd, _, _, inode in registrations)
        modes: dict[int, os.stat_result] = {}
        for tfd, _ in registered:
            try:
                modes[tfd] = os.fstat(tfd)
            except OSError:
                continue
        if any(_anonymous(info) for info in modes.values()):
            return None  # an eventfd (libuv's wake-up) or another epoll: not gloo's loop
        if noted is None:
            ours: Callable[[tuple[int, int]], bool] = lambda pair: True  # noqa: E731
        else:
            ours = (noted if isinstance(noted, (set, frozenset)) else set(noted)).__contains__
        if not any(
            stat.S_ISFIFO(info.st_mode) and ours((tfd, info.st_ino)) and _anonymous_pipe(tfd)
            for tfd, info in modes.items()
        ):
            return None  # no wake-up pipe (of the noted descriptors): not gloo's loop (not this group's)
        for tfd, inode in registered:
            info = modes.get(tfd)
            if info is None or not stat.S_ISSOCK(info.st_mode) or info.st_ino != inode:
                continue  # not a socket, or the number now holds another file
            if not ours((tfd, inode)):
                continue  # opened after the group was made: another group's, or a connection
            if inode in known:
                return None  # a loop found before
            # The listener is the listening socket, not the lowest-numbered one: a connection made
            # later takes a lower number when another thread freed it meanwhile, and shutting the
            # listener down at abort made gloo's accept fail (EINVAL: std::terminate, SIGABRT).
            if endpoint_of(tfd, inode) is not None:
                return cls(fd, tfd, inode)
        return None

    @property
    def listener(self) -> Endpoint | None:
        """The listener's local endpoint (address in hex, port), asked of the socket now; None
        when the descriptor no longer is that listening socket."""
        return endpoint_of(self.listener_fd, self.listener_inode)

    def alive(self) -> bool:
        """True while the loop is still there: its epoll descriptor still registers this
        listener (after the group is destroyed the number may be reused)."""
        return (self.listener_fd, self.listener_inode) in _registered(self.epoll)

    def connections(self) -> list[tuple[int, int]]:
        """(descriptor, inode) of every connection registered on the loop now (the listener and
        gloo's wake-up pipe left out; :func:`shut_down_fd` skips what is no socket)."""
        return [(fd, ino) for fd, ino in _registered(self.epoll) if ino != self.listener_inode]

    def quiet(self) -> int:
        """Stop the loop from waking for the group's connections: right before the group is
        destroyed.

        A gloo pair whose receive buffer was freed before the peer's data came (a collective
        that raised, on this connection or another, while a receive was posted; a dropped
        ``irecv`` request) never reads again: its descriptor stays readable, gloo's loop wakes
        for it at once forever (a core at 100%), and a lazily connected group's destructor,
        which waits for the loop to go idle before it frees the pairs, never returns. Each
        pair's registration is left in place (gloo removes it later as usual) but asks for no
        event and reports at most one more. The listener, the wake-up pipe and registrations of
        a connect or handshake under way (output, or one-shot) are left alone.

        Returns:
            The number of registrations quieted. Never raises.
        """
        done = 0
        for fd, events, data, inode in _registrations(self.epoll):
            # A pair's registration asks for input alone; one that asks for output, or once
            # (EPOLLONESHOT), is a connect or a handshake under way: gloo finishes it itself.
            if inode == self.listener_inode or events & (_EPOLLOUT | _EPOLLONESHOT) or not events & _EPOLLIN:
                continue
            # The inode right before the change: a number gloo closed and reused meanwhile
            # holds another file (and another handler), which is left alone.
            with contextlib.suppress(OSError):
                info = os.fstat(fd)
                if info.st_ino == inode and stat.S_ISSOCK(info.st_mode):  # never the wake-up pipe
                    done += _disarm(self.epoll, fd, data)
        return done

    def shut_down(self) -> int:
        """Shut down every connection of the group in this process; a collective waiting on one
        raises at once, and so does the peer's on the other end.

        Returns:
            The number of connections shut down. Never raises.
        """
        return sum(shut_down_fd(fd, inode) for fd, inode in self.connections())


@dataclass(frozen=True)
class FdSlots:
    """The lowest free descriptor numbers of this process when :meth:`reserve` ran."""

    numbers: tuple[int, ...]

    @classmethod
    def reserve(cls, count: int | None = None) -> FdSlots:
        """Read the ``count`` lowest free descriptor numbers (each taken and given back at once;
        None: :data:`SLOTS` and 4 more for each further loop of :func:`loops_per_group`).

        Returns:
            The slots; empty where ``/dev/null`` cannot be opened. Never raises.
        """
        if count is None:
            count = SLOTS + 4 * (loops_per_group() - 1)
        taken: list[int] = []
        try:
            taken.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            for _ in range(count - 1):
                taken.append(os.dup(taken[0]))
        except OSError:
            pass
        finally:
            for fd in taken:
                os.close(fd)
        return cls(tuple(taken))

    def gloo_loop(self, known: Collection[int] = ()) -> GlooLoop | None:
        """Return the gloo loop a group made since :meth:`reserve` opened in these slots (see
        :meth:`GlooLoop.at`; ``known``: listener inodes of loops found before), or None (not a
        gloo group, not Linux, or not told apart from another loop: :meth:`Opened.gloo_loop`).
        Never raises."""
        return self.opened().gloo_loop(known)

    def opened(self) -> Opened:
        """Return what these slots hold now: each slot's descriptor and its inode (one ``fstat``
        each; the free ones left out). Called right after a group is made, it notes what the
        group opened, cheaply; :meth:`Opened.gloo_loop` finds the loop among them later, when an
        abort or a teardown needs it.

        When the slots do not hold a whole loop (an epoll among them registering a wake-up pipe
        and a listener also among them: one read of its registrations), more descriptors were opened
        meanwhile than the slots leave room for, or a number freed meanwhile was taken: every
        descriptor of the process is noted instead (:meth:`Opened.everything`). Never raises."""
        found = []
        modes: dict[tuple[int, int], os.stat_result] = {}
        for fd in self.numbers:
            try:
                info = os.fstat(fd)
            except OSError:
                continue
            found.append((fd, info.st_ino))
            modes[(fd, info.st_ino)] = info
        if _whole_loops(modes) >= loops_per_group():
            return Opened(
                tuple(found), epolls=tuple(fd for (fd, _), info in modes.items() if _anonymous(info))
            )
        return Opened.everything()


def _whole_loops(noted: Mapping[tuple[int, int], os.stat_result]) -> int:
    """Return how many whole gloo-like loops ``noted`` ((descriptor, inode) to its ``fstat``)
    holds: epolls among them, each registering a pipe and a listening socket also among them (a
    connection in the slots with the listener past them is not enough), with none of the marks
    of another library's loop. Cheaper than :meth:`GlooLoop.at`, which decides later: one read
    of each noted epoll's registrations and a ``getsockopt`` on the descriptor itself (a number
    reused in between only sends the group to the wide note, or back to the slots' own look)."""
    whole = 0
    for (fd, _), info in noted.items():
        if not _anonymous(info):
            continue
        registrations = _registrations(fd)
        if _by_number(registrations):
            continue  # another library's loop (GlooLoop.at rejects it the same way)
        registered = [(tfd, inode) for tfd, _, _, inode in registrations if (tfd, inode) in noted]
        if any(_anonymous(noted[pair]) for pair in registered):
            continue  # an eventfd or an epoll registered: not gloo's
        if any(stat.S_ISFIFO(noted[pair].st_mode) for pair in registered) and any(
            stat.S_ISSOCK(noted[pair].st_mode) and _listening(pair[0]) for pair in registered
        ):
            whole += 1
    return whole


def _listening(fd: int) -> bool:
    """Whether the socket at ``fd`` listens (``SO_ACCEPTCONN``), asked of the descriptor itself."""
    value, size = ctypes.c_int(0), ctypes.c_uint32(ctypes.sizeof(ctypes.c_int))
    done = _LIBC.getsockopt(
        fd, socket.SOL_SOCKET, socket.SO_ACCEPTCONN, ctypes.byref(value), ctypes.byref(size)
    )
    return bool(done == 0 and value.value)


@dataclass(frozen=True)
class Opened:
    """The descriptors a group's creation opened, with their inodes, noted right after it was
    made (:meth:`FdSlots.opened`): enough to find its gloo loop later, and to tell a number
    closed and reused since from the descriptor noted."""

    descriptors: tuple[tuple[int, int], ...]
    #: Every descriptor of the process was noted (:meth:`everything`), not only the slots.
    wide: bool = False
    #: The noted descriptors that were anonymous (an epoll among them), the only ones looked at
    #: as loops; None: every noted descriptor.
    epolls: tuple[int, ...] | None = None

    @classmethod
    def everything(cls) -> Opened:
        """Note every descriptor of the process now that could be part of a loop (epolls,
        pipes, sockets: not the regular files a process may hold by the thousand), with its
        inode (``/proc/self/fd``: a scan, made only when the slots missed a group's loop).

        Returns:
            The note, :attr:`wide`; empty where ``/proc`` cannot be read. Never raises.
        """
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            return cls((), wide=True)
        found, epolls = [], []
        for name in names:
            with contextlib.suppress(OSError, ValueError):
                info = os.fstat(int(name))
                if _anonymous(info) or stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode):
                    found.append((int(name), info.st_ino))
                if _anonymous(info):
                    epolls.append(int(name))
        return cls(tuple(sorted(found)), wide=True, epolls=tuple(sorted(epolls)))

    def gloo_loop(self, known: Collection[int] = ()) -> GlooLoop | None:
        """Return the group's first gloo loop among the noted descriptors (see :meth:`pick`;
        ``known``: listener inodes of loops found before), or None. Never raises."""
        picked = self.pick(self.loops(known))
        return picked[0] if picked else None

    def pick(self, loops: list[GlooLoop]) -> tuple[GlooLoop, ...]:
        """Return the group's loops among ``loops`` (:meth:`loops` of this note).

        A note of the slots holds only what was opened while the group was made: every loop in
        it is the group's (one per gloo device, and a ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
        helper group's, made with it; :func:`loops_per_group`), and all of them are taken. A
        :attr:`wide` note holds every loop alive when it was taken: the group's own and any
        older one not in ``known`` (a user's gloo group, a default group the user made); it
        gives a loop only when exactly one is there, since taking the wrong one would shut
        another group's connections down at abort, which is worse than none. Never raises."""
        if not self.wide or len(loops) == 1:
            return tuple(loops)
        return ()

    def loops(self, known: Collection[int] = ()) -> list[GlooLoop]:
        """Return every gloo loop among the noted descriptors whose listener is not in
        ``known``, in the order of their epoll descriptors: the candidates :meth:`gloo_loop`
        chooses from. Every loop of a note was alive when the note was taken, so none of them is
        the loop of a group made later (the guard counts them all as known for later groups).
        Never raises."""
        noted = frozenset(self.descriptors)
        found: dict[int, GlooLoop] = {}
        looked = set(self.epolls) if self.epolls is not None else None
        for fd, inode in self.descriptors:
            if looked is not None and fd not in looked:
                continue
            try:
                if os.fstat(fd).st_ino != inode:
                    continue  # closed and reused since: not the group's any more
            except OSError:
                continue
            loop = GlooLoop.at(fd, known, noted)
            if loop is not None:
                found.setdefault(loop.listener_inode, loop)
        return list(found.values())
