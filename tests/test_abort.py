"""parallelctx.abort finds the connections of given listeners in this process and shuts them
down, and nothing else (what gpc.abort() does to gloo groups; the multi-process case, a hung
all-reduce ended by gpc.abort(), is in tests/test_elastic.py under the faults marker)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallelctx import abort

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def gloo_register(epoll: object, fd: int) -> None:
    """Register ``fd`` for input on ``epoll`` as gloo does, with a handler's address as the data
    (Python's ``epoll.register`` puts the descriptor's own number there, the mark of another
    library's loop, which the guard never takes for a gloo group's)."""
    import ctypes

    from parallelctx.guard.sockets import _LIBC, _EpollEvent

    event = _EpollEvent(0x001, 0x7F3A5C000010 + 0x40 * fd)  # a heap address, as gloo's
    assert _LIBC.epoll_ctl(epoll.fileno(), 1, fd, ctypes.byref(event)) == 0  # type: ignore[attr-defined]


def pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname()[:2], timeout=5)
    served, _ = listener.accept()
    return client, served


def test_the_connections_of_a_new_listener_are_shut_down_and_no_others() -> None:
    before = set(abort.listening())
    gloo_like, other = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    try:
        ours = abort.new_listeners(before, exclude_ports=[other.getsockname()[1]])
        assert [port for _, port in ours] == [gloo_like.getsockname()[1]]
        client, served = pair(gloo_like)
        keep_client, keep_served = pair(other)
        client.settimeout(5)
        keep_client.settimeout(0.2)
        assert abort.shut_down(ours) == 2  # the accepted end and the connecting end
        start = time.monotonic()
        assert client.recv(1) == b""  # a reader waiting on it sees the end at once
        assert time.monotonic() - start < 1
        keep_served.sendall(b"x")
        assert keep_client.recv(1) == b"x"  # the other listener's connection still works
        for s in (client, served, keep_client, keep_served):
            s.close()
    finally:
        gloo_like.close()
        other.close()


def test_listeners_posted_on_a_store_are_read_back() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    kv = dist.PrefixStore("parallelctx/launch-1/", server)
    abort.post_listeners(kv, 1, [("0100007F", 4000)])
    abort.post_listeners(kv, 2, [("0100007F", 4001), ("00000000", 4002)])
    got = abort.read_listeners(kv, 0, 4, timeout=5)  # rank 3 posted nothing
    assert sorted(got or []) == [("00000000", 4002), ("0100007F", 4000), ("0100007F", 4001)]


def test_a_store_that_cannot_be_read_gives_none_at_once() -> None:
    start = time.monotonic()
    assert abort.read_listeners(object(), 0, 2, timeout=5) is None
    assert time.monotonic() - start < 1


def test_wake_connects_to_a_listener_once_in_each_peers_name() -> None:
    # What a gloo listener of a lazily connected group reads from a connecting peer: its rank in
    # the group, a native 64-bit number. wake() sends every peer's rank but this rank's own.
    import struct

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    port = listener.getsockname()[1]
    try:
        assert abort.wake({("0100007F", port): (2, 4)}) == 3
        seen = []
        for _ in range(3):
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                data = b""
                while len(data) < 8:
                    chunk = conn.recv(8 - len(data))
                    assert chunk, "closed before the rank was sent"
                    data += chunk
                seen.append(struct.unpack("=Q", data)[0])
                assert conn.recv(1) == b""  # then the end: a waiting pair raises at once
        assert sorted(seen) == [0, 1, 3]
    finally:
        listener.close()
    assert abort.wake({("0100007F", port): (0, 2)}) == 0  # a listener gone: skipped, no error


def test_listening_asks_own_sockets_and_agrees_with_the_proc_tables() -> None:
    """``listening()`` reads this process's sockets, not the system-wide /proc/net/tcp tables
    (issue 26: tens of ms per launch on a busy machine), and gives what the tables give."""
    import socket

    from parallelctx import abort

    made = []
    for family, address in (
        (socket.AF_INET, "127.0.0.1"),
        (socket.AF_INET, "0.0.0.0"),
        (socket.AF_INET6, "::1"),
    ):
        sock = socket.socket(family)
        sock.bind((address, 0))
        sock.listen()
        made.append(sock)
    bound_only = socket.socket()
    bound_only.bind(("127.0.0.1", 0))
    made.append(bound_only)
    try:
        from_tables = {i: local for i, _, local, _, state in abort._tcp_sockets() if state == abort._LISTEN}
        found = abort.listening()
        assert found == from_tables
        ports = {port for _, port in found.values()}
        assert {s.getsockname()[1] for s in made[:3]} <= ports
        assert bound_only.getsockname()[1] not in ports
    finally:
        for sock in made:
            sock.close()


@pytest.mark.faults
@pytest.mark.timeout(200)
def test_the_signal_recipe_of_the_docs_ends_a_hung_all_reduce(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A Python signal handler would run only after the call's 30 s timeout; the recipe's
    # wakeup-fd thread aborts 1 s in, and the relaunch in the same processes works.
    from torchrun_helpers import run_torchrun

    proc = run_torchrun(2, ["tests/torchrun_abort_signal.py", str(tmp_path)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rank0 = json.loads((tmp_path / "rank-0.json").read_text())
    assert rank0["raised"] is not None and rank0["ended_s"] < 1.0 + 2.0, rank0
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text())["relaunch_sum"] == 3.0


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_abort_ends_the_all_reduce_while_another_thread_churns_event_loops(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # skeptic-34: with a thread opening event loops during the launch, the guard took that
    # thread's loop for a group's, or a connection for the listener; abort then left the
    # all-reduce waiting, or gloo's accept failed and std::terminate killed the rank (SIGABRT).
    # A group whose epoll or listener took a number the thread freed outside the slots was not
    # found (3 runs in 4 on 2026-12-06, a connection in the slots taken for a whole loop): now
    # every descriptor is noted then, and the thread's loops (no pipe) are never candidates, so
    # every group is found and every rank's all-reduce ends within 2 s of abort.
    from torchrun_helpers import run_torchrun

    for _ in range(2):
        proc = run_torchrun(4, ["tests/torchrun_abort_churn.py", str(tmp_path)], timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for rank in range(4):
            row = json.loads((tmp_path / f"rank-{rank}.json").read_text())
            assert not row["missed"], row
            if rank != 3:
                assert row["raised"] is not None, row
                assert row["ended_s"] < 1.5 + 2.0, row
            assert row["relaunch_sums"] == [4.0, 2.0], row


def test_listening_skips_a_descriptor_reused_for_another_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    # Between reading /proc/self/fd and duplicating a descriptor, the socket may close and its
    # number be reused for another socket: that one must not be reported under the old inode.
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        real = os.fstat(listener.fileno()).st_ino
        monkeypatch.setattr(abort, "_socket_fds", lambda: {real + 10**9: listener.fileno()})
        assert abort.listening() == {}
        monkeypatch.setattr(abort, "_socket_fds", lambda: {real: listener.fileno()})
        assert abort.listening() == {real: ("0100007F", listener.getsockname()[1])}
    finally:
        listener.close()


def test_another_threads_event_loop_in_the_slots_is_not_taken_for_a_gloo_loop() -> None:
    # An event loop another thread opens while a group is made lands in the same free slots: a
    # selectors server (epoll + listener) and an asyncio loop (epoll + socketpair) were taken
    # for the group's gloo loop, so gpc.abort() shut down that thread's connections and left
    # the group's collective waiting (skeptic-34, a thread churning loops during a launch).
    import asyncio
    import selectors

    from parallelctx.guard.sockets import FdSlots

    slots = FdSlots.reserve()
    server = socket.create_server(("127.0.0.1", 0))
    selector = selectors.EpollSelector()
    selector.register(server, selectors.EVENT_READ)
    loop = asyncio.new_event_loop()
    try:
        assert slots.gloo_loop() is None
    finally:
        loop.close()
        selector.close()
        server.close()


def test_the_loops_listener_is_the_listening_socket_not_the_lowest_numbered() -> None:
    # A connection gloo makes after its listener takes a lower descriptor number when another
    # thread freed one meanwhile; the lowest-numbered socket was noted as the listener, and
    # abort shut the real listener down: gloo's accept failed with EINVAL and std::terminate
    # killed the rank (SIGABRT; skeptic-34).
    import select

    from parallelctx.guard.sockets import GlooLoop

    hole = os.open(os.devnull, os.O_RDONLY)  # a number another thread frees later
    wake_r, wake_w = os.pipe()  # gloo's wake-up pipe, registered on its loop
    epoll = select.epoll()
    listener = socket.create_server(("127.0.0.1", 0))
    gloo_register(epoll, wake_r)
    gloo_register(epoll, listener.fileno())
    os.close(hole)
    client, served = pair(listener)  # ``client`` (or ``served``) takes the freed lower number
    low = client if client.fileno() < served.fileno() else served
    gloo_register(epoll, low.fileno())
    try:
        assert low.fileno() < listener.fileno()
        found = GlooLoop.at(epoll.fileno())
        assert found is not None
        assert (found.listener_fd, found.listener_inode) == (
            listener.fileno(),
            os.fstat(listener.fileno()).st_ino,
        )
        assert found.shut_down() == 1  # the connection, never the listener
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    finally:
        epoll.close()
        for s in (client, served, listener):
            s.close()
        os.close(wake_r)
        os.close(wake_w)


def test_a_loop_watching_a_named_fifo_is_not_taken_for_a_gloo_loop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # gloo's wake-up pipe is anonymous; another thread's loop watching a FIFO made by mkfifo and a
    # listener was taken for a gloo loop once pipes were told apart by fstat alone (skeptic, 2026-12-05)
    import select

    from parallelctx.guard.sockets import GlooLoop

    path = tmp_path / "fifo"
    os.mkfifo(path)
    fifo = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    listener = socket.create_server(("127.0.0.1", 0))
    epoll = select.epoll()
    gloo_register(epoll, fifo)
    gloo_register(epoll, listener.fileno())
    wake_r, wake_w = os.pipe()
    gloo_like = select.epoll()
    gloo_register(gloo_like, wake_r)
    gloo_register(gloo_like, listener.fileno())
    try:
        assert GlooLoop.at(epoll.fileno()) is None
        assert GlooLoop.at(gloo_like.fileno()) is not None  # the same listener with an anonymous pipe
    finally:
        epoll.close()
        gloo_like.close()
        listener.close()
        os.close(fifo)
        os.close(wake_r)
        os.close(wake_w)


def test_a_loop_found_later_is_the_groups_own_not_one_in_a_number_reused_since() -> None:
    # The loop is looked for among the noted slots when an abort first needs it. A slot that
    # held another thread's eventfd when the group was made, closed since and now holding another
    # group's epoll, has the same inode (every anonymous descriptor shares one): that group's loop
    # was taken, so gpc.abort() shut down the user's own group and left gpc's collective waiting
    # (skeptic, 2026-12-05). The loop's pipe and listener must be noted descriptors.
    import select

    from parallelctx.guard.sockets import FdSlots

    def gloo_like() -> tuple[select.epoll, int, int, socket.socket]:
        wake_r, wake_w = os.pipe()
        epoll = select.epoll()
        listener = socket.create_server(("127.0.0.1", 0))
        gloo_register(epoll, wake_r)
        gloo_register(epoll, listener.fileno())
        return epoll, wake_r, wake_w, listener

    slots = FdSlots.reserve()
    others = [os.eventfd(0) for _ in range(3)]  # another thread's, opened while the group is made
    ours = gloo_like()
    opened = slots.opened()
    for fd in others:
        os.close(fd)
    theirs = gloo_like()  # made later (the user's group): takes the numbers freed
    try:
        assert theirs[0].fileno() in slots.numbers  # an epoll in a noted number, same inode as noted
        found = opened.gloo_loop()
        assert found is not None
        assert (found.epoll, found.listener_fd) == (ours[0].fileno(), ours[3].fileno())
    finally:
        for epoll, wake_r, wake_w, listener in (ours, theirs):
            epoll.close()
            listener.close()
            os.close(wake_r)
            os.close(wake_w)


@pytest.mark.parametrize("moved", ["pipe", "listener", "epoll"])
def test_a_loop_that_took_a_number_another_thread_freed_is_found_or_none_but_never_another(
    moved: str,
) -> None:
    # Another thread holds a descriptor at the lowest free number when the slots are read and
    # closes it while the group is made; gloo's pipe or listener takes that number, below the
    # slots, and the first look (among the slots) misses the loop: gpc.abort() then left the
    # group's all-reduce waiting until a peer closed (torchrun_abort_churn.py, 4 runs in 10 on
    # 2026-12-05). Only a loop whose epoll, pipe and listener were all noted is taken: any looser
    # rule took another thread's loop in some order of events (skeptic, 2026-12-05), and a wrong
    # loop is worse than none (abort then shuts another thread's connections down).
    import select

    from parallelctx.guard.sockets import FdSlots

    def gloo_like(churned: int | None = None) -> tuple[select.epoll, int, int, socket.socket]:
        def free(part: str) -> None:
            if churned is not None and moved == part:
                os.close(churned)  # the other thread closes its descriptor now

        free("epoll")
        epoll = select.epoll()
        free("pipe")
        wake_r, wake_w = os.pipe()
        free("listener")
        listener = socket.create_server(("127.0.0.1", 0))
        gloo_register(epoll, wake_r)
        gloo_register(epoll, listener.fileno())
        return epoll, wake_r, wake_w, listener

    earlier = gloo_like()  # a loop made before (another group's): never taken for this one
    churned = os.eventfd(0)  # the other thread's, open while the slots are read
    slots = FdSlots.reserve()
    ours = gloo_like(churned)
    opened = slots.opened()
    later = gloo_like()  # made after (the user's group)
    try:
        moved_fd = {"epoll": ours[0].fileno(), "pipe": ours[1], "listener": ours[3].fileno()}[moved]
        assert churned < min(slots.numbers) and moved_fd == churned  # it left the slots
        # not found (the guard warns; the group's collective ends at its peers' exit or timeout),
        # and never the loop made before or after: a second look that took a loop whose pipe or
        # listener alone was noted took another thread's loop (skeptic, 2026-12-05)
        assert opened.gloo_loop() is None
    finally:
        for epoll, wake_r, wake_w, listener in (earlier, ours, later):
            epoll.close()
            listener.close()
            os.close(wake_r)
            os.close(wake_w)


def test_another_threads_loop_whose_epoll_took_a_freed_number_is_never_taken() -> None:
    # skeptic, 2026-12-05: user code closes a file and starts a TCPStore server (a libuv loop: an
    # epoll, a wake-up pipe, a listener) while gpc makes its world group; the server's epoll takes
    # the freed number below the slots, its pipe and listener take slots, and the group's loop
    # (made after) has its listener beyond the slots. A second look over the numbers near the
    # slots took the server's loop, so gpc.abort() shut the user's store down and left the
    # all-reduce waiting. The server's loop is never taken.
    import select

    from parallelctx.guard.sockets import FdSlots

    hole = os.open(os.devnull, os.O_RDONLY)
    slots = FdSlots.reserve()
    os.close(hole)
    theirs_epoll = select.epoll()  # the user's loop: its epoll in the freed number
    theirs_r, theirs_w = os.pipe()
    theirs_listener = socket.create_server(("127.0.0.1", 0))
    gloo_register(theirs_epoll, theirs_r)
    gloo_register(theirs_epoll, theirs_listener.fileno())
    ours_epoll = select.epoll()  # the group's, in the slots after it
    ours_r, ours_w = os.pipe()
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(max(slots.numbers) - ours_w)]
    ours_listener = socket.create_server(("127.0.0.1", 0))  # beyond the slots
    gloo_register(ours_epoll, ours_r)
    gloo_register(ours_epoll, ours_listener.fileno())
    opened = slots.opened()
    try:
        assert theirs_epoll.fileno() == hole and ours_listener.fileno() > max(slots.numbers)
        found = opened.gloo_loop()
        assert found is None or (found.epoll, found.listener_fd) == (
            ours_epoll.fileno(),
            ours_listener.fileno(),
        )
    finally:
        for fd in [*fillers, theirs_r, theirs_w, ours_r, ours_w]:
            os.close(fd)
        for thing in (theirs_epoll, theirs_listener, ours_epoll, ours_listener):
            thing.close()


def _gloo_like() -> tuple[object, int, int, socket.socket]:
    """An epoll registering an anonymous pipe and a listener, as gloo's loop does."""
    import select

    wake_r, wake_w = os.pipe()
    epoll = select.epoll()
    listener = socket.create_server(("127.0.0.1", 0))
    gloo_register(epoll, wake_r)
    gloo_register(epoll, listener.fileno())
    return epoll, wake_r, wake_w, listener


