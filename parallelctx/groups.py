"""Creating this rank's torch process groups from a :class:`~parallelctx.layout.Layout`.

Each rank creates only the groups it belongs to, with ``use_local_synchronization=True``, so
its cost is O(number of modes), not O(world size). Creation follows one rank-independent order
(the order of :class:`ParallelMode`, EMBEDDING last), which torch needs: with local
synchronization a group's name hashes its members *and* how many groups the process already
made, so every member must have made the same groups before it.

* A mode of size 1 gets no process group.
* A mode whose groups equal the whole world uses the default group.
* Modes whose groups have identical members share one process group.
* With an accelerator backend a gloo group is made beside each group, for object collectives
  and CPU barriers; with gloo the CPU group is the group itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from .layout import Layout, ParallelMode

__all__ = ["ModeGroup", "create_groups", "creation_order"]


@dataclass(frozen=True)
class ModeGroup:
    """This rank's group of one mode: members, and the process groups (None for size 1)."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None


def creation_order(layout: Layout) -> list[ParallelMode]:
    """Return the modes in the order their groups are made: every mode, EMBEDDING last.

    EMBEDDING goes last because middle pipeline stages belong to no embedding group; making it
    earlier would leave them with fewer groups than their peers when the next group is named.
    """
    modes = [m for m in layout.modes() if m is not ParallelMode.EMBEDDING]
    return modes + [ParallelMode.EMBEDDING]


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
        RuntimeError: from torch, when a peer does not arrive within ``timeout``.
    """
    world = ParallelMode.GLOBAL
    world_sig = layout.signature(world)
    default_group = dist.group.WORLD
    cpu_world = default_group
    calls = 0
    if cpu_backend is not None and layout.world_size > 1:
        cpu_world = dist.new_group(backend=cpu_backend, timeout=timeout, group_desc="parallelctx_cpu_global")
        calls += 1
    made: dict[tuple, ModeGroup] = {}
    out: dict[ParallelMode, ModeGroup] = {}
    for mode in creation_order(layout):
        members = tuple(layout.group_of(mode, rank))
        if not members:
            continue
        sig = layout.signature(mode)
        if mode is world:  # the default group, even in a world of one
            out[mode] = ModeGroup(members, default_group, cpu_world)
        elif len(members) == 1:
            out[mode] = ModeGroup(members, None, None)
        elif sig == world_sig:
            out[mode] = ModeGroup(members, default_group, cpu_world)
        elif sig in made:
            out[mode] = made[sig]
        else:
            group = dist.new_group(
                list(members), timeout=timeout, use_local_synchronization=True, group_desc=mode.value
            )
            calls += 1
            cpu_group = group
            if cpu_backend is not None:
                cpu_group = dist.new_group(
                    list(members),
                    timeout=timeout,
                    backend=cpu_backend,
                    use_local_synchronization=True,
                    group_desc=f"{mode.value}_cpu",
                )
                calls += 1
            made[sig] = out[mode] = ModeGroup(members, group, cpu_group)
    return out, calls
