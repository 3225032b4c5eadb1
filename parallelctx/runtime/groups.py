"""Creating this rank's torch process groups from a :class:`~parallelctx.layout.Layout`.

Each rank creates only the groups it belongs to, with ``use_local_synchronization=True``, so
its cost is O(number of modes), not O(world size). Creation follows one rank-independent order
(the order of :class:`ParallelMode`, EMBEDDING last), which torch needs: with local
synchronization a group's name hashes its members *and* how many groups the process already
has, so every member must have made the same groups before it.

* Every mode of size 1 shares one one-rank group of this rank (never None, which torch would
  read as the whole world): one more local ``new_group`` call (two with a CPU twin), no
  connections. In a world of one it is the default group.
* A mode whose groups equal the whole world uses the default group.
* Modes whose groups have identical members share one process group.
* With an accelerator backend a gloo group is made beside each group, for object collectives
  and CPU barriers; with gloo the CPU group is the group itself.
* Gloo groups connect on their first collective (``TORCH_GLOO_LAZY_INIT=1`` while they are
  made), as NCCL does, so a group that is never used costs no connections; the config's
  ``dist.gloo_lazy_init=False`` or the user's own TORCH_GLOO_LAZY_INIT turns it off.

Limits of local synchronization, guarded here (see ``docs/performance.md``):

* The MPI backend cannot synchronise locally, and a default group initialised eagerly
  (``init_process_group(device_id=...)`` with NCCL) makes torch split every new communicator
  from the world's with ``ncclCommSplit``, which every rank of the world must join. In both
  cases every rank creates every group instead (O(world) calls, as Megatron-core does), and a
  warning says so.
* Names are not unique across a destroy: after ``gpc.destroy()`` on a default group that
  parallelctx did not create, making the same groups again would give them the names of the
  destroyed ones, and their members would meet on stale rendezvous keys (with gloo:
  "connection refused" until the timeout). :func:`create_groups` raises a clear error instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..guard.core import Guard, Held
from ..guard.sockets import FdSlots
from ..planning.layout import Layout, ParallelMode

__all__ = [
    "GroupMaker",
    "MadeGroups",
    "ModeGroup",
    "compact",
    "connects_at_creation",
    "create_groups",
    "create_module_groups",
    "creation_order",
    "gloo_lazy_env",
    "lazy_gloo",
    "local_sync_blocker",
]

logger = logging.getLogger("parallelctx")


@dataclass(frozen=True)
class ModeGroup:
    """This rank's group of one mode: members, and the process groups.

    A mode of size 1 gets a one-rank group of this rank (the same one for every such mode),
    never None: torch reads ``group=None`` as the whole world.

    ``ranks`` is a ``range`` when the members are evenly spaced (the world and every group that
    spans one axis, or contiguous axes), so neither its memory nor ``ranks.index(rank)`` grows
    with the world; a tuple otherwise.
    """

    ranks: Sequence[int]
    group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup


def compact(members: Sequence[int]) -> Sequence[int]:
    """Return ascending, evenly spaced members as a ``range``, any others as a tuple."""
    if isinstance(members, range):
        return members
    if len(members) >= 2:
        step = members[1] - members[0]
        if step > 0 and all(b - a == step for a, b in zip(members, members[1:])):
            return range(members[0], members[-1] + 1, step)
    return tuple(members)


def creation_order(layout: Layout) -> list[ParallelMode]:
    """Return the modes in the order their groups are made: every mode, EMBEDDING last.

    EMBEDDING goes last because middle pipeline stages belong to no embedding group; making it
    earlier would leave them with fewer groups than their peers when the next group is named.
    """
    modes = [m for m in layout.modes() if m is not ParallelMode.EMBEDDING]
    return modes + [ParallelMode.EMBEDDING]


def local_sync_blocker() -> str | None:
    """Return why this default group cannot create groups with local synchronization, or None.

    Two cases: the MPI backend (torch raises for it), and a default group bound to a device at
    init (eager NCCL initialisation), where torch creates every NCCL communicator by splitting
    the world's, a collective that ranks outside the new group must join too.
    """
    backend = str(dist.get_backend())
    if backend == "mpi":
        return "the MPI backend cannot synchronise a new group locally"
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    if bound is not None and "nccl" in backend:
        return (
            f"the default group was initialised eagerly on {bound} (init_process_group(device_id=...)),"
            " so torch splits every new NCCL communicator from the world's, which every rank must join"
        )
    return None


@contextlib.contextmanager
def lazy_gloo(enabled: bool) -> Iterator[None]:
    """Make gloo groups built inside connect on their first collective (TORCH_GLOO_LAZY_INIT=1),
    unless ``enabled`` is False or the user set the variable; restore the environment after.
    Yields None; raises nothing of its own."""
    if not enabled or "TORCH_GLOO_LAZY_INIT" in os.environ:
        yield
        return
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)


def gloo_lazy_env() -> bool | str | None:
    """``TORCH_GLOO_LAZY_INIT`` as torch reads it (c10d's ``getCvarBool``): None when unset, True
    or False, or the value itself when torch would refuse it. Every rank must launch with the
    same (the launch agreement compares it): gloo ranks that connect as a group is made and ranks
    that wait for its first collective do not meet, and torch 2.13 crashed (SIGSEGV) there."""
    raw = os.environ.get("TORCH_GLOO_LAZY_INIT")
    if raw is None:
        return None
    value = raw.lower()
    if value in ("y", "yes", "1", "t", "true"):
        return True
    if value in ("n", "no", "0", "f", "false"):
        return False
    return raw


def connects_at_creation(backend: str | None) -> bool:
    """True when a group made now on ``backend`` (None: the default group's) connects all its
    pairs as it is made: gloo without ``TORCH_GLOO_LAZY_INIT`` in effect."""
    name = backend if backend is not None else (str(dist.get_backend()) if dist.is_initialized() else "")
    return name == "gloo" and gloo_lazy_env() is not True


class GroupMaker:
    """Makes this rank's process groups for one launch, and is the one way parallelctx makes a
    group: gpc's modes (:func:`create_groups`) and the groups a bridge adds (the Megatron
    bridge's, through ``gpc.group_maker()``).

    Each group: locally synchronized where torch can (only its members call), else every group
    of its kind on every rank (:func:`local_sync_blocker`); gloo groups connect on their first
    collective when ``lazy`` (:func:`lazy_gloo`); on an adopted default group the name torch gives
    it is claimed first (:meth:`claim`); held by ``guard`` as soon as it exists, with the free
    descriptor slots read just before it was made, so that ``gpc.abort()`` from another thread
    reaches it at once. ``calls`` counts the ``new_group`` calls; ``made`` lists what the guard
    holds of them. ``settle(tag)``, when given, waits until every rank has come to the same
    point (:func:`parallelctx.rendezvous.settle`): :meth:`settle` calls it after groups that
    connected as they were made.
    """

    def __init__(
        self,
        guard: Guard,
        timeout: timedelta,
        lazy: bool = True,
        used_names: set[tuple[Sequence[int], int]] | None = None,
        world_size: int | None = None,
        settle: Callable[[str], None] | None = None,
    ) -> None:
        self.guard = guard
        self._settle = settle
        self.eager = False  # a group made since the last settle connected as it was made
        self.timeout = timeout
        self.lazy = lazy
        self.used = set() if used_names is None else used_names
        world = dist.get_world_size() if world_size is None else world_size
        self.blocker = local_sync_blocker() if world > 1 else None
        self.calls = 0
        self.made: list[Held] = []
        self._connects: dict[str | None, bool] = {}  # connects_at_creation by backend, for this launch

    def claim(self, members: Sequence[int]) -> None:
        """Record, in the used names, the name torch is about to give a locally synchronized
        group of ``members``: torch names it by its members and the number of groups the process
        holds, so after groups are destroyed on a default group that lives on, the same groups
        would get the same names and their members would meet on stale rendezvous keys.

        Raises:
            RuntimeError: this process already made a group with these members under the same
                name on this default group (it was destroyed since); the message says how to
                avoid it.
        """
        names = getattr(getattr(c10d, "_world", None), "pg_names", None)
        if names is None:  # a torch without this registry: nothing to check against
            return
        key = (compact(list(members)), len(names))
        if key in self.used:
            raise RuntimeError(
                f"parallelctx already made a process group of ranks {list(members)} on this default "
                f"group while the process held {len(names)} groups, and destroyed it since; torch would "
                "give the new group the old name, and its members would meet on stale rendezvous keys "
                "(gloo: 'connection refused' until the timeout). Destroy and re-create the default "
                "group too (let parallelctx own it: launch without calling init_process_group first), "
                "or keep another process group alive across gpc.destroy() so the names differ"
            )
        self.used.add(key)

    def new_group(
        self, ranks: Sequence[int] | None, desc: str, backend: str | None = None, local: bool = True
    ) -> Any:
        """One ``torch.distributed.new_group`` call (``ranks`` None: the whole world, every rank
        calls), held by the guard at once.

        Returns:
            What torch returns (a process group, or its non-member marker for a rank outside
            ``ranks`` when not ``local``).

        Raises:
            RuntimeError: from torch (a peer did not arrive within the timeout), or :meth:`claim`'s.
        """
        if local and ranks is not None:
            self.claim(ranks)
        # A group of one rank has no connection for abort to shut down, but gloo gives it an
        # event loop too: noted, it is known, and never taken for a later group's
        slots = FdSlots.reserve()
        with lazy_gloo(self.lazy):
            if backend not in self._connects:
                self._connects[backend] = connects_at_creation(backend)
            self.eager = self.eager or self._connects[backend]
            group = dist.new_group(
                None if ranks is None else list(ranks),
                timeout=self.timeout,
                backend=backend,
                use_local_synchronization=local and ranks is not None,
                group_desc=desc,
            )
        self.calls += 1
        held = self.guard.hold(group, slots)
        if held is not None:
            self.made.append(held)
        return group

    def settle(self, tag: str) -> None:
        """When a group made since the last settle connected as it was made, wait until every
        rank has come here too (``tag``, the same on every rank), so that no rank goes on and
        tears a group down while a peer still connects to it; else return at once. Returns None.

        Raises:
            RendezvousError: a rank did not come within the timeout (named).
        """
        if self.eager and self._settle is not None:
            self._settle(tag)
        self.eager = False

    def make(
        self,
        members: Sequence[int],
        every: Callable[[], Iterable[Sequence[int]]],
        rank: int,
        desc: str,
        backend: str | None = None,
    ) -> Any:
        """This rank's group of one kind: locally synchronized with ``members``, or, where torch
        cannot (:attr:`blocker`), every group ``every()`` lists, made on every rank in that order.

        Returns:
            This rank's group (None where it is in no group of the kind and local
            synchronization was blocked).

        Raises:
            RuntimeError: as :meth:`new_group`.
        """
        if self.blocker is None:
            return self.new_group(members, desc, backend)
        mine = None
        for row in every():
            group = self.new_group(row, desc, backend, local=False)
            if rank in row:
                mine = group
        return mine

    def destroy(self, groups: Iterable[Any]) -> None:
        """Destroy each of ``groups`` that torch still has (made by this maker; never the default
        group) and stop holding it; returns None."""
        groups = [g for g in groups if g is not None]
        self.guard.release(groups)
        if not dist.is_initialized():
            return
        registry = c10d._world.pg_map
        for group in groups:
            if group in registry and group is not dist.group.WORLD:
                dist.destroy_process_group(group)


def _one_rank_group(layout: Layout, rank: int, maker: GroupMaker, cpu_backend: str | None) -> ModeGroup:
    """The one-rank group of ``rank`` (and its CPU twin): one local call each, no connection;
    where local synchronization is blocked every rank makes every rank's one-rank group."""
    members = range(rank, rank + 1)

    def every() -> Iterator[list[int]]:
        return ([r] for r in layout.ranks)

    group = maker.make(members, every, rank, "parallelctx_self")
    cpu_group = group
    if cpu_backend is not None:
        cpu_group = maker.make(members, every, rank, "parallelctx_self_cpu", cpu_backend)
    return ModeGroup(members, group, cpu_group)


def create_groups(
    layout: Layout, rank: int, maker: GroupMaker, cpu_backend: str | None
) -> dict[ParallelMode, ModeGroup]:
    """Create the process groups of every mode that ``rank`` belongs to, with ``maker``.

    Args:
        layout: the world's layout; ``layout.world_size`` must equal the default group's size.
        rank: this process's global rank.
        maker: makes each group (timeout, lazy gloo, name claims, the guard).
        cpu_backend: ``"gloo"`` to make a CPU group beside each group (accelerator backends),
            ``None`` when the main backend already runs on the CPU.

    Returns:
        ``{mode: ModeGroup}``; ``maker.calls`` counts the ``new_group`` calls. A mode this rank
        is in no group of (EMBEDDING on a middle pipeline stage) is left out.

    Raises:
        RuntimeError: from torch, when a peer does not arrive within the timeout; or a group
            would reuse the name of one destroyed earlier (:meth:`GroupMaker.claim`).
    """
    return create_module_groups([layout], rank, maker, cpu_backend, layout.world_size).modules[0]


@dataclass(frozen=True)
class MadeGroups:
    """What :func:`create_module_groups` made: each layout's ``{mode: ModeGroup}``, the job's
    world (the default group and its CPU twin), and the groups no mode answers with (the
    stand-ins that keep group counts equal), which the launch's teardown destroys too."""

    modules: list[dict[ParallelMode, ModeGroup]]
    world: ModeGroup
    extra: tuple[Any, ...] = ()


def create_module_groups(
    layouts: Sequence[Layout], rank: int, maker: GroupMaker, cpu_backend: str | None, world_size: int
) -> MadeGroups:
    """Create this rank's groups of every mode of each of ``layouts`` (the modules ``rank``
    belongs to, in the config's order; one layout for a job without modules), with ``maker``.

    A module's GLOBAL group holds the module's ranks (the default group when it spans the
    job's ``world_size``). A group whose members equal one made for an earlier module is that
    group. torch names a locally synchronized group by its members and how many groups the
    process holds, so every member must hold the same number of groups when a group is made: the
    EMBEDDING groups of every module come last (middle pipeline stages join none), and with
    modules a middle stage makes a one-rank stand-in for each group the ends make there, so
    every rank of a module holds as many groups as the others after the launch (a later group
    across stages, such as the Megatron bridge's, then meets under one name).

    Returns:
        A :class:`MadeGroups`: one ``{mode: ModeGroup}`` per layout, as :func:`create_groups`.

    Raises:
        RuntimeError: as :func:`create_groups`; or several layouts where local synchronization
            is blocked (:func:`local_sync_blocker`).
    """
    world = ParallelMode.GLOBAL
    default_group = dist.group.WORLD
    if default_group is None:
        raise RuntimeError("torch.distributed has no default group: call gpc.init_global_dist() first")
    if maker.blocker is not None:
        if len(layouts) > 1 or layouts[0].world_size != world_size:
            raise RuntimeError(
                f"parallelctx: parallel.modules needs groups made by their members alone, but {maker.blocker}; "
                "launch without modules, or on a default group that can (gloo, or NCCL without device_id)"
            )
        logger.warning(
            "parallelctx: %s; every rank creates every group instead (O(world size) calls per rank)",
            maker.blocker,
        )
    cpu_world = default_group
    if cpu_backend is not None and world_size > 1:
        cpu_world = maker.new_group(None, "parallelctx_cpu_global", cpu_backend, local=False)
    by_members: dict[tuple[int, ...], ModeGroup] = {}
    alone: ModeGroup | None = None  # the one-rank group every size-1 mode shares
    if world_size == 1:
        alone = ModeGroup(range(rank, rank + 1), default_group, cpu_world)
    outs: list[dict[ParallelMode, ModeGroup]] = []
    later: list[tuple[Layout, dict[tuple, ModeGroup], dict[ParallelMode, ModeGroup], tuple]] = []

    def one(
        layout: Layout,
        mode: ParallelMode,
        members: Sequence[int],
        made: dict[tuple, ModeGroup],
        reuse: bool = True,
    ) -> ModeGroup:
        sig = layout.signature(mode)
        if sig not in made:
            key = tuple(members)
            if key not in by_members or not reuse:

                def every(mode: ParallelMode = mode) -> Any:
                    return layout.group_array(mode).tolist()

                group = maker.make(members, every, rank, mode.value)
                cpu_group = group
                if cpu_backend is not None:
                    cpu_group = maker.make(members, every, rank, f"{mode.value}_cpu", cpu_backend)
                by_members[key] = ModeGroup(members, group, cpu_group)
            made[sig] = by_members[key]
        return made[sig]

    for layout in layouts:
        out: dict[ParallelMode, ModeGroup] = {}
        made: dict[tuple, ModeGroup] = {}
        world_sig = layout.signature(world)
        if layout.world_size == world_size:  # the whole job: the default group
            whole = ModeGroup(range(world_size), default_group, cpu_world)
        else:
            whole = one(layout, world, compact(layout.ranks), made)
        made[world_sig] = whole
        out[world] = whole
        for mode in creation_order(layout)[:-1]:  # EMBEDDING (last) after every module's others
            sig = layout.signature(mode)
            # Any mode spanning the whole layout is its GLOBAL group (GLOBAL even in a layout of
            # one, where every signature is empty).
            if mode is world or (sig == world_sig and layout.world_size > 1):
                out[mode] = whole
                continue
            members = compact(layout.group_of(mode, rank))
            if layout.size(mode) == 1:
                if members:
                    alone = alone or _one_rank_group(layout, rank, maker, cpu_backend)
                    out[mode] = alone
                continue
            out[mode] = one(layout, mode, members, made)
        outs.append(out)
        later.append((layout, made, out, world_sig))
    several = len(layouts) > 1 or layouts[0].world_size != world_size  # parallel.modules
    extra: list[Any] = []
    for layout, made, out, world_sig in later:
        mode = ParallelMode.EMBEDDING
        sig = layout.signature(mode)
        members = compact(layout.group_of(mode, rank))
        if sig == world_sig and layout.world_size > 1:
            out[mode] = out[world]
        elif layout.size(mode) == 1:
            if members:
                alone = alone or _one_rank_group(layout, rank, maker, cpu_backend)
                out[mode] = alone
        elif sig in made:
            if members:
                out[mode] = made[sig]
        elif members or maker.blocker is not None:  # middle stages make none (unless blocked)
            # never another module's group: the middle stages' stand-ins count one group (and
            # its CPU twin) here
            group = one(layout, mode, members, made, reuse=not several)
            if members:
                out[mode] = group
        elif several:  # a middle stage: as many groups as the ends make, so counts stay equal
            extra.append(maker.new_group([rank], "parallelctx_embedding_standin"))
            if cpu_backend is not None:
                extra.append(maker.new_group([rank], "parallelctx_embedding_standin_cpu", cpu_backend))
    return MadeGroups(outs, ModeGroup(range(world_size), default_group, cpu_world), tuple(extra))