def _loops_alive() -> set[int]:
    """Listener inodes of every gloo-like loop in this process now (earlier tests' included)."""
    from parallelctx.guard.sockets import GlooLoop

    return {loop.listener_inode for name in os.listdir("/proc/self/fd") if (loop := GlooLoop.at(int(name)))}


def _past_the_slots(slots: object, others: list[int]) -> list[int]:
    """Open descriptors into ``others`` until the next one opened lands past ``slots`` (another
    thread's, opened while the group is made); returns ``others``."""
    while not others or others[-1] < max(slots.numbers):  # type: ignore[attr-defined]
        others.append(os.open(os.devnull, os.O_RDONLY))
    return others


def _finds(opened: object, known: set[int], epoll: int, listener: int) -> None:
    """Assert that ``opened`` (a note) gives the loop of ``epoll`` and ``listener`` (descriptor
    numbers) as the group's, ``known`` (the loops alive before) left out."""
    found = opened.gloo_loop(known)  # type: ignore[attr-defined]
    assert found is not None and (found.epoll, found.listener_fd) == (epoll, listener), found


def _close(*loops: tuple[object, int, int, socket.socket]) -> None:
    for epoll, wake_r, wake_w, listener in loops:
        epoll.close()  # type: ignore[attr-defined]
        listener.close()
        os.close(wake_r)
        os.close(wake_w)


