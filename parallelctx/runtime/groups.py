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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..guard import abort as _abort
from ..planning.layout import Layout, ParallelMode

__all__ = ["ModeGroup", "Sockets", "create_groups", "creation_order", "lazy_gloo", "local_sync_blocker"]

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


def _compact(members: list[int]) -> Sequence[int]:
    """Return ascending, evenly spaced members as a ``range``, any others as a tuple."""
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


def _claim_name(members: Sequence[int], used: set[tuple[Sequence[int], int]]) -> None:
    """Record, in ``used``, the name torch is about to give a locally synchronized group.

    torch names such a group by its members and the number of groups the process holds, so
    after the groups are destroyed on a default group that lives on, the same groups would get
    the same names and their members would meet on stale rendezvous keys.

    Raises:
        RuntimeError: this process already made a group with these members under the same name
            on this default group (it was destroyed since); the message says how to avoid it.
    """
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    if names is None:  # a torch without this registry: nothing to check against
        return
    key = (members, len(names))
    if key in used:
        raise RuntimeError(
            f"parallelctx already made a process group of ranks {list(members)} on this default "
            f"group while the process held {len(names)} groups, and destroyed it since; torch would "
            "give the new group the old name, and its members would meet on stale rendezvous keys "
            "(gloo: 'connection refused' until the timeout). Destroy and re-create the default "
            "group too (let parallelctx own it: launch without calling init_process_group first), "
            "or keep another process group alive across gpc.destroy() so the names differ"
        )
    used.add(key)


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


Sockets = dict[int, tuple[int, int]]
"""Socket inode -> (this rank's index in the group, group size), for every socket a group's
creation opened: its gloo listener, for ``gpc.abort()`` (see :mod:`parallelctx.abort`)."""


class _Notes:
    """Notes, for each group made, the sockets its creation opened into ``sockets`` (None: not
    noted). One ``/proc/self/fd`` scan per group: each scan is the next group's "before"."""

    def __init__(self, sockets: Sockets | None) -> None:
        self.sockets = sockets
        self.seen = _abort.socket_inodes() if sockets is not None else frozenset()

    def new_group(self, *args: Any, **kwargs: Any) -> Any:
        """``dist.new_group(*args, **kwargs)``, noting the sockets it opened."""
        group = dist.new_group(*args, **kwargs)
        if self.sockets is not None:
            now = _abort.socket_inodes()
            if isinstance(group, dist.ProcessGroup) and group.size() > 1:
                for inode in now - self.seen:
                    self.sockets[inode] = (group.rank(), group.size())
            self.seen = now
        return group


def _local_group(
    members: Sequence[int],
    timeout: timedelta,
    backend: str | None,
    desc: str,
    used: set[tuple[Sequence[int], int]],
    notes: _Notes,
) -> dist.ProcessGroup:
    """Create one group that only its members call for (local synchronization)."""
    _claim_name(members, used)
    return notes.new_group(
        list(members),
        timeout=timeout,
        backend=backend,
        use_local_synchronization=True,
        group_desc=desc,
    )


def _group_everywhere(
    layout: Layout,
    mode: ParallelMode,
    rank: int,
    timeout: timedelta,
    backend: str | None,
    desc: str,
    notes: _Notes,
) -> tuple[Any, int]:
    """Create every group of ``mode`` on this rank (all ranks call); return (ours or None, calls)."""
    mine = None
    rows = layout.group_array(mode).tolist()
    for row in rows:
        group = notes.new_group(row, timeout=timeout, backend=backend, group_desc=desc)
        if rank in row:
            mine = group
    return mine, len(rows)


def _one_rank_group(
    layout: Layout,
    rank: int,
    timeout: timedelta,
    cpu_backend: str | None,
    blocker: str | None,
    used: set[tuple[Sequence[int], int]],
    notes: _Notes,
) -> tuple[ModeGroup, int]:
    """Create the one-rank group of ``rank`` (and its CPU twin); return it and the call count.

    With local synchronization it is one local call (two with a CPU twin) and no connection;
    where local synchronization is blocked every rank makes every rank's one-rank group.
    """
    members = range(rank, rank + 1)
    if blocker is not None:
        rows = [[r] for r in range(layout.world_size)]
        group = cpu_group = None
        for row in rows:
            g = notes.new_group(row, timeout=timeout, group_desc="parallelctx_self")
            c = g
            if cpu_backend is not None:
                c = notes.new_group(
                    row, timeout=timeout, backend=cpu_backend, group_desc="parallelctx_self_cpu"
                )
            if row[0] == rank:
                group, cpu_group = g, c
        per_row = 1 if cpu_backend is None else 2
        if group is None or cpu_group is None:
            raise RuntimeError(
                f"rank {rank} is outside the world of {layout.world_size}: no one-rank group made"
            )
        return ModeGroup(members, group, cpu_group), per_row * len(rows)
    group = _local_group(members, timeout, None, "parallelctx_self", used, notes)
    cpu_group = group
    if cpu_backend is not None:
        cpu_group = _local_group(members, timeout, cpu_backend, "parallelctx_self_cpu", used, notes)
    return ModeGroup(members, group, cpu_group), 1 if cpu_backend is None else 2


