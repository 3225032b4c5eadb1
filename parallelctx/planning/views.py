"""What the context answers queries from: per-mode tables and views, and the not-launched
error.

:class:`ModeView` is one rank's place in one mode (``gpc.tensor``); :class:`ModeTable` is a
dict keyed by mode whose misses resolve mode aliases (``"tp"``, ``"TENSOR"``) or raise the
context's clear error; :class:`Unlaunched` stands in for a view before launch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

from .layout import LayoutError, ParallelMode

__all__ = ["LAUNCH_HINT", "VIEW_NAMES", "ModeTable", "ModeView", "NotLaunchedError", "Ranks", "Unlaunched"]

LAUNCH_HINT = (
    "call parallelctx.launch_from_torch(config) (or launch, launch_from_env, launch_from_slurm, "
    "launch_from_openmpi, spawn) first"
)

# Attribute name of each mode's view on the context: gpc.tensor, gpc.world, ...
VIEW_NAMES: dict[ParallelMode, str] = {
    mode: ("world" if mode is ParallelMode.GLOBAL else mode.value) for mode in ParallelMode
}


class NotLaunchedError(RuntimeError):
    """A query was made before the context was launched, or after ``destroy()``."""


class Ranks(Sequence[int]):
    """The ascending global ranks of a group (``gpc.tensor.ranks``): a read-only sequence that
    compares equal to any list, tuple or range of the same ranks (``gpc.tensor.ranks == [0, 1]``,
    ``== gpc.get_ranks_in_group("tensor")``). It keeps the members as given (a ``range`` for
    evenly spaced ones), so neither its memory nor ``index`` grows with the world; a slice is a
    ``Ranks`` too; it hashes as the tuple of its members; ``list(r)`` gives a plain list."""

    __slots__ = ("_members",)

    def __init__(self, members: Sequence[int]) -> None:
        self._members = members

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Ranks: ...
    def __getitem__(self, index: int | slice) -> int | Ranks:
        if isinstance(index, slice):  # a slice stays a Ranks, so it too equals a list
            return Ranks(self._members[index])
        return self._members[index]

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[int]:
        return iter(self._members)

    def __contains__(self, rank: object) -> bool:
        return rank in self._members

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        """The position of global rank ``value`` in the group (its local rank); raises
        ValueError when it is not a member."""
        position = self._members.index(value)
        if position < start or (stop is not None and position >= stop):
            raise ValueError(f"{value} is not in ranks[{start}:{stop}]")
        return position

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ranks):
            other = other._members
        if not isinstance(other, (list, tuple, range)):
            return NotImplemented
        if len(other) != len(self._members):
            return False
        if isinstance(other, range) and isinstance(self._members, range):
            return other == self._members
        return all(a == b for a, b in zip(self._members, other))

    def __hash__(self) -> int:
        return hash(tuple(self._members))

    def __repr__(self) -> str:
        members = self._members
        if isinstance(members, range) and len(members) > 16:
            return f"Ranks({members!r})"
        return f"Ranks({list(members)!r})"


@dataclass(frozen=True, slots=True)
class ModeView:
    """This rank's place in one mode, e.g. ``gpc.tensor``.

    ``rank`` is the local rank in the mode, ``size`` the group size, ``ranks`` the ascending
    global ranks of the group (a :class:`Ranks`, equal to the list of them), ``group``/``cpu_group``
    the process groups (a one-rank group of this rank for a mode of size 1, never None),
    ``next_rank``/``prev_rank`` the global ranks after and before this one in ring order.
    """

    mode: ParallelMode
    rank: int
    size: int
    ranks: Sequence[int]
    group: Any
    cpu_group: Any
    next_rank: int
    prev_rank: int

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, Ranks):
            object.__setattr__(self, "ranks", Ranks(self.ranks))

    @property
    def is_first(self) -> bool:
        """True on the group's first rank."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """True on the group's last rank."""
        return self.rank == self.size - 1


class ModeTable(dict[Any, Any]):
    """A per-mode answer table keyed by :class:`ParallelMode` (a member's plain name finds it:
    equal hashes). A miss resolves an alias or another spelling (``"tp"``, ``"TENSOR"``) to its
    mode; a name of no mode, or a mode this rank has no entry for, raises ``miss(mode)``."""

    __slots__ = ("_miss",)

    def __init__(self, miss: Callable[[Any], Exception]) -> None:
        super().__init__()
        self._miss = miss

    def __missing__(self, mode: Any) -> Any:
        try:
            parsed = ParallelMode.parse(mode)
        except LayoutError:
            raise self._miss(mode) from None
        if parsed is not mode and dict.__contains__(self, parsed):
            return dict.__getitem__(self, parsed)
        raise self._miss(mode)


class Unlaunched:
    """Stands in for a :class:`ModeView` before launch; every attribute raises."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise NotLaunchedError(f"gpc.{self._name}.{attr} is not available yet: {LAUNCH_HINT}")

    def __repr__(self) -> str:
        return f"<gpc.{self._name}: not launched>"
