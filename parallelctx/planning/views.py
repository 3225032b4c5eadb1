"""What the context answers queries from: per-mode tables and views, and the not-launched
error.

:class:`ModeView` is one rank's place in one mode (``gpc.tensor``); :class:`ModeTable` is a
dict keyed by mode whose misses resolve mode aliases (``"tp"``, ``"TENSOR"``) or raise the
context's clear error; :class:`Unlaunched` stands in for a view before launch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, overload

from .layout import Layout, LayoutError, ParallelMode

__all__ = [
    "LAUNCH_HINT",
    "VIEW_NAMES",
    "Adopted",
    "Answers",
    "ModeTable",
    "ModeView",
    "ModeViews",
    "NotLaunchedError",
    "Ranks",
    "Unlaunched",
    "not_launched",
]

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


def not_launched(what: str) -> NotLaunchedError:
    """Return the error for ``what`` (e.g. ``"gpc.layout"``) asked before it was made."""
    return NotLaunchedError(f"{what} is not available yet: {LAUNCH_HINT}")


class Adopted:
    """A read-only attribute of a context, answered from the field ``field`` of the value the
    context adopted (its ``launched``), or from ``derive(field value, launched value)``; raises
    :class:`NotLaunchedError` while the field is not made yet (None, or an empty tuple)."""

    def __init__(self, field: str, doc: str, derive: Callable[[Any, Any], Any] | None = None) -> None:
        self.field, self.__doc__, self.derive = field, doc, derive

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, ctx: Any, owner: type | None = None) -> Any:
        if ctx is None:
            return self
        launched = ctx.launched
        value = getattr(launched, self.field)
        if value is None or (isinstance(value, tuple) and not value):
            raise not_launched(f"gpc.{self.name}")
        return value if self.derive is None else self.derive(value, launched)


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

    @classmethod
    def of(cls, mode: ParallelMode, rank: int, ranks: Sequence[int], group: Any, cpu_group: Any) -> ModeView:
        """Return global rank ``rank``'s view of its group of ``mode`` (ascending ``ranks``).

        Raises:
            ValueError: ``rank`` is not in ``ranks``.
        """
        local, size = ranks.index(rank), len(ranks)
        return cls(
            mode, local, size, ranks, group, cpu_group, ranks[(local + 1) % size], ranks[(local - 1) % size]
        )

    @property
    def is_first(self) -> bool:
        """True on the group's first rank."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """True on the group's last rank."""
        return self.rank == self.size - 1


class _Retired(ModeView):
    """A :class:`ModeView` that no longer says what is (:meth:`Answers.fill`): every field
    raises instead of answering for a world that is gone, and it holds no group."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<a gpc view of a launch destroyed since>"


def _gone(field: str) -> property:
    def read(view: ModeView) -> Any:
        name = VIEW_NAMES[view.mode]  # the mode stays readable
        raise NotLaunchedError(
            f"{field} of a gpc.{name} kept from a launch destroyed since (gpc.destroy(), reform); "
            f"read gpc.{name} again after the next launch instead of keeping the view"
        )

    return property(read)


# every field but the mode, and the properties read from them
for _field in [f.name for f in fields(ModeView) if f.name != "mode"] + ["is_first", "is_last"]:
    setattr(_Retired, _field, _gone(_field))


