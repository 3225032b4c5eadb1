"""Where the ranks of a launch meet: the rendezvous store of each address (kept across
``destroy()``), the refusal a rank that failed its own checks posts there, and the default group
made (or adopted) after the launch's one round trip.

:class:`Meetings` is the part of a process's launches that outlives ``destroy()``: the stores by
URL (rank 0 serves a ``tcp://`` one and keeps it), the names of the groups made on a default group
that parallelctx adopted (torch names those by count: :meth:`GroupMaker.claim
<parallelctx.runtime.groups.GroupMaker>`), and the refusal still being told. Every launch meets
under a key prefix all ranks agree no earlier launch on the store used
(:func:`parallelctx.rendezvous.meet`), so a relaunch works also when some processes are new
(a torchrun restart, a replaced rank). :func:`init_default_group` is the real meeting; the dry
run's is :func:`parallelctx.runtime.simulate.meet`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..config.args import LaunchArgs
from ..guard.abort import AbortableStore
from ..guard.core import Guard
from ..guard.sockets import FdSlots
from .bell import Abandoned, Bell, Line, abandon
from .groups import connects_at_creation
from .rendezvous import Arrival, Lineage, RendezvousError, connect_store, meet, rank_list, store_attempt

__all__ = ["REFUSAL_GRACE_S", "DefaultGroup", "Meetings", "init_default_group", "url_of"]

logger = logging.getLogger("parallelctx")

REFUSAL_GRACE_S = 15.0
"""How long (at most; never longer than ``dist.timeout``) a rank whose own checks failed keeps
telling the other ranks so, in the background, after it has raised its error: a relaunch in the
same process and the process's exit wait for that, never the error itself."""


@dataclass(frozen=True)
class DefaultGroup:
    """What a meeting made or adopted: the backend, whether parallelctx owns (and so destroys)
    the default group, the timeout, every rank's host name when the meeting gathered them (empty
    otherwise), and the launch's store under its agreed prefix (None for a world of one and a
    dry run)."""

    backend: str
    owned: bool
    timeout: timedelta
    hostnames: Sequence[str]
    store: Any = None
    eager: bool = False  # its pairs connected as it was made (gloo without lazy init)