@pytest.mark.parametrize("moved", [None, "listener", "epoll"])
def test_a_loop_pushed_past_the_slots_is_found_when_it_is_the_only_new_loop(moved: str | None) -> None:
    # A user thread opening sockets without pause (a listener every 5 ms) while a lazy group
    # waits on its peers takes more numbers than the slots leave room for: gloo's loop landed
    # past them, was not found, and gpc.abort() left a rank's wait on a group that never
    # connected to end at dist.timeout, so the next launch timed out
    # (torchrun_abort_megatron_lazy.py: CI on 2026-12-05 and 2026-12-06, 25 groups missed in one
    # run here). The slots seen not to hold a whole loop, every descriptor is noted, and the one
    # loop not known is the group's.
    from parallelctx.guard.sockets import SLOTS, FdSlots

    known = _loops_alive()
    hole = os.open(os.devnull, os.O_RDONLY)
    slots = FdSlots.reserve()
    others = [os.open(os.devnull, os.O_RDONLY) for _ in range(SLOTS)]  # the other thread's
    if moved == "listener":  # only the listener past the slots: pipe and epoll in them
        os.close(others.pop())
        os.close(others.pop())
        os.close(others.pop())
    if moved == "epoll":  # a number freed below the slots meanwhile, and the rest past them
        os.close(hole)
    ours = _gloo_like()
    opened = slots.opened()
    try:
        assert opened.wide
        _finds(opened, known, ours[0].fileno(), ours[3].fileno())  # type: ignore[attr-defined]
    finally:
        _close(ours)
        for fd in others:
            os.close(fd)
        if moved != "epoll":
            os.close(hole)


