"""Call counts per process group, to catch a pooled test that leaves its collectives unbalanced.

The ranks of a pool keep ``gpc`` (and their processes) between passing tests, so a test that
passes while one rank made a call its peers never matched (rank 0 alone starts
``dist.all_reduce(x, async_op=True)`` and never waits; rank 0 sends a tensor rank 1 never
receives) leaves that call pending: the next test's first call on the group pairs with it and
gets a wrong number or hangs, with nothing pointing at the test that caused it.

* **Counting, on each rank** (:func:`install`, :func:`open_window`, :func:`close_window`). The
  collective and point-to-point methods of ``torch.distributed.ProcessGroup`` (``allreduce``,
  ``broadcast``, ``send``, ``recv``, ...; every ``torch.distributed`` function calls one, on
  the group it was given or the default group) are wrapped once per session process. While a
  test's window is open (from just after the plugin launched ``gpc`` to the end of the test's
  teardown), a call adds one to its group's counter: a dict lookup and an increment; outside
  the window a call passes straight through. Collectives are counted per kind; sends per
  destination, receives per source (or "any source"). torch's functional collectives
  (``torch.distributed._functional_collectives``, DTensor's redistributions and their backward
  passes), which reach the group in C++, are counted as the ``torch.distributed`` collective
  they match (:mod:`parallelctx.guard.funcol`).
* **Comparing, in the controller** (:func:`unbalanced`). Each rank sends its counts with its
  result over the pool's control connection (no process group carries them, so the comparison
  itself is never counted). For every group of two ranks or more, keyed by torch's group name
  and members (the same on every member), the members must have made the same collectives
  (kind by kind), and every send from rank a to rank b must have a receive on b from a (with
  receives from any source, the totals into b must match).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from ..guard.funcol import FunctionalCall, watch_functional
from ..guard.hang import OPS as _HANG_OPS
from ..guard.patch import Patches

__all__ = [
    "ANY_SOURCE",
    "COLLECTIVE_METHODS",
    "close_window",
    "describe_group",
    "install",
    "open_window",
    "unbalanced",
]

COLLECTIVE_METHODS: dict[str, str] = {
    **_HANG_OPS,
    "_allgather_base": "all_gather_into_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "alltoall_base": "all_to_all_single",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "monitored_barrier": "monitored_barrier",
}
"""``ProcessGroup`` collective method -> the ``torch.distributed`` function that calls it."""

ANY_SOURCE = -1
"""The source a receive from any rank (``recv(t)`` without ``src``) is counted under."""


class _Counts:
    """One group's calls in the open window, on this rank (written by the calling thread)."""

    __slots__ = ("calls", "info", "received", "sent")

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info  # name, ranks and words for the group, taken at its first call
        self.calls: dict[str, int] = {}  # collective -> count
        self.sent: dict[int, int] = {}  # destination (rank in the group) -> count
        self.received: dict[int, int] = {}  # source (rank in the group, or ANY_SOURCE) -> count


class _Window:
    """The counters of the test under way (``table`` is None while no window is open)."""

    table: dict[Any, _Counts] | None = None


_WINDOW = _Window()
_PATCHES = Patches()


def describe_group(group: Any) -> str:
    """Word a process group as a person reads it: ``the tensor group``, ``the data group (also
    gpc's context group)`` (modes sharing one group, the first in :class:`ParallelMode` order
    named first), ``the default group (gpc's data group, and 5 more modes)``, ``the default
    group``, ``the CPU twin of the tensor group``, or ``group '3' (not one of gpc's)``.

    Returns:
        The words. Never raises.
    """
    from ..context import gpc
    from ..planning.layout import ParallelMode

    modes: list[str] = []
    twins: list[str] = []
    try:
        for mode in ParallelMode:
            if mode is ParallelMode.GLOBAL or not gpc.is_initialized(mode):
                continue
            if gpc.get_group(mode) is group:
                modes.append(mode.value)
            elif gpc.get_cpu_group(mode) is group:
                twins.append(mode.value)
    except Exception:  # words must never hide the check
        pass
    default = group is dist.GroupMember.WORLD
    if default:
        return f"the default group ({_modes_phrase(modes)})" if modes else "the default group"
    if modes:
        return f"the {modes[0]} group" + (f" (also {_modes_phrase(modes[1:])})" if modes[1:] else "")
    if twins:
        return f"the CPU twin of the {twins[0]} group"
    return f"group {_name_of(group)!r} (not one of gpc's)"