class Meetings:
    """The stores, adopted group names and refusal of this process's launches, kept across
    ``destroy()`` (see the module docstring). ``aborted`` is the guard's flag: a launch's store
    refuses every call once it is set."""

    def __init__(self, aborted: threading.Event) -> None:
        self.aborted = aborted
        self._stores: dict[tuple[str, int, int], Any] = {}
        # A weak reference: a default group the user destroyed must be freed (its worker threads
        # joined) before the interpreter exits, not kept alive here into finalization.
        self._adopted: tuple[weakref.ref[Any] | None, set[tuple[Any, int]]] = (None, set())
        self._kv: Any = None  # this launch's AbortableStore (torch does not keep it alive)
        self._plain: dict[int, Any] = {}  # id(abortable prefix store) -> the same keys, plain
        self._refusal: threading.Thread | None = None
        self._exit_hook = False
        # This rank's launch attempt: the prefix it posted or answered, its rank and world size,
        # the base store; the bell of the attempt once past the meeting (runtime/bell.py).
        self._attempt: tuple[str, int, int, Any] | None = None
        self._bell: Bell | None = None
        # The last attempt's line and bell connection, taken over by the next attempt on the same
        # base store: a relaunch makes no new store connection (see runtime/bell.py)
        self._spare: tuple[Line, Any] | None = None
        self.halted = threading.Event()
        self._called_off: Abandoned | None = None  # another rank called this attempt off before connecting
        self.url: str | None = None  # the URL of the last meeting
        self._launches = 0  # launches begun in this process: the generation of the next meeting
        self._generation_of: tuple[tuple[int, int, int], int | None] = ((0, -1, 0), None)
        # (rank, world_size) whose last meeting ran out of time or was refused: the next launch as
        # that rank pairs with any generation
        self._lost_step: tuple[int, int] | None = None
        self._lineage = Lineage()  # this process's id, and the rank 0 process it met last

    def carry(self, url: str, rank: int, world_size: int, new_rank: int, new_world_size: int) -> bool:
        """Let the next launch as rank ``new_rank`` of ``new_world_size`` at ``url`` use the store
        this process reached as rank ``rank`` of ``world_size`` (``gpc.reform()``: rank 0's store
        server stays where it runs). Returns whether there was one to carry."""
        base = self._stores.get((url, rank, world_size))
        if base is not None:
            self._stores[(url, new_rank, new_world_size)] = base
        return base is not None

    def begin(self) -> None:
        """A launch begins in this process (its meetings, retries included, share its
        generation; :func:`parallelctx.runtime.rendezvous.meet`); returns None."""
        self._launches += 1

    def _generation(self, base: Any, rank: int, world_size: int) -> int | None:
        """This launch's generation: which launch of this process it is; None (pairs with any,
        and takes rank 0's) for the first launch of a process that takes over a rank that
        launched on this store before (a replaced rank, or every rank after a torchrun restart),
        and for the launch after one whose meeting failed on a rank other than 0 (it may have
        waited for a launch of rank 0 that never came: a straggler, or a rank whose peers timed
        out and launched again, gets back in step). Marks the rank's slot."""
        if self._generation_of[0] == (self._launches, rank, world_size):
            return self._generation_of[1]  # a meeting again within the same launch
        slot = f"parallelctx/slot/{world_size}/{rank}"
        lost, self._lost_step = self._lost_step == (rank, world_size) and rank != 0, None
        try:
            taken = self._launches <= 1 and base.check([slot])
            base.set(slot, str(self._launches).encode())
        except Exception:
            return None  # the meeting reports a store that went away
        generation = None if taken or lost else self._launches
        self._generation_of = ((self._launches, rank, world_size), generation)
        return generation

    def announce_refusal(self, args: LaunchArgs, timeout: timedelta, arrival: Arrival) -> None:
        """Tell the other ranks, in a background thread, that this rank refused to launch
        (``arrival.error``), so that they stop at once instead of waiting for it; returns at
        once. The telling lasts at most ``min(timeout, REFUSAL_GRACE_S)``; the next launch in
        this process and the process's exit wait for it (within that bound)."""
        self.finish_refusal()
        if args.world_size == 1 or dist.is_initialized():
            return
        grace = timedelta(seconds=min(timeout.total_seconds(), REFUSAL_GRACE_S))
        self._refusal = threading.Thread(
            target=self._tell_refusal,
            args=(args, timeout, time.monotonic() + grace.total_seconds(), arrival),
            name="parallelctx-refusal",
            daemon=True,
        )
        self._refusal.start()
        if not self._exit_hook:
            atexit.register(self._finish_refusal_at_exit)
            self._exit_hook = True

    def _tell_refusal(self, args: LaunchArgs, timeout: timedelta, deadline: float, arrival: Arrival) -> None:
        """Post this rank's failed checks at the rendezvous by ``deadline``; a rendezvous that
        fails too is only logged (the caller has raised the cause)."""
        url = url_of(args)
        begin = time.monotonic()
        try:
            self.meet(url, arrival, args.world_size, timeout, deadline)
        except Exception as exc:
            ranks = getattr(exc, "ranks", ())
            if ranks:
                why = f"rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)} did not come to {shown(url)}"
            else:
                why = str(exc).split(";", 1)[0]
            logger.warning(
                "parallelctx: rank %d refused to launch and could not tell the other ranks within %.0f s "
                "(%s); they stop at their own dist.timeout, or when the launcher stops them",
                args.rank,
                time.monotonic() - begin,
                why,
            )

    def finish_refusal(self) -> None:
        """Wait until this process's last refusal has been told (bounded: see
        :meth:`announce_refusal`); returns None."""
        thread, self._refusal = self._refusal, None
        if thread is not None:
            thread.join(REFUSAL_GRACE_S + 5.0)

    def _finish_refusal_at_exit(self) -> None:
        thread = self._refusal
        if thread is not None:
            thread.join(3.0)  # told at once when the other ranks are there: no note
        if thread is None or not thread.is_alive():
            return
        if sys.stderr is not None and sys.stderr.isatty():  # for a person waiting at a terminal
            sys.stderr.write(
                f"parallelctx: telling the other ranks that this rank refused to launch (at most "
                f"{REFUSAL_GRACE_S:g} s; Ctrl-C skips)\n"
            )
        try:
            self.finish_refusal()
        except KeyboardInterrupt:
            pass

    def meet(
        self, url: str, arrival: Arrival, world_size: int, timeout: timedelta, deadline: float
    ) -> tuple[Any, list[str]]:
        """Meet every rank at ``url``'s store (reached once with a bounded, interruptible wait,
        then kept) in the launch's one round trip (:func:`parallelctx.rendezvous.meet`).

        Returns:
            The store under the prefix the ranks agreed is new, and every rank's host name.

        Raises:
            RendezvousError: the store did not answer before ``deadline``, its port is taken, a
                rank did not come in time, one refused, or the ranks disagree.
        """
        rank = arrival.rank
        self.url = url
        self.halted.clear()
        try:
            return self._meet(url, arrival, world_size, timeout, deadline)
        except RendezvousError:
            # Ran out of time (rank 0's store not up yet included) or was refused; not an abort
            # of this rank's, which is no sign of being out of step (pairing with any would then
            # pair with an attempt to be aborted)
            lost = self.aborted.is_set() or self.halted.is_set()
            self._lost_step = None if lost else (rank, world_size)
            raise

    def _meet(
        self, url: str, arrival: Arrival, world_size: int, timeout: timedelta, deadline: float
    ) -> tuple[Any, list[str]]:
        rank = arrival.rank
        key = (url, rank, world_size)
        base = self._stores.get(key)
        if base is None:
            base = connect_store(url, rank, world_size, timeout, deadline, self.aborted)
            self._stores[key] = base
        base.set_timeout(timeout)
        kv = self._kv = AbortableStore(base, self.aborted, self.halted)

        self._attempt = None

        def posted(prefix: str) -> None:
            if arrival.error is None:  # a refusal abandons nothing
                self._attempt = (prefix, rank, world_size, base)

        generation = self._generation(base, rank, world_size)
        self._lineage.attempt = store_attempt(url)

        def adopt(theirs: int) -> None:  # this launch pairs with rank 0's count: the process takes it
            self._launches = theirs
            self._generation_of = ((theirs, rank, world_size), theirs)

        prefix, hosts = meet(
            kv, arrival, world_size, timeout, shown(url), deadline, posted, generation, adopt, self._lineage
        )
        meeting = dist.PrefixStore(prefix, kv)
        if arrival.error is None and world_size > 1:
            # The groups of the attempt the spare served are gone: the next meeting of this
            # process comes after destroy() or after a failed attempt was undone.
            spare, self._spare = self._spare, None
            line = Line(base, spare[0] if spare is not None else None)
            ear = spare[1] if spare is not None and spare[0].base is base else None
            left = timedelta(seconds=max(deadline - time.monotonic(), 0.0) + 5.0)
            self._bell = Bell(base, prefix, rank, line, self.halted, left, ear)
            self._plain = {id(meeting): dist.PrefixStore(prefix, line.store)}
        else:
            self._plain = {id(meeting): dist.PrefixStore(prefix, base)}
        return meeting, hosts

    @contextlib.contextmanager
    def connecting(self, rank: int, world_size: int, deadline: float) -> Iterator[None]:
        """Agree with every rank, once, whether this attempt connects its default group's pairs
        (rank 0 posts "go" once every rank arrived; a rank aborted, halted or out of time first
        posts that it calls the attempt off; the store's compare-and-set lets exactly one win),
        then run the body (torch connecting) with the line held uncut from before the decision
        (:meth:`parallelctx.runtime.bell.Line.hold`): from "go" on, every rank connects and
        none leaves a peer connecting to its closed listener. Yields None.

        Raises:
            RuntimeError: the attempt was called off (by this rank: its abort, a peer's
                abandonment, the deadline; or by another rank, which this rank then meets again).
        """
        bell, attempt = self._bell, self._attempt
        if bell is None or attempt is None:
            yield
            return
        prefix, base = attempt[0], attempt[3]
        store = dist.PrefixStore(prefix + "connect/", base)  # never refused, never cut
        # Held before the decision can be "go" (a cut between the two would fail this rank's
        # connection while its peers, held, wait for it in torch until dist.timeout).
        held = bell.line.hold()
        try:
            if held:  # a rank whose line is cut never counts as arrived: its "off" wins
                store.add("arrived", 1)
            pause = 0.001
            while True:
                if rank == 0 and held and store.add("arrived", 0) >= world_size:
                    decision = store.compare_set("decision", "", "go")
                elif (
                    not held or self.aborted.is_set() or self.halted.is_set() or time.monotonic() >= deadline
                ):
                    decision = store.compare_set("decision", "", f"off:{rank}")
                elif store.check(["decision"]):
                    decision = store.get("decision")
                else:
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
                    continue
                break
            text = decision.decode()
            if text != "go":
                caller = int(text.split(":")[1])
                if caller != rank:
                    self._called_off = Abandoned(caller, prefix)
                raise RuntimeError(
                    f"parallelctx: rank {caller} called the launch attempt {prefix.rstrip('/')} off before its pairs connected"
                )
            yield
        finally:
            if held:
                bell.line.release()

    def cut(self) -> None:
        """End a wait inside torch on this launch attempt's store connection, from any thread
        (``gpc.abort()``); returns None, never raises."""
        bell = self._bell
        if bell is not None:
            bell.cut()

    def settled(self) -> Abandoned | None:
        """The launch attempt is over on this rank (made, or failed): stop its bell.

        Returns:
            A peer's abandonment of the attempt, when this rank's bell heard one (the start-up
            then meets again), else None. Never raises.
        """
        bell, self._bell = self._bell, None
        heard = bell.stop() if bell is not None else None
        if bell is not None:  # taken over by the next attempt if still whole then (Line, Bell)
            self._spare = (bell.line, bell.spare())
        heard, self._called_off = heard or self._called_off, None
        if heard is None and self.halted.is_set() and self._attempt is not None:
            heard = Abandoned(-1, self._attempt[0])
        return heard

    def abandon(self) -> None:
        """Tell the other ranks of this rank's launch attempt, if it got as far as a prefix,
        that this rank abandoned it (:func:`parallelctx.runtime.bell.abandon`); returns None,
        never raises."""
        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            prefix, rank, world_size, base = attempt
            abandon(base, prefix, rank, world_size)

    def launched(self) -> None:
        """The launch is made: forget its attempt (nothing to abandon any more); returns None."""
        self._attempt = None

    def plain(self, store: Any) -> Any:
        """Return the store torch's groups get for ``store`` (from :meth:`meet`): the same keys
        without the refusal after ``gpc.abort()``, so that torch's own threads never call into
        Python. Any other store is returned as it is."""
        return self._plain.get(id(store), store)

    def meet_adopted(
        self, arrival: Arrival, world_size: int, timeout: timedelta, deadline: float
    ) -> tuple[Any, list[str]]:
        """Meet every rank on the adopted default group's store (as :meth:`meet`).

        Returns:
            The store under the prefix the ranks agreed is new, and every rank's host name.

        Raises:
            RendezvousError: a rank did not come in time, one refused, or the ranks disagree.
        """
        from torch.distributed.distributed_c10d import _get_default_store

        kv = self._kv = AbortableStore(_get_default_store(), self.aborted)
        prefix, hosts = meet(kv, arrival, world_size, timeout, "the default group's store", deadline)
        return dist.PrefixStore(prefix, kv), hosts

    def adopted_names(self) -> set[tuple[Any, int]]:
        """Return the set of group names already used on the current adopted default group
        (a new, empty set when the default group changed)."""
        known, world = self._adopted[0], dist.group.WORLD
        if world is None or known is None or known() is not world:
            self._adopted = (None if world is None else weakref.ref(world), set())
        return self._adopted[1]