def _retire(view: ModeView) -> None:
    """Make ``view`` a :class:`_Retired` (every field raises from now on), then let go of its
    groups (the slots under the properties that raise)."""
    object.__setattr__(view, "__class__", _Retired)
    for field in ("group", "cpu_group"):
        ModeView.__dict__[field].__set__(view, None)


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
        raise not_launched(f"gpc.{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<gpc.{self._name}: not launched>"


class ModeViews:
    """The readable views a launched context has, one per mode (``gpc.tensor``, ``gpc.world``;
    declared here for type checkers; :data:`VIEW_NAMES` maps each mode to its name)."""

    world: ModeView
    tensor: ModeView
    pipeline: ModeView
    data: ModeView
    context: ModeView
    model: ModeView
    data_context: ModeView
    embedding: ModeView
    expert: ModeView
    expert_tensor: ModeView
    expert_data: ModeView
    expert_tensor_and_expert: ModeView
    expert_model: ModeView
    data_shard: ModeView
    data_replicate: ModeView
    data_shard_context: ModeView
    expert_data_shard: ModeView
    expert_data_replicate: ModeView
    gtp_remat: ModeView
    expert_gtp_remat: ModeView


class _Why:
    """Why a query found no answer (see :meth:`Answers.miss`). It holds the views, never the
    tables that call it, so no reference cycle keeps an old launch's groups alive after
    ``destroy()`` (a process group closes its sockets only when the last reference goes)."""

    def __init__(self) -> None:
        self.views: dict[ParallelMode, ModeView] = {}
        self.rank = -1
        self.layout: Layout | None = None
        self.absent: str | None = None

    def __call__(self, mode: Any, what: str) -> Exception:
        if self.absent is not None:
            return LayoutError(f"{what}: {self.absent}")
        if not self.views and self.layout is None:
            return not_launched(what)
        parsed = ParallelMode.parse(mode)  # raises for an unknown mode
        if self.layout is not None and parsed not in self.views and self.views:
            return NotLaunchedError(
                f"global rank {self.rank} belongs to no {parsed.value} group "
                f"(only the first and last of {self.layout.pipeline} pipeline stages do)"
            )
        return not_launched(what)


class Answers:
    """What a context answers its per-mode queries from: one :class:`ModeTable` per query
    (local rank, size, group, CPU group) and the views, filled at once by :meth:`fill`.

    :attr:`queries` are the four hottest queries as closures over their tables (one Python frame
    and one dict lookup a call, no bound method, no attribute lookup); a miss resolves an alias
    or raises what :meth:`miss` says."""

    def __init__(self) -> None:
        why = self._why = _Why()
        self.local_ranks = ModeTable(lambda m: why(m, "get_local_rank()"))
        self.world_sizes = ModeTable(lambda m: why(m, "get_world_size()"))
        self.groups = ModeTable(lambda m: why(m, "get_group()"))
        self.cpu_groups = ModeTable(lambda m: why(m, "get_cpu_group()"))
        self.views = why.views
        local_ranks, world_sizes, groups, cpu_groups = (
            self.local_ranks,
            self.world_sizes,
            self.groups,
            self.cpu_groups,
        )

        def get_local_rank(mode: ParallelMode | str) -> int:
            return local_ranks[mode]  # type: ignore[no-any-return,unused-ignore]

        def get_world_size(mode: ParallelMode | str) -> int:
            return world_sizes[mode]  # type: ignore[no-any-return,unused-ignore]

        def get_group(mode: ParallelMode | str) -> Any:
            return groups[mode]

        def get_cpu_group(mode: ParallelMode | str) -> Any:
            return cpu_groups[mode]

        self.queries: tuple[Callable[[Any], Any], ...] = (
            get_local_rank,
            get_world_size,
            get_group,
            get_cpu_group,
        )

    def bind(self, target: Any, documented: type) -> None:
        """Set :attr:`queries` on ``target`` under their names, with the docstrings, qualified
        names and module of ``documented``'s methods of those names; returns None. Bound once per
        context: every launch refills the same tables, so a query captured in model code
        (``get_group = gpc.get_group``) answers for the launch of the moment, never for a
        destroyed one (whose groups it would also keep alive)."""
        for fast in self.queries:
            method = getattr(documented, fast.__name__)
            for attr in ("__doc__", "__qualname__", "__module__"):
                setattr(fast, attr, getattr(method, attr))
            setattr(target, fast.__name__, fast)

    def fill(
        self,
        rank: int,
        world_size: int,
        groups: Mapping[ParallelMode, Any],
        layout: Layout | None,
        absent: str | None = None,
    ) -> None:
        """Answer from ``groups`` (mode -> an object with ``ranks``, ``group``, ``cpu_group``)
        for global ``rank`` of ``world_size`` (-1, 0: not launched) under ``layout``, replacing
        every earlier answer in place: a query from another thread meanwhile finds the old answer
        or the new one, never none. A view handed out before is kept while it says the same (a
        step such as ``set_seed`` changes no group); one that no longer does (destroy, a
        relaunch) is retired: it raises on use and holds no group, so a view model code kept
        (``tp = gpc.tensor``) never answers for a launch that is gone. ``absent``: why a
        launched rank has no answers here (a module of the job it is not in), raised as a
        LayoutError by every query. Returns None."""
        new: tuple[dict[Any, Any], ...] = ({}, {}, {}, {}, {})
        local_ranks, world_sizes, by_mode, cpu_by_mode, views = new
        if rank >= 0:
            local_ranks[ParallelMode.GLOBAL] = rank
            world_sizes[ParallelMode.GLOBAL] = world_size
        for mode, g in groups.items():
            view = ModeView.of(mode, rank, g.ranks, g.group, g.cpu_group)
            kept = self.views.get(mode)
            views[mode] = kept if kept is not None and kept == view else view
            local_ranks[mode], world_sizes[mode] = view.rank, view.size
            by_mode[mode], cpu_by_mode[mode] = g.group, g.cpu_group
        gone = [view for mode, view in self.views.items() if views.get(mode) is not view]
        self._why.rank, self._why.layout, self._why.absent = rank, layout, absent
        tables = (self.local_ranks, self.world_sizes, self.groups, self.cpu_groups, self.views)
        for table, entries in zip(tables, new, strict=True):
            table.update(entries)
            for key in [key for key in table if key not in entries]:
                del table[key]
        for view in gone:
            _retire(view)

    def miss(self, mode: Any, what: str) -> Exception:
        """Return the error for asking ``what`` of ``mode`` where there is no answer: not
        launched, or a mode this rank has no group of (EMBEDDING on a middle pipeline stage).

        Raises:
            LayoutError: ``mode`` names no mode.
        """
        return self._why(mode, what)

    def view(self, mode: ParallelMode | str, what: str) -> ModeView:
        """Return this rank's view of ``mode`` (any name of it).

        Raises:
            NotLaunchedError, LayoutError: as :meth:`miss` returns them.
        """
        try:
            return self.views[mode]  # type: ignore[index]  # a plain name finds its mode: equal hashes
        except KeyError:
            pass
        try:  # an alias or another case ("tp", "TENSOR")
            return self.views[ParallelMode.parse(mode)]
        except (KeyError, LayoutError):
            raise self.miss(mode, what) from None
