"""The launch attempt's line and bell (parallelctx.runtime.bell) on a real TCPStore in this
process: a cut ends a wait inside torch at once, a held line is cut only on release, a bell
rung by a peer's abandonment halts the attempt and cuts its line. The multi-process races they
serve are in tests/test_abort_states.py and tests/test_reform.py (marker faults)."""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallelctx.runtime.bell import Bell, Line, abandon
from parallelctx.runtime.rendezvous import ABANDONED

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="shuts down sockets by descriptor"
)

WAIT = timedelta(seconds=30)


@pytest.fixture
def server() -> dist.TCPStore:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=WAIT, wait_for_workers=False)
    yield store
    del store


def waiting(store: dist.Store, key: str) -> tuple[threading.Thread, list[BaseException]]:
    """A thread waiting on ``key`` in torch, as a group's connection does; its error lands in the list."""
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            store.wait([key], WAIT)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.2)  # inside torch's wait
    return thread, errors


def test_a_cut_ends_a_wait_inside_torch_on_the_line_and_nothing_else(server: dist.TCPStore) -> None:
    line = Line(server)
    assert line.store is not server
    thread, errors = waiting(line.store, "never")
    assert line.cut() == 1
    thread.join(5)
    assert not thread.is_alive() and errors, "the wait on the cut line did not end"
    server.set("still", "here")  # the rank's own connection is untouched
    assert server.get("still") == b"here"


def test_a_held_line_is_cut_only_when_released(server: dist.TCPStore) -> None:
    line = Line(server)
    assert line.hold()
    thread, errors = waiting(line.store, "key")
    assert line.cut() == 0  # held: torch connects the default group's pairs now
    server.set("key", "1")
    thread.join(5)
    assert not thread.is_alive() and not errors
    line.release()  # the cut that came meanwhile is made now
    with pytest.raises(RuntimeError):  # torch's DistNetworkError
        line.store.get("key")


def test_a_line_cut_before_it_is_held_cannot_be_held(server: dist.TCPStore) -> None:
    line = Line(server)
    line.cut()
    assert not line.hold()  # the attempt is over on this rank: it calls the connection off


def test_a_peers_abandonment_rings_the_bell_halts_and_cuts_the_line(server: dist.TCPStore) -> None:
    line, halted = Line(server), threading.Event()
    bell = Bell(server, "p/", 0, line, halted, WAIT)
    thread, errors = waiting(line.store, "never")
    abandon(server, "p/", 1, 2)  # rank 1 abandons the attempt under p/
    thread.join(5)
    assert halted.is_set() and errors
    assert server.add("p/answers", 0) == ABANDONED
    assert bell.stop() is not None and bell.stop().rank == 1


def test_a_bell_nobody_rang_stops_at_once(server: dist.TCPStore) -> None:
    line, halted = Line(server), threading.Event()
    bell = Bell(server, "q/", 0, line, halted, WAIT)
    assert bell.stop() is None
    assert not halted.is_set()
    assert bell._thread is not None and not bell._thread.is_alive()
    line.store.set("q/fine", "1")  # not cut
    assert line.store.get("q/fine") == b"1"


def test_a_cut_leaves_the_ranks_own_connection_that_sits_among_the_lines_descriptors(
    server: dist.TCPStore,
) -> None:
    # A descriptor the rank closed after its store connection was made: that connection (and an
    # earlier attempt's line) then sits just above the lowest free descriptor, where the new
    # line's socket is looked for. Only the line's own socket may be cut.
    placeholder = os.open(os.devnull, os.O_RDONLY)
    base = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=WAIT)
    os.close(placeholder)
    first = Line(base)  # takes the placeholder's descriptor, just below the rank's own connection
    second = Line(base)
    assert second.cut() == 1
    first.store.set("first", "1")  # an earlier attempt's line is not this one's
    assert first.cut() == 1
    base.set("own", "1")  # the rank's own connection still answers
    assert base.get("own") == b"1"
    for line in (first, second):
        with pytest.raises(RuntimeError):
            line.store.get("own")
