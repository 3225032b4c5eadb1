"""One job, several layouts: the modules of a job and the ranks each holds; pure and torch-free.

A job that trains several models at once (a vision encoder beside a language model, a draft
model beside its target) gives each *module* its own layout on its own ranks. Two modules either
hold exactly the same ranks (*colocated*) or no rank in common (*disjoint*), and together they
cover the ranks ``0 .. world_size - 1`` with no gap (Megatron-core's rule for its per-module
``HyperCommGrid``\\ s). Each module's :class:`~parallelctx.planning.layout.Layout` lies on its own
ranks (``Layout.offset``), so its groups are in global ranks.

A rank that belongs to several (colocated) modules answers for one of them by default, its
*primary* module: the language module when it has it, else the first in the config's order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .layout import Layout, LayoutError
from .limits import MAX_WORLD_SIZE

__all__ = ["LANGUAGE", "MAX_MODULES", "ModulePlan", "check_spans"]

LANGUAGE = "language"
"""The name Megatron-core gives the language module (``MIMO_LANGUAGE_MODULE_KEY``); the module of
this name is the language module unless another says ``language=True``."""

MAX_MODULES = 10
"""The most modules a job may have: each module's RNG streams take seed slots of their own
(:mod:`parallelctx.runtime.seed`), and ten modules fill the 256 slots a seed has room for."""


def check_spans(spans: Mapping[str, tuple[int, int]], world_size: int | None = None) -> None:
    """Check that the modules' rank spans ``{name: (offset, count)}`` are pairwise identical or
    disjoint and cover ``0 .. N-1`` with no gap (``N``: ``world_size`` when given). Returns None.

    Raises:
        LayoutError: two modules overlap without holding the same ranks, a gap, or a cover that
            is not ``world_size``; the message names the modules and the fix.
    """
    names = list(spans)
    for i, a in enumerate(names):
        oa, na = spans[a]
        for b in names[i + 1 :]:
            ob, nb = spans[b]
            same = (oa, na) == (ob, nb)
            apart = oa + na <= ob or ob + nb <= oa
            if not (same or apart):
                raise LayoutError(
                    f"parallel.modules: {a!r} holds ranks {oa}-{oa + na - 1} and {b!r} ranks "
                    f"{ob}-{ob + nb - 1}; two modules must hold the same ranks (colocated_with=...) "
                    "or no rank in common: change their ranks or offsets"
                )
    covered: set[tuple[int, int]] = set(spans.values())
    end = 0
    for offset, count in sorted(covered):
        if offset != end:
            raise LayoutError(
                f"parallel.modules leave ranks {end}-{offset - 1} to no module; every rank must belong "
                f"to a module: give a module those ranks or move the others (offsets: "
                + ", ".join(f"{n}={o}" for n, (o, _) in spans.items())
                + ")"
            )
        end = offset + count
    if world_size is not None and end != world_size:
        raise LayoutError(
            f"parallel.modules cover ranks 0-{end - 1} ({end} ranks) but world_size={world_size}; "
            f"launch {end} ranks or change the modules' ranks"
        )
    if end > MAX_WORLD_SIZE:
        raise LayoutError(f"parallel.modules cover {end} ranks, past the largest world, {MAX_WORLD_SIZE}")


@dataclass(frozen=True)
class ModulePlan:
    """The modules of one job: each module's layout (on its own global ranks), in the config's
    order, and which one is the language module (None when there is none).

    Raises:
        LayoutError: no module, more than :data:`MAX_MODULES`, a language name that is no
            module, or spans that break :func:`check_spans`.
    """

    layouts: Mapping[str, Layout]
    language: str | None = None

    def __post_init__(self) -> None:
        if not self.layouts:
            raise LayoutError("parallel.modules is empty: name at least one module, or drop the key")
        if len(self.layouts) > MAX_MODULES:
            raise LayoutError(
                f"parallel.modules has {len(self.layouts)} modules; at most {MAX_MODULES} (each module's "
                "RNG streams need seed slots of their own): merge modules that share a layout"
            )
        if self.language is not None and self.language not in self.layouts:
            raise LayoutError(f"language module {self.language!r} is not one of {list(self.layouts)}")
        check_spans({n: (lay.offset, lay.world_size) for n, lay in self.layouts.items()})

    @property
    def world_size(self) -> int:
        """The ranks the modules cover together."""
        return max(lay.offset + lay.world_size for lay in self.layouts.values())

    @property
    def names(self) -> tuple[str, ...]:
        """Every module's name, in the config's order."""
        return tuple(self.layouts)

    def index(self, name: str) -> int:
        """The module's position in the config's order (its seed slots depend on it).

        Raises:
            LayoutError: no module of that name.
        """
        return self.names.index(self._known(name))

    def _known(self, name: str) -> str:
        if name not in self.layouts:
            raise LayoutError(f"no module {name!r}; the modules are {', '.join(map(repr, self.layouts))}")
        return name

    def of_rank(self, rank: int) -> tuple[str, ...]:
        """The modules global ``rank`` belongs to, in the config's order.

        Raises:
            LayoutError: ``rank`` is outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank={rank} is outside [0, world_size={self.world_size})")
        return tuple(n for n, lay in self.layouts.items() if rank in lay.ranks)

    def primary(self, rank: int) -> str:
        """The module ``rank`` answers for by default: the language module when it belongs to
        it, else its first module. Raises LayoutError as :meth:`of_rank`."""
        mine = self.of_rank(rank)
        return self.language if self.language in mine else mine[0]

    def where(self, rank: int) -> str:
        """Return ``rank``'s place in each of its modules as a person reads it
        (``"language: pipeline stage 1, tensor rank 0"``). Raises LayoutError as :meth:`of_rank`."""
        places = ((name, self.layouts[name].where(rank)) for name in self.of_rank(rank))
        return "; ".join(f"{name}: {place}" if place else name for name, place in places)

    def colocated(self) -> bool:
        """True when every module holds the same ranks."""
        spans = {(lay.offset, lay.world_size) for lay in self.layouts.values()}
        return len(spans) == 1

    def __iter__(self) -> Iterator[str]:
        return iter(self.layouts)

    def describe(self) -> str:
        """One line per module: name, ranks and layout."""
        return "\n".join(
            f"{name}{' (language)' if name == self.language else ''}: ranks {lay.offset}-"
            f"{lay.offset + lay.world_size - 1}: {lay.describe()}"
            for name, lay in self.layouts.items()
        )