def test_a_wide_note_with_two_new_loops_gives_none() -> None:
    # Another thread's gloo-like loop (a pipe and a listener: a user's own gloo group, a
    # selectors server with a self-pipe) made while the group is made cannot be told from the
    # group's once both are past the slots: taking either could shut the user's connections
    # down at abort and leave the group's wait, so neither is taken (the guard warns).
    from parallelctx.guard.sockets import SLOTS, FdSlots

    known = _loops_alive()
    slots = FdSlots.reserve()
    others = [os.open(os.devnull, os.O_RDONLY) for _ in range(SLOTS)]
    theirs, ours = _gloo_like(), _gloo_like()
    opened = slots.opened()
    try:
        assert opened.wide and opened.gloo_loop(known) is None
        # told the other loop, the group's is found
        found = opened.gloo_loop(known | {os.fstat(theirs[3].fileno()).st_ino})
        assert found is not None and found.listener_fd == ours[3].fileno()
    finally:
        _close(theirs, ours)
        for fd in others:
            os.close(fd)


def test_a_loop_with_a_connection_in_the_slots_and_its_listener_past_them_is_found() -> None:
    # An eager group connects as it is made: a connection registered on the loop landed in the
    # slots while the listener went past them, and the slots were taken for a whole loop (an
    # epoll registering a noted pipe and a noted socket), so the loop was not found
    # (torchrun_abort_churn.py, 3 runs in 4 here). The listener must be among the slots.
    import select

    from parallelctx.guard.sockets import SLOTS, FdSlots

    known = _loops_alive()
    slots = FdSlots.reserve()
    others = [os.open(os.devnull, os.O_RDONLY) for _ in range(SLOTS - 4)]  # room for 4 of ours
    wake_r, wake_w = os.pipe()
    epoll = select.epoll()
    peer = socket.socket()  # the peer's listener is elsewhere; this end is in the last slot
    far = socket.create_server(("127.0.0.1", 0))
    peer.connect(far.getsockname())
    listener = socket.create_server(("127.0.0.1", 0))  # past the slots
    for fd in (wake_r, listener.fileno(), peer.fileno()):
        gloo_register(epoll, fd)
    opened = slots.opened()
    served = far.accept()[0]
    try:
        assert peer.fileno() in slots.numbers and listener.fileno() > max(slots.numbers)
        assert opened.wide
        _finds(opened, known, epoll.fileno(), listener.fileno())
    finally:
        epoll.close()
        for sock in (peer, far, listener, served):
            sock.close()
        for fd in (wake_r, wake_w, *others):
            os.close(fd)


