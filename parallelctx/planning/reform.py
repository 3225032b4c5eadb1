"""The layout after ranks are lost: which ranks leave with them, how the survivors are numbered,
and the sizes of the smaller world (``gpc.reform``, docs/reliability.md). Torch-free.

The rule (``parallel.reform``) names the axis that shrinks:

* ``"data"``: every data-parallel replica (all ranks of one data coordinate: its tensor, pipeline
  and context ranks) that holds an excluded rank leaves whole; the data size drops by the number
  of such replicas.
* ``"replicate"``: the same on HSDP's replicate axis (``data.replicate``): every replicate
  slice that holds an excluded rank leaves; the shard size stays.
* ``"off"``: the job does not shrink; every reform is refused.

The survivors keep their order: new rank = index among the survivors in ascending old rank.
Since whole hyperplanes of one axis leave, every survivor keeps its tensor, pipeline and context
coordinates, and its data (replicate) coordinate is compacted, in any order string: the new ranks
are exactly a fresh launch of the smaller layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from .layout import Layout, LayoutError

__all__ = ["REFORM_RULES", "Shrunk", "shrink"]

REFORM_RULES = ("data", "replicate", "off")
"""The values ``parallel.reform`` takes."""


@dataclass(frozen=True)
class Shrunk:
    """The world after a reform: the old ranks that leave (the excluded ones and the rest of
    their replicas), the survivors in new rank order (old ranks), the new data and replicate
    sizes, and the new layout."""

    leaving: tuple[int, ...]
    survivors: tuple[int, ...]
    data: int
    replicate: int
    layout: Layout

    def new_rank(self, old: int) -> int | None:
        """Return the new rank of old rank ``old``, None when it leaves."""
        try:
            return self.survivors.index(old)
        except ValueError:
            return None


def shrink(layout: Layout, exclude: Iterable[int], rule: str = "data") -> Shrunk:
    """Plan the smaller world once the ranks ``exclude`` of ``layout`` are gone, by ``rule``.

    Returns:
        A :class:`Shrunk`.

    Raises:
        LayoutError: ``exclude`` is empty or names a rank outside the world, ``rule`` is
            ``"off"`` or unknown, no replica would survive, or the smaller layout is refused
            (e.g. an expert size that no longer divides it); the message names the values and
            says what would shrink.
    """
    gone = sorted(set(exclude))
    world = layout.world_size
    if not gone:
        raise LayoutError("reform(exclude=[]) names no rank: pass the ranks that are gone")
    bad = [r for r in gone if not 0 <= r < world]
    if bad:
        raise LayoutError(f"reform(exclude={gone}): rank {bad[0]} is outside the world of {world} ranks")
    if rule not in REFORM_RULES:
        raise LayoutError(f"parallel.reform={rule!r} is no rule: take one of {', '.join(REFORM_RULES)}")
    if rule == "off":
        raise LayoutError(
            f"parallel.reform='off': this job does not shrink, so losing rank{'s' if len(gone) > 1 else ''} "
            f"{', '.join(map(str, gone))} ends it; set parallel.reform='data' (or 'replicate' for HSDP) "
            "to go on without their replicas"
        )
    shard = layout.shard
    if rule == "data":
        index, count = (lambda r: layout.coords(r)["dp"]), layout.data
    else:
        index, count = (lambda r: layout.coords(r)["dp"] // shard), layout.replicate
    lost = {index(r) for r in gone}
    axis = "data" if rule == "data" else "data.replicate"
    if len(lost) >= count:
        raise LayoutError(
            f"reform(exclude={gone}) with parallel.reform={rule!r}: the excluded ranks hold "
            f"{len(lost)} of the {count} {axis} replicas, so none survives; nothing can go on "
            "in-process (restart the job from its checkpoint)"
        )
    leaving = tuple(r for r in range(world) if index(r) in lost)
    survivors = tuple(r for r in range(world) if index(r) not in lost)
    replicate = layout.replicate if rule == "data" else layout.replicate - len(lost)
    data = layout.data - len(lost) if rule == "data" else replicate * shard
    try:
        smaller = dataclasses.replace(layout, world_size=len(survivors), replicate=replicate)
    except LayoutError as exc:
        other = "parallel.reform='replicate' may fit, or " if rule == "data" and layout.replicate > 1 else ""
        raise LayoutError(
            f"reform(exclude={gone}) with parallel.reform={rule!r} would leave {axis}="
            f"{replicate if rule == 'replicate' else data} on {len(survivors)} ranks, which the layout "
            f"refuses ({exc}); {other}restart the job from its checkpoint"
        ) from None
    return Shrunk(leaving, survivors, data, replicate, smaller)
