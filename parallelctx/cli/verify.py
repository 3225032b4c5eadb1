"""Prove a launched context by real collectives: group membership, ring order and seed streams.

Every rank calls :func:`probe_groups` and :func:`probe_seeds` together. The results come from
collectives over the process groups torch holds, never from what ``gpc`` stored, so comparing
them with the pure layout (:func:`verify`) checks the groups that were really made.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..context import ParallelContext
from ..planning.layout import Layout, ParallelMode
from ..runtime.seed import REPLICA, STREAMS

__all__ = ["ModeCheck", "probe_groups", "probe_seeds", "problems", "verify", "verify_seeds"]

_DRAWS = 4


def _world_gather(ctx: ParallelContext, value: Any) -> list[Any]:
    if ctx.get_world_size(ParallelMode.GLOBAL) == 1:
        return [value]
    out: list[Any] = [None] * ctx.get_world_size(ParallelMode.GLOBAL)
    dist.all_gather_object(out, value, group=ctx.get_cpu_group(ParallelMode.GLOBAL))
    return out


def probe_groups(ctx: ParallelContext) -> dict[str, dict[str, Any]]:
    """Measure this rank's group of every mode with collectives.

    For each mode this rank is in: ``members``, the global ranks whose one-hot vectors an
    all-reduce over the mode's group summed (so exactly the group's real members);
    ``order``, the global ranks all-gathered over the group, in group-rank order; ``cpu_members``
    likewise over the CPU group; and what ``gpc`` answers (``local_rank``, ``size``, ``next``,
    ``prev``, ``first``, ``last``) for comparison. Modes of size 1 are measured the same way, over
    their one-rank groups.

    A module's context (``gpc.module(name)``, ``parallel.modules``) is measured the same way,
    over the module's groups; its members are global ranks of the job.

    Returns:
        ``{mode name: {...}}`` for every mode this rank belongs to.
    """
    # one slot per global rank up to the layout's last (a module's ranks start at its offset)
    world = max(ctx.get_world_size(ParallelMode.GLOBAL), ctx.layout.offset + ctx.layout.world_size)
    rank = ctx.get_global_rank()
    out: dict[str, dict[str, Any]] = {}
    for mode in ParallelMode:
        if not ctx.is_initialized(mode):
            continue
        group = ctx.get_group(mode)
        cpu_group = ctx.get_cpu_group(mode)
        size = ctx.get_world_size(mode)
        # every mode has a real group (size 1: a one-rank group); a None here would reduce over
        # the whole world and show up as wrong members
        onehot = torch.zeros(world, dtype=torch.int64, device=ctx.device)
        onehot[rank] = 1
        dist.all_reduce(onehot, group=group)
        members = torch.nonzero(onehot.cpu()).flatten().tolist()
        if onehot.max().item() != 1:
            members = [-1]  # a rank counted twice: not a group of distinct members
        gathered = [
            torch.zeros(1, dtype=torch.int64, device=ctx.device) for _ in range(dist.get_world_size(group))
        ]
        dist.all_gather(gathered, torch.tensor([rank], device=ctx.device), group=group)
        order = [int(t.item()) for t in gathered]
        cpu_onehot = torch.zeros(world, dtype=torch.int64)
        cpu_onehot[rank] = 1
        dist.all_reduce(cpu_onehot, group=cpu_group)
        cpu_members = torch.nonzero(cpu_onehot).flatten().tolist()
        out[mode.value] = {
            "members": members,
            "order": order,
            "cpu_members": cpu_members,
            "local_rank": ctx.get_local_rank(mode),
            "size": size,
            "next": ctx.get_next_global_rank(mode),
            "prev": ctx.get_prev_global_rank(mode),
            "first": ctx.is_first_rank(mode),
            "last": ctx.is_last_rank(mode),
        }
    return out


def probe_seeds(ctx: ParallelContext) -> list[dict[str, Any]]:
    """Draw from every stream (each mode's and ``"replica"``; twice, in two ``with`` blocks) and
    gather the draws.

    Returns:
        One entry per global rank: ``{"coords": ..., "seeds": {stream: seed},
        "draws": {stream: [first 4 draws, next 4 draws]}}``.
    """
    draws: dict[str, list[list[float]]] = {}
    for key in STREAMS:
        with ctx.seed(key):
            first = torch.rand(_DRAWS).tolist()
        with ctx.seed(key):
            second = torch.rand(_DRAWS).tolist()
        draws[str(key)] = [first, second]
    mine = {
        "rank": ctx.get_global_rank(),
        "coords": ctx.layout.coords(ctx.get_global_rank()),
        "seeds": {str(key): ctx.get_seed(key) for key in STREAMS},
        "draws": draws,
    }
    return _world_gather(ctx, mine)


@dataclass
class ModeCheck:
    """The membership check of one mode: its group size and count in the pure layout, and every
    mismatch found (``problems``); :attr:`ok` when there is none."""

    mode: str
    group_size: int
    groups: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no rank's group of this mode differs from the layout."""
        return not self.problems


def _verify_rank(layout: Layout, mode: ParallelMode, rank: int, got: Mapping[str, Any] | None) -> list[str]:
    expected = layout.group_of(mode, rank)
    if not expected:
        return (
            [] if got is None else [f"{mode.value}: rank {rank} should be in no group, has {got['members']}"]
        )
    if got is None:
        return [f"{mode.value}: rank {rank} has no group, expected {expected}"]
    local = expected.index(rank)
    want = {
        "members": expected,
        "order": expected,
        "cpu_members": expected,
        "local_rank": local,
        "size": len(expected),
        "next": expected[(local + 1) % len(expected)],
        "prev": expected[(local - 1) % len(expected)],
        "first": local == 0,
        "last": local == len(expected) - 1,
    }
    return [
        f"{mode.value}.{key} on rank {rank}: got {got[key]}, expected {value}"
        for key, value in want.items()
        if got[key] != value
    ]


def verify(layout: Layout, probed: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> list[ModeCheck]:
    """Compare :func:`probe_groups` results with the pure layout.

    ``probed`` maps global ranks to what :func:`probe_groups` returned on them: one rank
    (``{rank: probe_groups(gpc)}``) or every rank (after an all-gather).

    Returns:
        One :class:`ModeCheck` per mode, in :class:`ParallelMode` order.

    Raises:
        LayoutError: a rank in ``probed`` outside the layout's world.
    """
    out = []
    for mode in ParallelMode:
        array = layout.group_array(mode)
        check = ModeCheck(mode.value, int(array.shape[1]), int(array.shape[0]))
        for rank, result in probed.items():
            check.problems.extend(_verify_rank(layout, mode, rank, result.get(mode.value)))
        out.append(check)
    return out


def problems(checks: list[ModeCheck]) -> list[str]:
    """Return every problem of ``checks`` (from :func:`verify`), in mode order; empty when all pass."""
    return [problem for check in checks for problem in check.problems]


def verify_seeds(layout: Layout, gathered: list[dict[str, Any]]) -> list[str]:
    """Check the seed properties of docs/seeds.md on draws gathered from every rank.

    * the default (GLOBAL) stream is the same on the ranks of a tensor group;
    * the TENSOR stream differs within a tensor group and agrees between ranks that differ
      only in their data coordinate;
    * the DATA stream agrees within a data group and differs between pipeline stages;
    * the ``"replica"`` stream agrees within a tensor group and differs within a data group;
    * no two modes start from the same seed, or draw the same numbers, on one rank;
    * each stream continues where it stopped and matches a generator seeded with its seed.

    Returns:
        A list of violations, empty when all hold.
    """
    errors: list[str] = []
    by_rank = {entry["rank"]: entry for entry in gathered}

    def first(rank: int, mode: Any) -> list[float]:
        return by_rank[rank]["draws"][str(mode)][0]

    for group in layout.groups(ParallelMode.TENSOR):
        defaults = {tuple(first(r, ParallelMode.GLOBAL)) for r in group}
        if len(defaults) != 1:
            errors.append(f"default stream differs within tensor group {group}")
        tensor = [tuple(first(r, ParallelMode.TENSOR)) for r in group]
        if len(set(tensor)) != len(group):
            errors.append(f"tensor stream repeats within tensor group {group}")
    for group in layout.groups(ParallelMode.DATA):
        if len({tuple(first(r, ParallelMode.TENSOR)) for r in group}) != 1:
            errors.append(f"tensor stream differs between data replicas {group}")
        if len({tuple(first(r, ParallelMode.DATA)) for r in group}) != 1:
            errors.append(f"data stream differs within data group {group}")
        if len({tuple(first(r, REPLICA)) for r in group}) != len(group):
            errors.append(f"replica stream repeats within data group {group}")
    for group in layout.groups(ParallelMode.TENSOR):
        if len({tuple(first(r, REPLICA)) for r in group}) != 1:
            errors.append(f"replica stream differs within tensor group {group}")
    for group in layout.groups(ParallelMode.PIPELINE):
        if len(group) > 1 and len({tuple(first(r, ParallelMode.DATA)) for r in group}) != len(group):
            errors.append(f"data stream repeats across the pipeline stages {group}")
    for rank, entry in by_rank.items():
        seeds = list(entry["seeds"].values())
        if len(set(seeds)) != len(seeds):
            errors.append(f"rank {rank}: two modes share a seed: {entry['seeds']}")
        by_draw: dict[tuple[float, ...], list[str]] = {}
        for key in STREAMS:  # distinct seeds are not enough: a generator may drop seed bits
            by_draw.setdefault(tuple(first(rank, key)), []).append(str(key))
        alike = [names for names in by_draw.values() if len(names) > 1]
        if alike:
            errors.append(f"rank {rank}: these streams draw the same numbers: {alike}")
        for key in STREAMS:
            if key is ParallelMode.GLOBAL:
                continue  # the default stream also served the draws of the other probes
            gen = torch.Generator().manual_seed(entry["seeds"][str(key)])
            expected = torch.rand(2 * _DRAWS, generator=gen).tolist()
            got = entry["draws"][str(key)][0] + entry["draws"][str(key)][1]
            if got != expected:
                errors.append(f"rank {rank}: {key} stream does not continue from its seed")
    return errors