@pytest.mark.parametrize("pushed", [False, True])
def test_another_librarys_loop_with_a_pipe_and_a_listener_is_never_taken(pushed: bool) -> None:
    # skeptic, 2026-12-06: a selectors server with a self-pipe (os.pipe) and a listener, started
    # by another thread while a group is made, looks like gloo's loop: the first in the slots was
    # taken, so gpc.abort() shut the server's connections down and the teardown quieted its
    # registrations (the server never saw its client again; about 1 run in 20 with a real
    # thread). Pushed: with the group's loop past the slots, the slots were still taken to hold
    # a whole loop (the server's) and the group's was missed. Python's select.epoll (selectors,
    # asyncio) and libuv register a descriptor by its number, gloo by a handler's address.
    import selectors

    from parallelctx.guard.sockets import FdSlots

    known = _loops_alive()
    slots = FdSlots.reserve()
    selector = selectors.EpollSelector()
    self_r, self_w = os.pipe()
    server = socket.create_server(("127.0.0.1", 0))
    selector.register(self_r, selectors.EVENT_READ)
    selector.register(server, selectors.EVENT_READ)
    others = _past_the_slots(slots, []) if pushed else []
    ours = _gloo_like()
    opened = slots.opened()
    try:
        assert opened.wide == pushed
        _finds(opened, known, ours[0].fileno(), ours[3].fileno())  # type: ignore[attr-defined]
    finally:
        _close(ours)
        selector.close()
        server.close()
        for fd in (self_r, self_w, *others):
            os.close(fd)