def url_of(args: LaunchArgs) -> str:
    """The rendezvous URL of ``args``: its ``init_method``, else ``tcp://host:port`` (IPv6 hosts
    bracketed)."""
    if args.init_method is not None:
        return args.init_method
    host = args.host
    if host and ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{args.port}"


def shown(url: str) -> str:
    """``host:port`` for a ``tcp://`` URL, the URL otherwise."""
    return url[len("tcp://") :] if url.startswith("tcp://") else url


def init_default_group(
    meetings: Meetings,
    guard: Guard,
    args: LaunchArgs,
    backend: str,
    timeout: timedelta,
    arrival: Arrival | None,
) -> DefaultGroup:
    """Meet every rank of ``args`` (checked: :func:`parallelctx.config.args.validate_launch_args`)
    in one round trip on this launch's store, then make the default group on
    ``backend`` (resolved: ``"gloo"`` or ``"nccl"``), held by ``guard`` as soon as it exists;
    or adopt an initialised one with the same rank and world size. A gloo default group connects
    all its pairs as it is made (unless ``TORCH_GLOO_LAZY_INIT`` is set): a rank that dies later
    is then noticed at once by the peers' next collective, not at its timeout; the start-up
    settles every rank once its groups are made (``DefaultGroup.eager``).

    The store of a URL is kept across ``destroy()`` by ``meetings`` (under torchrun it is the
    launcher's own store, which outlives restarts). In the launch's one round trip
    (:func:`parallelctx.rendezvous.meet`) every rank posts ``arrival`` under a key prefix no
    earlier launch on that store used, ``parallelctx/launch-<n>/``, and rank 0 answers with
    every rank's host name and whether the ranks agree; a rank that does not arrive within
    ``timeout`` is named, and so are ranks that disagree. The default group and every group made
    from it keep their keys under that prefix. The host names serve the count of processes per node.

    Returns:
        A :class:`DefaultGroup`.

    Raises:
        RuntimeError: torch.distributed is initialised with another rank or world size.
        RendezvousError: a rank did not arrive within ``timeout``, the store did not answer or
            its port is taken, or the ranks disagree.
    """
    rank, world_size = args.rank, args.world_size
    deadline = time.monotonic() + timeout.total_seconds()
    hostnames: tuple[str, ...] = ()
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}; call "
                "torch.distributed.destroy_process_group() or launch with matching values"
            )
        kv = None
        if arrival is not None and world_size > 1:
            kv, hosts = meetings.meet_adopted(arrival, world_size, timeout, deadline)
            hostnames = tuple(hosts)
        return DefaultGroup(dist.get_backend(), False, timeout, hostnames, kv)
    if world_size == 1 and args.init_method is None:
        store: Any = dist.HashStore()
        hostnames = (arrival.host,) if arrival is not None else ()
    else:
        guard.cut = meetings.cut
        store, hosts = meetings.meet(
            url_of(args), arrival or Arrival(rank, ""), world_size, timeout, deadline
        )
        hostnames = tuple(hosts) if arrival is not None else ()
    slots = FdSlots.reserve()  # after the store: its server's loop is no group's
    eager = world_size > 1 and connects_at_creation(backend)
    named = c10d._world.group_count
    try:
        # Every rank agrees to connect before any does, and none leaves before its pairs are
        # connected: no rank is left connecting to a closed listener (gloo retries that in C++).
        with meetings.connecting(rank, world_size, deadline) if eager else contextlib.nullcontext():
            dist.init_process_group(
                backend=backend,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
                store=meetings.plain(store),
            )
    except BaseException:
        # torch took the next group name (a count) before it failed: give it back, or the next
        # launch's default group would meet the other ranks' under another name.
        if not dist.is_initialized():
            c10d._world.group_count = named
        raise
    guard.hold(dist.group.WORLD, slots)
    return DefaultGroup(backend, True, timeout, hostnames, None if world_size == 1 else store, eager)
