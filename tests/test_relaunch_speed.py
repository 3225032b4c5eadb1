"""A relaunch in the same processes makes no new connection to the rendezvous store.

Every new TCPStore connection costs a reverse DNS lookup at both ends: torch formats the other
end's address with ``getnameinfo`` when a client connects and when the store server accepts (the
server in its only thread). For a store on the same host that address is ``::ffff:127.0.0.1``
(torch connects over IPv6 first, to a dual-stack listener), which no ``/etc/hosts`` names, so the
lookup goes to the DNS server, and a query it drops holds that end for glibc's resolver timeout,
5 s; at the server, every rank at once. A relaunch after ``gpc.destroy()`` (the pytest plugin's
between tests, an in-process restart) that made its two connections per rank (the attempt's line
and its bell, runtime/bell.py) anew took 5.1 s instead of 0.15 s every few launches here. The launch attempt's line and bell connection are now
taken over by the next attempt; this checks that directly (the sockets of each process to or
from the store's port stay the same across relaunches), not the timing, which depends on the
DNS server. The unit tests check the take-over rules on a store in this process.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from parallelctx.runtime.bell import Bell, Line

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

WORLD = 4
LAUNCHES = 4
WAIT = timedelta(seconds=30)


def _tcp_ports() -> dict[int, tuple[int, int, str]]:
    """Socket inode -> (local port, remote port, state) of every TCP socket on this host."""
    out: dict[int, tuple[int, int, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
            out[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return out


def _store_connections(port: int) -> list[list[int]]:
    """The connections of this process to the store at ``port`` (clients) and, in the process
    that serves it, from it (accepted): sorted [inode, local port, remote port]."""
    mine = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(int(target[8:-1]))
    found = []
    for inode, (local, remote, state) in _tcp_ports().items():
        if inode in mine and state != "0A" and port in (local, remote):  # 0A: listening
            found.append([inode, local, remote])
    return sorted(found)


def relaunching_worker(rank: int, world: int, port: int, out: str) -> None:
    """Launch ``LAUNCHES`` times in this process (destroying in between) and write the store
    connections seen after each launch (module level: spawned processes import it)."""
    import parallelctx
    from parallelctx import gpc

    seen = []
    for tensor in (2, 1, 4, 2)[:LAUNCHES]:
        config = {"parallel": {"tensor": tensor}, "dist": {"timeout": 120, "backend": "gloo"}}
        parallelctx.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)
        seen.append(_store_connections(port))
        gpc.destroy()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))


@pytest.mark.timeout(240)
def test_a_relaunch_makes_no_new_store_connection(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from parallelctx.launch import free_port

    port = free_port()
    ctx = mp.start_processes(
        relaunching_worker,
        args=(WORLD, port, str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    try:
        while not ctx.join(timeout=200):
            pass
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    for rank in range(WORLD):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(seen) == LAUNCHES
        for launch, connections in enumerate(seen[1:], start=1):
            assert connections == seen[0], (
                f"rank {rank}: launch {launch} connected anew: {connections} != {seen[0]}"
            )
        # the rank's own connection, the attempt's line and its bell's: 3 per client process
        # (rank 0 also holds the server's end of every rank's: 3 * WORLD more)
        assert len(seen[0]) == 3 + (3 * WORLD if rank == 0 else 0), (rank, seen[0])


# --------------------------------------------------------------------------- the take-over rules
@pytest.fixture
def server() -> Any:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=WAIT, wait_for_workers=False)
    yield store
    del store


def test_the_next_line_takes_over_a_whole_line_and_can_still_be_cut(server: dist.TCPStore) -> None:
    first = Line(server)
    assert not first.reused and first.store is not server
    second = Line(server, first)
    assert second.reused and second.store is first.store
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            second.store.wait(["never"], WAIT)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.2)  # inside torch's wait, on the taken-over connection
    assert second.cut() == 1
    thread.join(5)
    assert not thread.is_alive() and errors
    assert not Line(server, second).reused  # a cut line is never taken over
    server.set("own", "1")
    assert server.get("own") == b"1"  # the rank's own connection is untouched


def test_a_line_is_not_taken_over_by_another_store_nor_while_held_or_busy(
    server: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=WAIT)
    first = Line(server)
    assert not Line(other, first).reused
    assert first.hold()
    assert not Line(server, first).reused
    first.release()
    assert Line(server, first).reused
    # a wait of torch's still running on it (a group that outlived its launch) holds it
    import parallelctx.runtime.bell as bell

    monkeypatch.setattr(bell, "_PROBE_S", 0.2)
    thread = threading.Thread(target=lambda: first.store.wait(["late"], timedelta(seconds=2)), daemon=True)
    thread.start()
    time.sleep(0.1)
    begin = time.monotonic()
    assert not Line(server, first).reused
    assert time.monotonic() - begin < 1.5
    server.set("late", "1")
    thread.join(5)
    for probe in [t for t in threading.enumerate() if t.name == "parallelctx-line-probe"]:
        probe.join(5)  # the probe that gave up, answered once the wait ended
    assert Line(server, first).reused


def test_a_connection_with_bytes_nobody_read_or_closed_by_its_peer_is_not_whole() -> None:
    # A request of torch's cut short leaves its answer unread: the stream is out of step, and the
    # next attempt's first request would read it as its own answer.
    import socket

    from parallelctx.runtime.bell import _idle

    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        peer, _ = listener.accept()
        with client, peer:
            inode = os.fstat(client.fileno()).st_ino
            assert _idle(client.fileno(), inode)
            assert not _idle(client.fileno(), inode + 1)  # another file at that number now
            peer.sendall(b"x")
            time.sleep(0.05)
            assert not _idle(client.fileno(), inode)
            assert client.recv(1) == b"x"
            assert _idle(client.fileno(), inode)  # the peek took nothing: torch's stream is intact
            peer.close()
            time.sleep(0.05)
            assert not _idle(client.fileno(), inode)


def test_the_next_bell_listens_on_the_last_bells_connection(server: dist.TCPStore) -> None:
    line, halted = Line(server), threading.Event()
    first = Bell(server, "a/", 0, line, halted, WAIT)
    assert first.spare() is None  # still listening
    assert first.stop() is None
    ear = first.spare()
    assert ear is not None
    second = Bell(server, "b/", 0, Line(server, line), halted, WAIT, ear)
    assert second.spare() is None
    server.set("b/bell/0", "1")  # rank 1 abandoned the attempt b/
    deadline = time.monotonic() + 5
    while not halted.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert halted.is_set() and second.heard is not None and second.heard.rank == 1
    assert second.stop() is not None
    assert second.spare() is ear


def test_a_taken_over_line_and_ear_wait_with_the_new_launchs_timeout(server: dist.TCPStore) -> None:
    # A clone takes the base store's timeout when it is made, and each launch sets the base's to
    # its dist.timeout first: a connection taken over must get it too, not keep the timeout of
    # the launch that made it (torch's groups of the new launch wait on the line with it)
    line, halted = Line(server), threading.Event()
    bell = Bell(server, "a/", 0, line, halted, WAIT)
    bell.stop()
    ear = bell.spare()
    assert ear is not None
    short = timedelta(seconds=0.5)
    server.set_timeout(short)  # the next launch's dist.timeout
    taken = Line(server, line)
    assert taken.reused
    Bell(server, "b/", 0, taken, halted, WAIT, ear).stop()
    assert taken.store.timeout == short and ear.timeout == short
    begin = time.monotonic()
    with pytest.raises(Exception):
        dist.PrefixStore("b/", taken.store).get("never")
    assert time.monotonic() - begin < 5.0


@pytest.mark.parametrize("default", [None, 3.0])
@pytest.mark.parametrize("owner_blocking", [True, False])
def test_looking_at_a_socket_never_changes_its_owners_mode_even_for_a_moment(
    owner_blocking: bool, default: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The duplicate shares O_NONBLOCK with the owner's descriptor, which the owner's threads use
    # meanwhile: a gloo socket (non-blocking) turned blocking while parallelctx looked at it,
    # gloo's loop, which reads until EAGAIN, could block there. Every mode the socket had while a
    # socket object over it was made or set is recorded.
    import socket

    from parallelctx.guard.sockets import endpoint_of, shut_down_fd
    from parallelctx.runtime.bell import _idle, _peer_port

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    seen: list[bool] = []
    real, previous = socket.socket, socket.getdefaulttimeout()

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen.append(os.get_blocking(self.fileno()))

        def settimeout(self, value: Any) -> None:
            super().settimeout(value)
            seen.append(os.get_blocking(self.fileno()))

        def setblocking(self, flag: bool) -> None:
            super().setblocking(flag)
            seen.append(os.get_blocking(self.fileno()))

    try:
        for sock in (listener, client):
            os.set_blocking(sock.fileno(), owner_blocking)
        monkeypatch.setattr(socket, "socket", Recording)
        socket.setdefaulttimeout(default)
        fd, inode = client.fileno(), os.fstat(client.fileno()).st_ino
        assert endpoint_of(listener.fileno(), os.fstat(listener.fileno()).st_ino) is not None
        assert _peer_port(fd, inode) == listener.getsockname()[1]
        assert _idle(fd, inode)
        assert shut_down_fd(fd, inode)
        assert seen and all(mode is owner_blocking for mode in seen), seen
        assert os.get_blocking(fd) is owner_blocking and peer.recv(1) == b""
    finally:
        socket.setdefaulttimeout(previous)
        monkeypatch.undo()
        for sock in (listener, client, peer):
            sock.close()