@pytest.mark.parametrize("store_in_slots", [False, True])
def test_a_tcpstore_servers_loop_is_never_taken_for_a_groups(store_in_slots: bool) -> None:
    # A TCPStore server (libuv: an epoll registering a pipe and a listener, like gloo's, and an
    # eventfd, unlike it) started while a group is made, the group's loop past the slots: the
    # group's loop is the one found. In the slots: the server's loop filled them and was taken to
    # hold a whole loop, so no wide note was made and the group's was missed (skeptic, 2026-12-06).
    from parallelctx.guard.sockets import SLOTS, FdSlots, GlooLoop

    known = _loops_alive()
    slots = FdSlots.reserve()
    others = [] if store_in_slots else [os.open(os.devnull, os.O_RDONLY) for _ in range(SLOTS)]
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    _past_the_slots(slots, others)
    ours = _gloo_like()
    opened = slots.opened()
    try:
        assert opened.wide
        servers = [
            fd
            for fd, _ in opened.descriptors
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventpoll]"
        ]
        assert not any(GlooLoop.at(fd, known) and fd != ours[0].fileno() for fd in servers)  # type: ignore[attr-defined]
        _finds(opened, known, ours[0].fileno(), ours[3].fileno())  # type: ignore[attr-defined]
    finally:
        _close(ours)
        del store
        for fd in others:
            os.close(fd)