def _modes_phrase(modes: Sequence[str]) -> str:
    """``gpc's data group``, ``gpc's data and context groups``, ``gpc's data group, and 5 more
    modes``."""
    if len(modes) == 1:
        return f"gpc's {modes[0]} group"
    if len(modes) == 2:
        return f"gpc's {modes[0]} and {modes[1]} groups"
    return f"gpc's {modes[0]} group, and {len(modes) - 1} more modes"


def _name_of(group: Any) -> str:
    try:
        return str(group.group_name)
    except Exception:
        return hex(id(group))


def _first_sight(group: Any) -> _Counts:
    """The counters of a group seen for the first time in this window, with its name, global
    ranks and words (taken now: a test may destroy the group before its window closes)."""
    try:
        ranks = [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception:  # not a group torch knows (any more): counted, never compared
        ranks = []
    return _Counts({"name": _name_of(group), "ranks": ranks, "what": describe_group(group)})


def _counted(self: Any) -> _Counts | None:
    table = _WINDOW.table
    if table is None:
        return None
    counts = table.get(self)
    if counts is None:
        counts = table[self] = _first_sight(self)
    return counts


def _wrap_collective(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def collective(self: Any, *args: Any, **kwargs: Any) -> Any:
        work = original(self, *args, **kwargs)
        counts = _counted(self)
        if counts is not None:
            counts.calls[op] = counts.calls.get(op, 0) + 1
        return work

    return collective


def _count_functional(call: FunctionalCall) -> None:
    counts = _counted(call.group)
    if counts is not None:
        counts.calls[call.op] = counts.calls.get(call.op, 0) + 1


def _peer(args: Sequence[Any], kwargs: Mapping[str, Any], name: str) -> int:
    """The peer (a rank in the group) of ``send(tensors, dstRank, tag)`` or
    ``recv(tensors, srcRank, tag)``; ANY_SOURCE when it cannot be read."""
    value = args[1] if len(args) > 1 else kwargs.get(name)
    return int(value) if isinstance(value, int) else ANY_SOURCE


def _wrap_send(original: Callable[..., Any]) -> Callable[..., Any]:
    def send(self: Any, *args: Any, **kwargs: Any) -> Any:
        work = original(self, *args, **kwargs)
        counts = _counted(self)
        if counts is not None:
            peer = _peer(args, kwargs, "dstRank")
            counts.sent[peer] = counts.sent.get(peer, 0) + 1
        return work

    return send


def _wrap_recv(original: Callable[..., Any], any_source: bool) -> Callable[..., Any]:
    def recv(self: Any, *args: Any, **kwargs: Any) -> Any:
        work = original(self, *args, **kwargs)
        counts = _counted(self)
        if counts is not None:
            peer = ANY_SOURCE if any_source else _peer(args, kwargs, "srcRank")
            counts.received[peer] = counts.received.get(peer, 0) + 1
        return work

    return recv


def install() -> None:
    """Wrap the collective and point-to-point methods of ``torch.distributed.ProcessGroup`` and
    torch's functional collectives for counting, once for this process (a second call does nothing); a call counts only while a
    window is open (:func:`open_window`). Returns None."""
    if _PATCHES:
        return
    pg = dist.ProcessGroup
    for name, op in COLLECTIVE_METHODS.items():
        if name in vars(pg):
            _PATCHES.replace(pg, name, functools.partial(_wrap_collective, op))
    if "send" in vars(pg):
        _PATCHES.replace(pg, "send", _wrap_send)
    if "recv" in vars(pg):
        _PATCHES.replace(pg, "recv", functools.partial(_wrap_recv, any_source=False))
    if "recv_anysource" in vars(pg):
        _PATCHES.replace(pg, "recv_anysource", functools.partial(_wrap_recv, any_source=True))
    watch_functional(_PATCHES, _count_functional)


def open_window() -> None:
    """Start counting the calls of a test from zero (:func:`install` first). Returns None."""
    _WINDOW.table = {}


def close_window() -> list[dict[str, Any]] | None:
    """Stop counting and hand over what was counted since :func:`open_window`.

    Returns:
        One dict per group called (``name``, ``ranks``: its global ranks, ``what``: its words,
        ``calls``: collective -> count, ``sent``: destination global rank -> count,
        ``received``: source global rank (or :data:`ANY_SOURCE`) -> count); None when no window
        was open.
    """
    table, _WINDOW.table = _WINDOW.table, None
    if table is None:
        return None
    merged: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    for counts in table.values():
        ranks = counts.info["ranks"]
        key = (counts.info["name"], tuple(ranks))
        entry = merged.setdefault(key, {**counts.info, "calls": {}, "sent": {}, "received": {}})
        _add(entry["calls"], counts.calls)
        _add(entry["sent"], {_global(ranks, r): n for r, n in counts.sent.items()})
        _add(entry["received"], {_global(ranks, r): n for r, n in counts.received.items()})
    return list(merged.values())


def _add(into: dict[Any, int], counts: Mapping[Any, int]) -> None:
    for key, n in counts.items():
        into[key] = into.get(key, 0) + n


def _global(ranks: Sequence[int], group_rank: int) -> int:
    """The global rank of ``group_rank`` (ANY_SOURCE stays, as does a rank outside the group)."""
    return ranks[group_rank] if 0 <= group_rank < len(ranks) else group_rank


# ----------------------------------------------------------------------------- the controller


def _kinds(calls: Mapping[str, int]) -> str:
    return ", ".join(f"{op} x{n}" for op, n in sorted(calls.items()))


def _collective_phrase(rank: int, calls: Mapping[str, int]) -> str:
    total = sum(calls.values())
    if not total:
        return f"rank {rank} made none"
    return f"rank {rank} made {total} collective call{'s' if total != 1 else ''} on it ({_kinds(calls)})"


def _check_collectives(what: str, ranks: Sequence[int], found: Mapping[int, Mapping[str, Any]]) -> str:
    """The problem of a group whose members made different collectives, or ""."""
    calls = {r: dict(found[r]["calls"]) if r in found else {} for r in ranks}
    if all(c == calls[ranks[0]] for c in calls.values()):
        return ""
    parts = [_collective_phrase(r, calls[r]) for r in ranks]
    return f"{what} (ranks {', '.join(map(str, ranks))}): " + "; ".join(parts)


def _check_point_to_point(
    what: str, ranks: Sequence[int], found: Mapping[int, Mapping[str, Any]]
) -> list[str]:
    """The problems of a group's sends without their receives (and receives without sends)."""
    sent = {r: dict(found[r]["sent"]) if r in found else {} for r in ranks}
    received = {r: dict(found[r]["received"]) if r in found else {} for r in ranks}
    where = f"{what} (ranks {', '.join(map(str, ranks))})"
    problems = []
    for dst in ranks:
        into = {src: sent[src].get(dst, 0) for src in ranks if sent[src].get(dst, 0)}
        got = {src: n for src, n in received[dst].items() if n}
        if ANY_SOURCE in got:  # a receive from any source matches any send: compare the totals
            if sum(into.values()) != sum(got.values()):
                problems.append(
                    f"{where}: rank {dst} received {sum(got.values())} tensor(s) "
                    f"({got[ANY_SOURCE]} from any source), but its peers sent it {sum(into.values())}"
                    f"{_senders(into)}"
                )
            continue
        for src in sorted(set(into) | set(got)):
            if into.get(src, 0) != got.get(src, 0):
                problems.append(
                    f"{where}: rank {src} sent {into.get(src, 0)} tensor(s) to rank {dst}, "
                    f"which received {got.get(src, 0)} from rank {src}"
                )
    return problems


def _senders(into: Mapping[int, int]) -> str:
    return f" ({', '.join(f'{n} from rank {r}' for r, n in sorted(into.items()))})" if into else ""


def unbalanced(counts: Mapping[int, Sequence[Mapping[str, Any]] | None]) -> list[str]:
    """Compare the ranks' counts (rank -> what its :func:`close_window` returned) group by group.

    Returns:
        One sentence per unbalanced group, naming the group (its words and members), the ranks
        and their counts, e.g. ``the default group (ranks 0, 1): rank 0 made 1 collective call
        on it (all_reduce x1); rank 1 made none``; empty when every group is balanced, or when
        a rank sent no counts (nothing is compared then).
    """
    if not counts or any(found is None for found in counts.values()):
        return []
    groups: dict[tuple[str, tuple[int, ...]], dict[int, Mapping[str, Any]]] = {}
    for rank, entries in sorted(counts.items()):
        for entry in entries or ():
            ranks = tuple(int(r) for r in entry["ranks"])
            if len(ranks) > 1:
                groups.setdefault((str(entry["name"]), ranks), {})[rank] = entry
    problems: list[str] = []
    for (_, ranks), found in groups.items():
        members = [r for r in ranks if r in counts]
        if len(members) < len(ranks):
            continue  # a member outside this pool's world: nothing to compare it with
        what = str(found[min(found)]["what"])
        problem = _check_collectives(what, members, found)
        if problem:
            problems.append(problem)
        problems.extend(_check_point_to_point(what, members, found))
    return problems
