"""Every launch meets under a key prefix no earlier launch on the same store used (issue 21).

A store outlives its processes (torchrun's agent store across --max-restarts attempts, rank 0's
store across an in-process restart), so a launch must never read a key an earlier one left. Here
the "ranks" are threads on one real TCPStore that survives between rounds; each round's threads
share no state, like the new processes of a restart.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallelctx.rendezvous import Arrival, Lineage, RendezvousError, agree_launch, meet

TIMEOUT = timedelta(seconds=20)


@pytest.fixture()
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False)


def client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)


def in_threads(rank_main: Callable[[int], None], ranks: Iterable[int], join_s: float = 30) -> None:
    """Run ``rank_main(rank)`` for every rank, each in a thread of its own; return once all end
    (each given ``join_s`` seconds)."""
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)


def one_round(
    server: dist.TCPStore,
    world: int,
    attempt: int,
    late: dict[int, float],
    timeout: timedelta = TIMEOUT,
) -> list:
    """Every rank (a fresh thread with its own client) meets with an Arrival holding ``attempt``
    (in its values and its host name); returns (prefix, host names) per rank."""
    results: list = [None] * world

    def rank_main(rank: int) -> None:
        time.sleep(late.get(rank, 0.0))
        store = client(server)
        try:
            arrival = Arrival(rank, f"h{attempt}", {"attempt": attempt})
            results[rank] = meet(store, arrival, world, timeout, "test")
        except Exception as exc:  # recorded, the test asserts on it
            results[rank] = exc

    in_threads(rank_main, range(world))
    return results


def test_a_restarted_launch_reads_no_key_of_the_attempt_before(server: dist.TCPStore) -> None:
    first = one_round(server, 4, attempt=0, late={})
    assert all(r == ("parallelctx/launch-1/", ["h0"] * 4) for r in first), first
    # The restart: ranks 1-3 come first and find attempt 0's prefix, confirmation and arrivals
    # on the store; rank 0 comes 0.5 s later.
    second = one_round(server, 4, attempt=1, late={0: 0.5})
    assert all(r == ("parallelctx/launch-2/", ["h1"] * 4) for r in second), second
    # In-process restart: ranks 0-2 relaunch while rank 3 is a new process that comes late.
    third = one_round(server, 4, attempt=2, late={3: 0.3})
    assert all(r == ("parallelctx/launch-3/", ["h2"] * 4) for r in third), third


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


def meet_all(
    server: dist.TCPStore, arrivals: list[Arrival], late: dict[int, float], timeout: timedelta
) -> list:
    """Every rank of ``arrivals`` meets from its own thread and client; returns each rank's
    result or exception."""
    results: list = [None] * len(arrivals)

    def rank_main(rank: int) -> None:
        time.sleep(late.get(rank, 0.0))
        try:
            results[rank] = meet(client(server), arrivals[rank], len(arrivals), timeout, "test")
        except Exception as exc:  # recorded, the test asserts on it
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(arrivals))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_a_refusal_reaches_every_rank_also_one_that_answers_after_it(server: dist.TCPStore) -> None:
    # Rank 2 refuses at once; rank 3 answers 1 s later, after rank 0 has posted the refusal: it
    # must still be told (rank 0 posts the refusal again with its nonce), not wait for its timeout.
    arrivals = [Arrival(r, "h", {"a": 1}) for r in range(4)]
    arrivals[2] = Arrival(2, "h", {"a": 1}, error="seed=-1 is negative")
    begin = time.monotonic()
    results = meet_all(server, arrivals, {3: 1.0}, timedelta(seconds=15))
    assert time.monotonic() - begin < 8, results
    assert results[2][0] == "parallelctx/launch-1/", results  # the refusing rank returns: it was told
    for r in (0, 1, 3):
        assert isinstance(results[r], RendezvousError), results
        assert results[r].ranks == (2,), results
        assert "rank 2 (host h) refused to launch, so every rank stops: seed=-1 is negative" in str(
            results[r]
        )


def test_an_earlier_refusal_does_not_refuse_the_next_launch(server: dist.TCPStore) -> None:
    refused = [Arrival(0, "h", {"a": 1}), Arrival(1, "h", {"a": 1}, error="bad"), Arrival(2, "h", {"a": 1})]
    first = meet_all(server, refused, {}, timedelta(seconds=15))
    assert isinstance(first[0], RendezvousError) and isinstance(first[2], RendezvousError), first
    # The relaunch: ranks 1 and 2 find the earlier launch's refusal on the store first.
    second = meet_all(server, [Arrival(r, "h", {"a": 2}) for r in range(3)], {0: 0.5}, timedelta(seconds=15))
    assert all(r == ("parallelctx/launch-2/", ["h", "h", "h"]) for r in second), second


def test_ranks_that_disagree_are_named_on_every_rank(server: dist.TCPStore) -> None:
    arrivals = [Arrival(r, "h", {"parallel.tensor": 2 if r != 1 else 4}) for r in range(3)]
    results = meet_all(server, arrivals, {}, timedelta(seconds=15))
    for r in range(3):
        assert isinstance(results[r], RendezvousError), results
        assert results[r].ranks == (1,), results
        assert "parallel.tensor: 2 on ranks 0, 2; 4 on rank 1" in str(results[r]), results


class Counting(dist.Store):
    """A rank's store client that counts its requests by (request, key)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner
        self.calls: dict[tuple[str, str], int] = {}

    def _count(self, request: str, keys: list[str]) -> None:
        for key in keys:
            self.calls[(request, key)] = self.calls.get((request, key), 0) + 1

    def set(self, key: str, value: object) -> None:
        self._count("set", [key])
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._count("get", [key])
        return self.inner.get(key)

    def add(self, key: str, value: int) -> int:
        self._count("add", [key])
        return self.inner.add(key, value)

    def check(self, keys: list[str]) -> bool:
        self._count("check", keys)
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count("multi_get", keys)
        return self.inner.multi_get(keys)

    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        self._count("compare_set", [key])
        return self.inner.compare_set(key, expected, desired)


