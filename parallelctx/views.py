"""What the context answers queries from: per-mode tables and views, and the not-launched
error.

:class:`ModeView` is one rank's place in one mode (``gpc.tensor``); :class:`ModeTable` is a
dict keyed by mode whose misses resolve mode aliases (``"tp"``, ``"TENSOR"``) or raise the
context's clear error; :class:`Unlaunched` stands in for a view before launch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .layout import LayoutError, ParallelMode

__all__ = ["LAUNCH_HINT", "VIEW_NAMES", "ModeTable", "ModeView", "NotLaunchedError", "Unlaunched"]

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


@dataclass(frozen=True, slots=True)
class ModeView:
    """This rank's place in one mode, e.g. ``gpc.tensor``.

    ``rank`` is the local rank in the mode, ``size`` the group size, ``ranks`` the ascending
    global ranks of the group, ``group``/``cpu_group`` the process groups (a one-rank group of
    this rank for a mode of size 1, never None),
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
