"""Every launch meets under a key prefix no earlier launch on the same store used (issue 21).

A store outlives its processes (torchrun's agent store across --max-restarts attempts, rank 0's
store across an in-process restart), so a launch must never read a key an earlier one left. Here
the "ranks" are threads on one real TCPStore that survives between rounds; each round's threads
share no state, like the new processes of a restart.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallelctx.rendezvous import Arrival, RendezvousError, agree_launch, exchange

TIMEOUT = timedelta(seconds=20)


@pytest.fixture()
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False)


def client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)


def one_round(
    server: dist.TCPStore,
    world: int,
    attempt: int,
    late: dict[int, float],
    agree: bool = True,
    timeout: timedelta = TIMEOUT,
) -> list:
    """Every rank (a fresh thread with its own client) agrees a prefix (or takes the old fixed
    one) and exchanges an Arrival holding ``attempt``; returns (prefix, arrivals) per rank."""
    results: list = [None] * world

    def rank_main(rank: int) -> None:
        time.sleep(late.get(rank, 0.0))
        store = client(server)
        try:
            prefix = agree_launch(store, rank, world, timeout, "test") if agree else "parallelctx/launch-1"
            arrivals = exchange(
                dist.PrefixStore(prefix, store),
                Arrival(rank, "h", {"attempt": attempt}),
                world,
                timeout,
                "test",
            )
            results[rank] = (prefix, [a.values["attempt"] for a in arrivals])
        except Exception as exc:  # recorded, the test asserts on it
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_a_restarted_launch_reads_no_key_of_the_attempt_before(server: dist.TCPStore) -> None:
    first = one_round(server, 4, attempt=0, late={})
    assert all(r == ("parallelctx/launch-1/", [0, 0, 0, 0]) for r in first), first
    # The restart: ranks 1-3 come first and find attempt 0's prefix, confirmation and arrivals
    # on the store; rank 0 comes 0.5 s later.
    second = one_round(server, 4, attempt=1, late={0: 0.5})
    assert all(r == ("parallelctx/launch-2/", [1, 1, 1, 1]) for r in second), second
    # In-process restart: ranks 0-2 relaunch while rank 3 is a new process that comes late.
    third = one_round(server, 4, attempt=2, late={3: 0.3})
    assert all(r == ("parallelctx/launch-3/", [2, 2, 2, 2]) for r in third), third


def test_the_fixed_prefix_of_before_reads_the_earlier_attempt(server: dist.TCPStore) -> None:
    # What the launch did before issue 21 (a prefix counted per process, launch-1 in every new
    # process): the restarted ranks read attempt 0's arrivals, or refuse the launch over them.
    short = timedelta(seconds=2)
    one_round(server, 3, attempt=0, late={}, agree=False, timeout=short)
    stale = one_round(server, 3, attempt=1, late={0: 0.3}, agree=False, timeout=short)
    assert any(isinstance(r, Exception) or 0 in r[1] for r in stale), stale


def test_a_missing_rank_is_named_on_every_rank(server: dist.TCPStore) -> None:
    short = timedelta(seconds=1.5)
    errors: list = [None, None]

    def rank_main(rank: int) -> None:
        try:
            agree_launch(client(server), rank, 3, short, "127.0.0.1:1")
        except RendezvousError as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(e is not None and e.ranks == (2,) for e in errors), errors
    assert "rank 2 of world_size=3 did not arrive at the rendezvous 127.0.0.1:1 within 1.5 s" in str(
        errors[0]
    )


def test_rank_0_missing_is_named(server: dist.TCPStore) -> None:
    one_round(server, 2, attempt=0, late={})  # leaves a confirmed prefix of an earlier launch
    with pytest.raises(RendezvousError, match="rank 0 of world_size=2 did not arrive") as info:
        agree_launch(client(server), 1, 2, timedelta(seconds=1), "here")
    assert info.value.ranks == (0,)