def test_a_rank_that_came_before_rank_0_never_answers_the_last_launchs_prefix_again(
    server: dist.TCPStore,
) -> None:
    """A relaunch on the same store, ranks 1-3 before rank 0, finding the last launch's prefix
    posted. That launch had 3 ranks: ranks 1 and 2 answered it then, so they find their answer
    slot taken (one compare-and-set), never read its verdict and never count as answering it;
    rank 3, new, answers it, reads its verdict once (final: it went on without this rank). From
    then on each polls only the posted prefix, with no check before it, until rank 0 posts the new
    one; every rank then meets under the new prefix."""
    assert all(r[0] == "parallelctx/launch-1/" for r in one_round(server, 3, attempt=0, late={}))
    stores = [Counting(client(server)) for _ in range(4)]
    results: list = [None] * 4

    def rank_main(rank: int) -> None:
        if rank == 0:  # once every other rank has read the last launch's prefix, and a while more
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not all(
                stores[r].calls.get(("compare_set", f"parallelctx/launch-1/answer/{r}")) for r in (1, 2, 3)
            ):
                time.sleep(0.01)
            time.sleep(0.3)
        try:
            results[rank] = meet(stores[rank], Arrival(rank, "h1", {"attempt": 1}), 4, TIMEOUT, "test")
        except Exception as exc:  # recorded, the test asserts on it
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r == ("parallelctx/launch-2/", ["h1"] * 4) for r in results), results
    assert server.add("parallelctx/launch-1/answers", 0) == 3  # ranks 1 and 2 in launch 1, rank 3 now
    for rank in (1, 2, 3):
        calls = stores[rank].calls
        assert calls[("compare_set", f"parallelctx/launch-1/answer/{rank}")] == 1, (rank, calls)
        read = calls.get(("get", "parallelctx/launch-1/confirmed"))
        assert read == (1 if rank == 3 else None), (rank, calls)
        assert calls.get(("check", "parallelctx/leader")) == 1, (rank, calls)
        assert calls[("get", "parallelctx/leader")] >= 3, (rank, calls)  # polled while rank 0 was away


