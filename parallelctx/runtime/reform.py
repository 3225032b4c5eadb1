"""The survivors' agreement before ``gpc.reform()``: every rank that stays posts which ranks it
excludes on the launch's store and reads what the others posted; all must name the same ranks.

A rank excluded by some ranks and not by others is refused by name on every rank that sees the
difference, at once, and a rank that never posts within the timeout is named too. Imports nothing
from parallelctx outside ``runtime.rendezvous``.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .rendezvous import rank_list

__all__ = ["ReformError", "Reformed", "agree_exclusion"]

_POLL_S = 0.02


@dataclass(frozen=True)
class Reformed:
    """What ``gpc.reform()`` did on this rank: its rank before and after (None: it left), the old
    ranks that left (the excluded ones and the rest of their replicas), the new world size."""

    old_rank: int
    rank: int | None
    left: tuple[int, ...]
    world_size: int

    @property
    def stays(self) -> bool:
        """Whether this rank is in the new world."""
        return self.rank is not None


class ReformError(RuntimeError):
    """The surviving ranks do not agree on who is gone, or a rank did not come to reform in time."""


def _differ(mine: tuple[int, ...], seen: dict[int, tuple[int, ...]]) -> str | None:
    """Words for the ranks excluded by some posters and not by others, or None when all agree."""
    if all(excluded == mine for excluded in seen.values()):
        return None
    lines = []
    for r in sorted({x for excluded in seen.values() for x in excluded}):
        by = sorted(p for p, excluded in seen.items() if r in excluded)
        not_by = sorted(p for p, excluded in seen.items() if r not in excluded and p != r)
        if by and not_by:
            lines.append(
                f"rank {r} is excluded by rank{'s' if len(by) > 1 else ''} {rank_list(by)} "
                f"but not by rank{'s' if len(not_by) > 1 else ''} {rank_list(not_by)}"
            )
    return "; ".join(lines) or "the ranks name different ranks as gone"


def agree_exclusion(
    store: Any, rank: int, exclude: Sequence[int], stay: Sequence[int], timeout: timedelta
) -> None:
    """Post ``exclude`` (sorted) as this rank's view of who is gone; on a rank that stays (in
    ``stay``, the ranks of the smaller world by this view), wait, in short slices, until every
    rank of ``stay`` has posted, and compare. A rank that leaves posts and returns.

    Returns:
        None: every kept rank posted the same ranks.

    Raises:
        ReformError: a posted view differs (the ranks excluded by some and not others are named,
            and so is the fix), or a kept rank did not post within ``timeout`` (named: exclude it
            too if it is gone).
    """
    mine = tuple(sorted(set(exclude)))
    kept = list(stay)
    try:
        store.set(f"reform/{rank}", pickle.dumps(mine))
    except Exception as exc:
        raise ReformError(f"rank {rank} could not reach the launch's store to reform ({exc})") from exc
    if rank not in kept:
        return
    deadline = time.monotonic() + timeout.total_seconds()
    seen: dict[int, tuple[int, ...]] = {rank: mine}
    while True:
        try:
            for r in kept:
                if r not in seen and store.check([f"reform/{r}"]):
                    seen[r] = pickle.loads(store.get(f"reform/{r}"))
        except Exception as exc:
            raise ReformError(f"rank {rank} lost the launch's store while it waited to reform ({exc})") from exc
        problem = _differ(mine, seen)
        if problem is not None:
            raise ReformError(
                f"gpc.reform(): the surviving ranks do not agree on who is gone: {problem}; every rank that "
                f"stays must pass the same exclude=[...] (this rank, {rank}, passed {list(mine)})"
            )
        missing = [r for r in kept if r not in seen]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise ReformError(
                f"gpc.reform(): rank{'s' if len(missing) > 1 else ''} {rank_list(missing)} did not come to reform "
                f"within {timeout.total_seconds():g} s; if {'they are' if len(missing) > 1 else 'it is'} gone, "
                f"exclude {'them' if len(missing) > 1 else 'it'} too (exclude={sorted(set(mine) | set(missing))}) "
                "on every rank that stays"
            )
        time.sleep(_POLL_S)