_REAL = """
import gc, os
from datetime import timedelta
import torch.distributed as dist
from parallelctx.guard.core import Guard
from parallelctx.guard.sockets import SLOTS, FdSlots
from parallelctx.runtime.groups import GroupMaker

guard = Guard()
slots = FdSlots.reserve()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
guard.hold(dist.group.WORLD, slots)
maker = GroupMaker(guard, timedelta(seconds=30), world_size=1)
real, others = dist.new_group, []

def crowded(*args, **kwargs):
    others.extend(os.open(os.devnull, os.O_RDONLY) for _ in range(SLOTS))  # another thread's
    return real(*args, **kwargs)

def gone(name):
    \"\"\"Release and destroy the group of global ``name`` and drop every reference to it;
    return its loop as found before.\"\"\"
    group = globals().pop(name)
    loop = {id(h.group): loop for h, loop in guard._found_loops()}[id(group)]
    guard.release([group])
    dist.destroy_process_group(group)
    maker.made[:] = [h for h in maker.made if h.group is not group]
    del group
    gc.collect()
    return loop
"""


def _run_real(tmp_path, body: str, **env: str) -> None:  # type: ignore[no-untyped-def]
    """Run ``body`` after :data:`_REAL` (a fresh process of one rank, torch's gloo, a guard and
    a group maker as a launch has them, ``crowded``: another thread's descriptors opened while
    a group is made; ``env`` added to its environment); it must print OK."""
    import subprocess

    script = tmp_path / "real.py"
    script.write_text(_REAL + body + '\nprint("OK")\n')
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_a_real_gloo_groups_loop_past_the_slots_is_its_own(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # torch's gloo, groups made as a launch makes them: groups of one rank (gloo gives each a
    # loop: not noted, they were taken for a later group's, or made it ambiguous, seen in the
    # lazy-bridge loop) and a group whose loop another thread's descriptors push past the
    # slots. The loop found is the group's: it goes when the group is destroyed, the others stay.
    _run_real(
        tmp_path,
        """
singles = [maker.new_group([0], f"single{i}") for i in range(3)]
dist.new_group = crowded
group = maker.new_group([0], "crowded")
dist.new_group = real
assert maker.made[-1].group is group and maker.made[-1].opened.wide
loops = {id(h.group): loop for h, loop in guard._found_loops()}
assert len(loops) == 5 and len({loop.epoll for loop in loops.values()}) == 5, loops
ours = gone("group")
assert not ours.alive(), ours
assert all(loop.alive() for loop in loops.values() if loop is not ours)
""",
    )


def test_a_users_gloo_group_makes_one_wide_note_ambiguous_not_the_next(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A user's own gloo group (plain dist.new_group, not held) is a loop the guard never found:
    # in a wide note beside the group's, the two cannot be told apart (None, warned). Every loop
    # of that note was alive before any later group was made, so the next wide note's group is
    # found (its loop the one loop not seen before); before, every later wide note was ambiguous.
    _run_real(
        tmp_path,
        """
users = dist.new_group([0], backend="gloo")  # the user's, never held
dist.new_group = crowded
first = maker.new_group([0], "first")
second = maker.new_group([0], "second")
dist.new_group = real
assert all(held.opened.wide for held in maker.made)
loops = {id(h.group): loop for h, loop in guard._found_loops()}
assert id(first) not in loops, loops  # the user's loop beside it: not told apart
ours = gone("second")
assert not ours.alive(), ours  # it was the second group's own loop
# after a teardown (the next launch), the user's loop is still known: found again
guard.release()
dist.new_group = crowded
third = maker.new_group(None, "third", local=False)  # a new name: not the destroyed one's
dist.new_group = real
assert maker.made[-1].opened.wide
ours = gone("third")
assert not ours.alive(), ours
""",
    )


def test_a_group_with_two_loops_has_both_found_and_the_debug_helpers_freed_numbers_do_not_matter(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    # skeptic, 2026-12-06: under TORCH_DISTRIBUTED_DEBUG=DETAIL torch makes a gloo helper group
    # beside each group (its collectives' checks run there), and GLOO_SOCKET_IFNAME=lo,lo gives
    # a group one gloo device, one loop, per interface. Only the first loop in the slots was
    # taken: when another thread freed numbers between the group's backend and the helper, the
    # helper's loop came first and the group's own was never reached (abort left its collective
    # waiting); with two interfaces, half the group's connections were out of reach.
    _run_real(
        tmp_path,
        """
import torch.distributed.distributed_c10d as c10d
held_open, made = [], []
real_wrap = c10d._create_process_group_wrapper

def opening(*args, **kwargs):
    held_open.extend(os.open(os.devnull, os.O_RDONLY) for _ in range(3))  # another thread's
    return real(*args, **kwargs)

def wrap(*args, **kwargs):
    while held_open:
        os.close(held_open.pop())  # ...closed before the helper group is made
    made.append(True)
    return real_wrap(*args, **kwargs)

dist.new_group, c10d._create_process_group_wrapper = opening, wrap
group = maker.new_group([0], "detail")
dist.new_group, c10d._create_process_group_wrapper = real, real_wrap
assert made, "no DETAIL wrapper made"
loops = [loop for h, loop in guard._found_loops() if h.group is group]
assert len(loops) == 2 and len({loop.epoll for loop in loops}) == 2, loops
gone("group")
assert not any(loop.alive() for loop in loops), loops
""",
        TORCH_DISTRIBUTED_DEBUG="DETAIL",
    )
    _run_real(
        tmp_path,
        """
group = maker.new_group([0], "two")
loops = [loop for h, loop in guard._found_loops() if h.group is group]
assert len(loops) == 2 and len({loop.epoll for loop in loops}) == 2, loops
gone("group")
assert not any(loop.alive() for loop in loops), loops
""",
        GLOO_SOCKET_IFNAME="lo,lo",
    )