def meet_with_generations(
    server: dist.TCPStore,
    plans: dict[int, list[int | None]],
    late: dict[int, float],
    timeout: timedelta,
    attempt: str = "",
) -> list[list[tuple[object, float]]]:
    """Rank r (a thread with its own client and lineage: one process) meets once per entry of ``plans[r]``, one after the
    other, with that launch generation, starting ``late[r]`` s late; returns per rank, per
    meeting, the (prefix, hosts) or the exception, and the seconds it took. ``attempt``: which
    set of processes shares the store's life (``Lineage.attempt``; "" unknown)."""
    results: list[list[tuple[object, float]]] = [[] for _ in plans]

    def rank_main(rank: int) -> None:
        time.sleep(late.get(rank, 0.0))
        store, lineage = client(server), Lineage(attempt=attempt)  # one process
        for generation in plans[rank]:
            began = time.monotonic()
            try:
                got: object = meet(
                    store,
                    Arrival(rank, "h"),
                    len(plans),
                    timeout,
                    "test",
                    generation=generation,
                    lineage=lineage,
                )
            except Exception as exc:  # recorded, the test asserts on it
                got = exc
            results[rank].append((got, time.monotonic() - began))

    in_threads(rank_main, plans, 40)
    return results


def test_rank_0_behind_another_rank_stops_at_once_and_its_next_launch_pairs(server: dist.TCPStore) -> None:
    """Rank 0 goes on with its 1st launch (its gpc.abort() came before the launch began, so the
    launch never saw it) while ranks 1 and 2 aborted theirs and launched again: rank 0's 1st
    launch can never pair with them. A rank at its 2nd tells rank 0, which stops at once (not at
    its timeout), naming that rank; rank 0's 2nd launch then pairs with theirs."""
    short = timedelta(seconds=8)
    results = meet_with_generations(server, {0: [1, 2], 1: [2], 2: [2]}, {1: 0.3, 2: 0.3}, short)
    (error, took), (second, _) = results[0]
    assert isinstance(error, RendezvousError), results
    assert len(error.ranks) == 1 and f"rank {error.ranks[0]} is at its 2nd already" in str(error), error
    assert took < 3.0, results  # told, not timed out
    assert second == ("parallelctx/launch-2/", ["h"] * 3), results
    assert [r[0][0] for r in results[1:]] == [second, second], results


def test_a_rank_finding_the_rank_0_it_met_past_its_launch_stops_at_once(server: dist.TCPStore) -> None:
    """Rank 1 met rank 0 at their 1st launch; then rank 0 abandoned a 1st-launch attempt and
    posted its 2nd while rank 1 still makes its 1st (its abort came before that launch began):
    rank 1 stops at once, naming rank 0, instead of waiting its timeout for a launch of rank 0's
    that never comes; its next launch, pairing with any, meets rank 0's 2nd."""
    short = timedelta(seconds=8)
    results = meet_with_generations(server, {0: [1, 2], 1: [1, 1, None]}, {}, short)
    assert results[0][0][0] == results[1][0][0] == ("parallelctx/launch-1/", ["h"] * 2), results
    (error, took), (second, _) = results[1][1:]
    assert isinstance(error, RendezvousError), results
    assert "rank 0 is at its 2nd already" in str(error) and error.ranks == (0,), error
    assert took < 2.0, results
    assert second == results[0][1][0] == ("parallelctx/launch-2/", ["h"] * 2), results


