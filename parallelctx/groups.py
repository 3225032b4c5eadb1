"""Creating this rank's torch process groups from a :class:`~parallelctx.layout.Layout`.

Each rank creates only the groups it belongs to, with ``use_local_synchronization=True``, so
its cost is O(number of modes), not O(world size). Creation follows one rank-independent order
(the order of :class:`ParallelMode`, EMBEDDING last), which torch needs: with local
synchronization a group's name hashes its members *and* how many groups the process already
has, so every member must have made the same groups before it.

* A mode of size 1 gets no process group.
* A mode whose groups equal the whole world uses the default group.
* Modes whose groups have identical members share one process group.
* With an accelerator backend a gloo group is made beside each group, for object collectives
  and CPU barriers; with gloo the CPU group is the group itself.

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

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .layout import Layout, ParallelMode

__all__ = ["ModeGroup", "RankLattice", "create_groups", "creation_order", "local_sync_blocker"]

logger = logging.getLogger("parallelctx")


@dataclass(frozen=True)
class ModeGroup:
    """This rank's group of one mode: members, and the process groups (None for size 1).

    ``ranks`` is a :class:`RankLattice` (a read-only sequence equal to the tuple of members),
    so its memory and ``ranks.index(rank)`` do not grow with the world; a tuple for EMBEDDING.
    """

    ranks: Sequence[int]
    group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None


class RankLattice(Sequence[int]):
    """The ascending ranks ``base + sum(i_k * stride_k)`` for ``0 <= i_k < size_k``: a group
    that spans several axes of the rank grid, in O(axes) memory.

    ``spans`` are ``(stride, size)`` pairs, strides ascending, each axis nested outside the
    previous one (``stride_k+1 >= stride_k * size_k``), which is what
    :meth:`parallelctx.layout.Layout.signature` returns. Indexing, ``index`` and ``in`` cost
    O(axes); iterating yields the ranks in ascending order.
    """

    __slots__ = ("_base", "_spans", "_len")

    def __init__(self, base: int, spans: tuple[tuple[int, int], ...]) -> None:
        self._base = base
        self._spans = spans
        n = 1
        for _, size in spans:
            n *= size
        self._len = n

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]  # type: ignore[return-value]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} is outside a group of {self._len} ranks")
        rank = self._base
        for stride, size in self._spans:
            rank += (i % size) * stride
            i //= size
        return rank

    def index(self, rank: int, start: int = 0, stop: int | None = None) -> int:
        """Return the position of ``rank``; raise ValueError when it is not a member."""
        offset = rank - self._base
        position, weight = 0, 1
        for stride, size in self._spans:
            digit = (offset // stride) % size
            position += digit * weight
            weight *= size
        if offset < 0 or self[position] != rank or not start <= position < (self._len if stop is None else stop):
            raise ValueError(f"rank {rank} is not in this group")
        return position

    def __contains__(self, rank: object) -> bool:
        try:
            self.index(rank)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            return False
        return True

    def tolist(self) -> list[int]:
        """Return the members as a new list of ints, ascending (vectorised)."""
        ranks = np.full(1, self._base, dtype=np.int64)
        for stride, size in self._spans:  # each axis is nested outside the previous ones
            ranks = (np.arange(size, dtype=np.int64)[:, None] * stride + ranks[None, :]).ravel()
        return ranks.tolist()

    def key(self) -> tuple:
        """A hashable description of the members, O(axes) in size."""
        return (self._base, self._spans)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(other) == self._len and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"RankLattice({list(self) if self._len <= 16 else f'{self[0]}..{self[-1]}, {self._len} ranks'})"


def _world_members(world_size: int) -> Sequence[int]:
    """Every rank of the world, as a :class:`RankLattice`."""
    return RankLattice(0, ((1, world_size),))


def _members(layout: Layout, mode: ParallelMode, rank: int) -> Sequence[int]:
    """This rank's group of ``mode`` in memory that does not grow with the group: a
    :class:`RankLattice`, or a tuple for EMBEDDING (at most two ranks)."""
    sig = layout.signature(mode)
    if not sig or not isinstance(sig[0], tuple):  # EMBEDDING beyond 2 stages: not a lattice
        return tuple(layout.group_of(mode, rank))
    base = rank
    for stride, size in sig:
        base -= ((rank // stride) % size) * stride
    return RankLattice(base, sig)


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


# Names torch gives locally synchronized groups: a hash of (members, groups the process has).
# Remembered per default group, to refuse re-creating a destroyed group under its old name.
# Only a hash of each (members, count) is kept, so the memory does not grow with group sizes.
_names_owner: Any = None
_names_used: set[int] = set()


def _claim_name(members: Sequence[int]) -> None:
    """Record the name torch is about to give a locally synchronized group of ``members``.

    Raises:
        RuntimeError: this process already made a group with these members under the same name
            on this default group (it was destroyed since); the message says how to avoid it.
    """
    global _names_owner
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    if names is None:  # a torch without this registry: nothing to check against
        return
    if _names_owner is not dist.group.WORLD:
        _names_owner = dist.group.WORLD
        _names_used.clear()
    described = members.key() if isinstance(members, RankLattice) else tuple(members)
    key = hash((described, len(names)))
    if key in _names_used:
        raise RuntimeError(
            f"parallelctx already made a process group of ranks {list(members)} on this default "
            f"group while the process held {len(names)} groups, and destroyed it since; torch would "
            "give the new group the old name, and its members would meet on stale rendezvous keys "
            "(gloo: 'connection refused' until the timeout). Destroy and re-create the default "
            "group too (let parallelctx own it: launch without calling init_process_group first), "
            "or keep another process group alive across gpc.destroy() so the names differ"
        )
    _names_used.add(key)


def _local_group(
    members: Sequence[int], timeout: timedelta, backend: str | None, desc: str
) -> dist.ProcessGroup:
    """Create one group that only its members call for (local synchronization)."""
    _claim_name(members)
    ranks = members.tolist() if isinstance(members, RankLattice) else list(members)
    return dist.new_group(
        ranks,
        timeout=timeout,
        backend=backend,
        use_local_synchronization=True,
        group_desc=desc,
    )


def _group_everywhere(
    layout: Layout, mode: ParallelMode, rank: int, timeout: timedelta, backend: str | None, desc: str
) -> tuple[Any, int]:
    """Create every group of ``mode`` on this rank (all ranks call); return (ours or None, calls)."""
    mine = None
    rows = layout.group_array(mode).tolist()
    for row in rows:
        group = dist.new_group(row, timeout=timeout, backend=backend, group_desc=desc)
        if rank in row:
            mine = group
    return mine, len(rows)


def create_groups(
    layout: Layout, rank: int, timeout: timedelta, cpu_backend: str | None
) -> tuple[dict[ParallelMode, ModeGroup], int]:
    """Create the process groups of every mode that ``rank`` belongs to.

    Args:
        layout: the world's layout; ``layout.world_size`` must equal the default group's size.
        rank: this process's global rank.
        timeout: the timeout of every group made here.
        cpu_backend: ``"gloo"`` to make a CPU group beside each group (accelerator backends),
            ``None`` when the main backend already runs on the CPU.

    Returns:
        ``({mode: ModeGroup}, number of new_group calls)``. A mode this rank is in no group of
        (EMBEDDING on a middle pipeline stage) is left out.

    Raises:
        RuntimeError: from torch, when a peer does not arrive within ``timeout``; or a group
            would reuse the name of one destroyed earlier (see :func:`_claim_name`).
    """
    world = ParallelMode.GLOBAL
    world_sig = layout.signature(world)
    default_group = dist.group.WORLD
    cpu_world = default_group
    calls = 0
    blocker = local_sync_blocker() if layout.world_size > 1 else None
    if blocker is not None:
        logger.warning(
            "parallelctx: %s; every rank creates every group instead (O(world size) calls per rank)",
            blocker,
        )
    if cpu_backend is not None and layout.world_size > 1:
        cpu_world = dist.new_group(backend=cpu_backend, timeout=timeout, group_desc="parallelctx_cpu_global")
        calls += 1
    made: dict[tuple, ModeGroup] = {}
    out: dict[ParallelMode, ModeGroup] = {}
    for mode in creation_order(layout):
        if mode is world:  # the default group, even in a world of one; O(1) members
            out[mode] = ModeGroup(_world_members(layout.world_size), default_group, cpu_world)
            continue
        sig = layout.signature(mode)
        if sig == world_sig and layout.size(mode) == layout.world_size > 1:
            out[mode] = ModeGroup(_world_members(layout.world_size), default_group, cpu_world)
            continue
        members = _members(layout, mode, rank)
        if layout.size(mode) == 1:
            if members:
                out[mode] = ModeGroup(members, None, None)
        elif sig in made:
            if members:
                out[mode] = made[sig]
        elif blocker is not None:
            # Every rank walks every group, members or not (EMBEDDING's middle stages too).
            group, n = _group_everywhere(layout, mode, rank, timeout, None, mode.value)
            calls += n
            cpu_group = group
            if cpu_backend is not None:
                cpu_group, n = _group_everywhere(layout, mode, rank, timeout, cpu_backend, f"{mode.value}_cpu")
                calls += n
            made[sig] = ModeGroup(members, group, cpu_group)
            if members:
                out[mode] = made[sig]
        elif members:
            group = _local_group(members, timeout, None, mode.value)
            calls += 1
            cpu_group = group
            if cpu_backend is not None:
                cpu_group = _local_group(members, timeout, cpu_backend, f"{mode.value}_cpu")
                calls += 1
            made[sig] = out[mode] = ModeGroup(members, group, cpu_group)
    return out, calls