def create_groups(
    layout: Layout,
    rank: int,
    timeout: timedelta,
    cpu_backend: str | None,
    used_names: set[tuple[Sequence[int], int]] | None = None,
    gloo_lazy_init: bool = True,
    sockets: Sockets | None = None,
) -> tuple[dict[ParallelMode, ModeGroup], int]:
    """Create the process groups of every mode that ``rank`` belongs to.

    Args:
        layout: the world's layout; ``layout.world_size`` must equal the default group's size.
        rank: this process's global rank.
        timeout: the timeout of every group made here.
        cpu_backend: ``"gloo"`` to make a CPU group beside each group (accelerator backends),
            ``None`` when the main backend already runs on the CPU.
        used_names: the names of groups made earlier on this default group (see
            :func:`_claim_name`); updated in place. None: no check (a fresh default group).
        gloo_lazy_init: gloo groups connect on their first collective instead of at creation,
            unless TORCH_GLOO_LAZY_INIT is set in the environment.
        sockets: filled in place with the sockets each group's creation opened (see
            :data:`Sockets`); None: not noted.

    Returns:
        ``({mode: ModeGroup}, number of new_group calls)``. A mode this rank is in no group of
        (EMBEDDING on a middle pipeline stage) is left out.

    Raises:
        RuntimeError: from torch, when a peer does not arrive within ``timeout``; or a group
            would reuse the name of one destroyed earlier (see :func:`_claim_name`).
    """
    used = set() if used_names is None else used_names
    with lazy_gloo(gloo_lazy_init):
        return _create(layout, rank, timeout, cpu_backend, used, _Notes(sockets))


def _create(
    layout: Layout,
    rank: int,
    timeout: timedelta,
    cpu_backend: str | None,
    used: set[tuple[Sequence[int], int]],
    notes: _Notes,
) -> tuple[dict[ParallelMode, ModeGroup], int]:
    world = ParallelMode.GLOBAL
    world_sig = layout.signature(world)
    default_group = dist.group.WORLD
    if default_group is None:
        raise RuntimeError("torch.distributed has no default group: call gpc.init_global_dist() first")
    cpu_world = default_group
    calls = 0
    blocker = local_sync_blocker() if layout.world_size > 1 else None
    if blocker is not None:
        logger.warning(
            "parallelctx: %s; every rank creates every group instead (O(world size) calls per rank)",
            blocker,
        )
    if cpu_backend is not None and layout.world_size > 1:
        cpu_world = notes.new_group(backend=cpu_backend, timeout=timeout, group_desc="parallelctx_cpu_global")
        calls += 1
    made: dict[tuple, ModeGroup] = {}
    out: dict[ParallelMode, ModeGroup] = {}
    alone: ModeGroup | None = None  # the one-rank group every size-1 mode shares
    if layout.world_size == 1:
        alone = ModeGroup(range(rank, rank + 1), default_group, cpu_world)
    for mode in creation_order(layout):
        sig = layout.signature(mode)
        # GLOBAL, and any mode spanning the whole world, is the default group (GLOBAL even in a
        # world of one, where every signature is empty).
        if mode is world or (sig == world_sig and layout.world_size > 1):
            out[mode] = ModeGroup(range(layout.world_size), default_group, cpu_world)
            continue
        members = _compact(layout.group_of(mode, rank))
        if layout.size(mode) == 1:
            if not members:
                continue
            if alone is None:
                alone, n = _one_rank_group(layout, rank, timeout, cpu_backend, blocker, used, notes)
                calls += n
            out[mode] = alone
        elif sig in made:
            if members:
                out[mode] = made[sig]
        elif blocker is not None:
            # Every rank walks every group, members or not (EMBEDDING's middle stages too).
            group, n = _group_everywhere(layout, mode, rank, timeout, None, mode.value, notes)
            calls += n
            cpu_group = group
            if cpu_backend is not None:
                cpu_group, n = _group_everywhere(
                    layout, mode, rank, timeout, cpu_backend, f"{mode.value}_cpu", notes
                )
                calls += n
            made[sig] = ModeGroup(members, group, cpu_group)
            if members:
                out[mode] = made[sig]
        elif members:
            group = _local_group(members, timeout, None, mode.value, used, notes)
            calls += 1
            cpu_group = group
            if cpu_backend is not None:
                cpu_group = _local_group(members, timeout, cpu_backend, f"{mode.value}_cpu", used, notes)
                calls += 1
            made[sig] = out[mode] = ModeGroup(members, group, cpu_group)
    return out, calls