@pytest.mark.parametrize("old_world", [2, 3])
def test_a_new_process_waits_for_the_new_rank_0_past_a_prefix_an_earlier_job_left(
    server: dist.TCPStore, old_world: int
) -> None:
    """A torchrun restart (attempt 1 on attempt 0's store), at another world size or the same
    one: the new rank 1's first launch is its 1st (its slot is free: at the same size, its
    predecessor died before its launch; the skeptic's case), while the store's leader key still
    holds the old rank 0's prefix at its 3rd. The new rank 1 comes first; that rank 0 is of
    another attempt, so it waits for the new one (which posts its 1st) and pairs, rather than
    stopping at the old count."""
    old = {r: [1, 2, 3] for r in range(old_world)}
    done = meet_with_generations(server, old, {}, TIMEOUT, "torchrun:job:0")
    assert all(r[2][0][0] == "parallelctx/launch-3/" for r in done), done
    results = meet_with_generations(
        server, {0: [1], 1: [1]}, {0: 0.5}, timedelta(seconds=8), "torchrun:job:1"
    )
    assert [r[0][0] for r in results] == [("parallelctx/launch-4/", ["h"] * 2)] * 2, results


def test_a_first_launch_finding_its_own_jobs_rank_0_past_it_stops_at_once(server: dist.TCPStore) -> None:
    """A process's first launch, before it met any rank 0: rank 0 of the same store attempt
    (``Lineage.attempt``) abandoned its 1st launch and posted its 2nd before rank 1 came; rank 1's 1st (its abort came before that launch began) stops at once instead
    of waiting its timeout, and its next launch, pairing with any, meets rank 0's 2nd. Before,
    it waited out the timeout, and in a loop that aborts each cycle it stayed a cycle behind."""
    short = timedelta(seconds=8)
    results = meet_with_generations(server, {0: [2], 1: [1, None]}, {1: 0.3}, short, "served")
    (error, took), (second, _) = results[1]
    assert isinstance(error, RendezvousError) and "rank 0 is at its 2nd already" in str(error), results
    assert took < 2.0, results
    assert second == results[0][0][0] == ("parallelctx/launch-1/", ["h"] * 2), results


def test_ranks_in_step_with_a_rank_0_that_stops_for_a_rank_ahead_stop_with_it(server: dist.TCPStore) -> None:
    """Ranks 0 and 1 go on with their 1st launch (their aborts came before it began) while rank
    2 launched again: rank 2 tells rank 0, which stops. Rank 1, which had answered rank 0, stops
    at once with rank 0's reason (before, it waited for rank 0's next launch or its timeout);
    the next launches of ranks 0 and 1 pair with rank 2's."""
    short = timedelta(seconds=8)
    results = meet_with_generations(server, {0: [1, 2], 1: [1, None], 2: [2]}, {2: 0.5}, short)
    (error, took), (second, _) = results[1]
    assert isinstance(error, RendezvousError), results
    assert "rank 2 is at its 2nd already" in str(error) and error.ranks == (2,), error
    assert took < 2.0, results
    assert second == results[0][1][0] == results[2][0][0] == ("parallelctx/launch-2/", ["h"] * 3), results


def test_the_store_attempt_is_known_only_where_every_rank_of_a_job_names_it_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank 0 that serves its store, and torchrun's agent store on one node, name the attempt;
    across nodes each torchrun agent counts its own restarts (a node restarted for a changed
    membership does not count it: a second skeptic's two-node runs paired a new rank with the
    dead rank 0), and a file or env store names none: the rank then waits, never stops early."""
    from parallelctx.runtime.rendezvous import store_attempt

    for key in ("TORCHELASTIC_USE_AGENT_STORE", "MASTER_PORT", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert store_attempt("tcp://127.0.0.1:29500") == "served"
    assert store_attempt("file:///tmp/x") == store_attempt("env://") == ""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert store_attempt("tcp://127.0.0.1:29500") == "torchrun:job:1"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert store_attempt("tcp://127.0.0.1:29500") == ""
