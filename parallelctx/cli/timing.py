"""Time an all-reduce in every group of a launched context, and summarise the times per mode.

Every rank calls :func:`time_allreduce` with the same arguments; all groups of a mode run at
once, as they do in training. A group's latency is the slowest of its members' (the collective
ends when its last member is done); its bus bandwidth follows the nccl-tests convention for
all-reduce, ``bytes / latency * 2 (n - 1) / n``. Times are measurements, never pass or fail.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..planning.layout import Layout, ParallelMode

__all__ = [
    "DEFAULT_SIZES",
    "GroupTiming",
    "ModeTiming",
    "bus_bandwidth",
    "format_size",
    "parse_sizes",
    "summarise",
    "time_allreduce",
    "timed_modes",
]

DEFAULT_SIZES: tuple[int, ...] = (4 << 10, 1 << 20, 16 << 20)
"""Message sizes timed by default: 4 KiB (latency), 1 MiB, 16 MiB (bandwidth)."""

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}


def parse_sizes(text: str) -> tuple[int, ...]:
    """Parse ``"4KiB,1MiB,16MiB"`` (units B, K/KiB, M/MiB, G/GiB, powers of 1024) into bytes.

    Returns:
        The sizes in bytes, in the given order.

    Raises:
        ValueError: an empty list, an unknown unit, or a size below 4 bytes (one float32).
    """
    sizes = []
    for item in (t.strip() for t in text.split(",")):
        match = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", item)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"message size {item!r} is not understood; write e.g. 4KiB,1MiB,16MiB")
        size = int(match.group(1)) * _UNITS[match.group(2).lower()]
        if size < 4:
            raise ValueError(f"message size {item!r} is below 4 bytes; give at least one float32 (4B)")
        sizes.append(size)
    return tuple(sizes)


def format_size(nbytes: int) -> str:
    """Return ``nbytes`` as ``"4 KiB"``, ``"16 MiB"`` or ``"100 B"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def bus_bandwidth(nbytes: int, seconds: float, ranks: int) -> float:
    """Return the all-reduce bus bandwidth in GB/s (10**9 bytes): ``nbytes / seconds *
    2 (ranks - 1) / ranks``; 0.0 for a non-positive time or a single rank."""
    if seconds <= 0 or ranks < 2:
        return 0.0
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def timed_modes(layout: Layout) -> list[tuple[ParallelMode, ParallelMode | None]]:
    """Return the modes with groups of more than one rank, each with the earlier mode whose groups
    are identical (timed once, under that mode) or None, in :class:`ParallelMode` order."""
    out: list[tuple[ParallelMode, ParallelMode | None]] = []
    first: dict[Any, ParallelMode] = {}
    for mode in layout.modes():
        if layout.size(mode) < 2:
            continue
        key = layout.signature(mode)
        out.append((mode, first.get(key)))
        first.setdefault(key, mode)
    return out


def time_allreduce(
    ctx: Any,
    sizes: Sequence[int],
    iters: int = 5,
    warmup: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Time ``iters`` all-reduces of float32 tensors of each size in this rank's group of every
    mode :func:`timed_modes` times (identical groups once). Collective: every rank calls it.

    ``progress`` (rank 0 passes a printer) gets one line per mode.

    Returns:
        ``{mode name: [seconds per all-reduce on this rank, one per size]}`` for the modes this
        rank has a group of.

    Raises:
        ValueError: ``iters`` below 1 or ``warmup`` below 0.
    """
    import torch
    import torch.distributed as dist

    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters} must be >= 1 and warmup={warmup} >= 0")
    device = ctx.device
    buffer = torch.ones(max(sizes) // 4, dtype=torch.float32, device=device)
    tick = torch.zeros(1, dtype=torch.float32, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    todo = [mode for mode, same in timed_modes(ctx.layout) if same is None]
    out: dict[str, list[float]] = {}
    for index, mode in enumerate(todo, 1):
        start = time.perf_counter()
        if ctx.is_initialized(mode) and ctx.get_group(mode) is not None:
            group = ctx.get_group(mode)
            seconds = []
            for size in sizes:
                data = buffer[: size // 4]
                for _ in range(warmup):
                    dist.all_reduce(data, group=group)
                dist.all_reduce(tick, group=group)  # line the members up before the clock starts
                sync()
                begin = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(data, group=group)
                sync()
                seconds.append((time.perf_counter() - begin) / iters)
            out[mode.value] = seconds
        if progress is not None:
            progress(
                f"[{index}/{len(todo)}] all-reduce in {ctx.layout.group_array(mode).shape[0]} {mode.value} "
                f"group(s) of {ctx.layout.size(mode)}: {time.perf_counter() - start:.2f} s on this rank"
            )
    return out


@dataclass
class GroupTiming:
    """One group's all-reduce: its ranks, the latency (seconds, slowest member) and bus
    bandwidth (GB/s) per message size."""

    ranks: list[int]
    latency_s: list[float]
    busbw_gbs: list[float]


@dataclass
class ModeTiming:
    """The all-reduce times of one mode: every group's, the slowest group (at the largest size)
    and the groups much slower than their peers. ``same_as`` names the mode whose identical
    groups were timed instead."""

    mode: str
    sizes: list[int]
    groups: list[GroupTiming] = field(default_factory=list)
    slowest: GroupTiming | None = None
    slow_groups: list[list[int]] = field(default_factory=list)
    same_as: str | None = None


def summarise(
    layout: Layout,
    mode: ParallelMode,
    gathered: Mapping[int, Mapping[str, list[float]]],
    sizes: Sequence[int],
    slow_factor: float = 2.0,
) -> ModeTiming:
    """Summarise the :func:`time_allreduce` results of every rank (``{rank: result}``) for ``mode``.

    A group is *much slower* when its latency at the largest size exceeds ``slow_factor`` times
    the median of the other groups of the mode.

    Returns:
        The :class:`ModeTiming`; its groups are empty when no rank timed the mode.
    """
    timing = ModeTiming(mode.value, list(sizes))
    for ranks in layout.groups(mode):
        per_member = [gathered[r][mode.value] for r in ranks if mode.value in gathered.get(r, {})]
        if not per_member:
            continue
        latency = [max(member[i] for member in per_member) for i in range(len(sizes))]
        busbw = [bus_bandwidth(size, t, len(ranks)) for size, t in zip(sizes, latency)]
        timing.groups.append(GroupTiming(ranks, latency, busbw))
    if timing.groups:
        timing.slowest = max(timing.groups, key=lambda g: g.latency_s[-1])
        for i, group in enumerate(timing.groups):
            peers = [g.latency_s[-1] for j, g in enumerate(timing.groups) if j != i]
            if peers and group.latency_s[-1] > slow_factor * statistics.median(peers):
                timing.slow_groups.append(group.ranks)
    return timing
