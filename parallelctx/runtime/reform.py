"""``gpc.reform()`` before its new launch: the checks, the smaller layout
(:func:`parallelctx.planning.reform.shrink`) and the survivors' agreement: every rank that stays
posts which ranks it excludes on the launch's store and reads what the others posted; all must
name the same ranks. A rank excluded by some ranks and not by others is refused by name on every
rank that sees the difference, at once, and a rank that never posts within the timeout is named
too. :func:`prepare` returns what the facade then launches.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..config import DEFAULT_TIMEOUT, to_timedelta
from ..planning.reform import shrink
from .rendezvous import rank_list, serves_store

__all__ = ["ReformError", "ReformPlan", "Reformed", "agree_exclusion", "prepare"]

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
            raise ReformError(
                f"rank {rank} lost the launch's store while it waited to reform ({exc})"
            ) from exc
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


@dataclass(frozen=True)
class ReformPlan:
    """What ``gpc.reform()`` launches after its teardown: the result for this rank, the smaller
    config (a dict) and the other arguments of ``gpc.launch`` (rank, world size, the store's URL,
    the local rank, the timeout)."""

    result: Reformed
    config: dict[str, Any]
    launch_args: dict[str, Any]


def prepare(launched: Any, meetings: Any, exclude: Sequence[int], timeout: Any = None) -> ReformPlan:
    """Check a reform of ``launched`` (a :class:`~parallelctx.runtime.startup.Launched`) without
    the ranks ``exclude``, plan the smaller layout by the config's ``parallel.reform``, and agree
    with the ranks that stay (:func:`agree_exclusion`) on ``meetings``' store, whose store this
    rank will reach under its new rank.

    Returns:
        A :class:`ReformPlan`.

    Raises:
        RuntimeError: no launch of more than one rank with a default group of its own (a dry run,
            an adopted torch.distributed group), a job with parallel.modules, or rank 0 leaves
            while its process serves the store.
        ValueError: this rank is in ``exclude``; the layout cannot shrink (LayoutError, naming
            what would).
        ReformError: the ranks that stay do not agree, or one did not come within ``timeout``
            (default: twice the launch's ``dist.timeout``, since a rank the abort did not reach
            comes only when its own collective times out; the new launch has the same timeout).
    """
    config, layout, url = launched.config, launched.layout, meetings.url
    if (
        launched.world_size <= 1
        or launched.store is None
        or launched.dry_run is not None
        or None in (url, config, layout)
    ):
        raise RuntimeError(
            "gpc.reform() needs a launch of more than one rank that made its own default group "
            "(not a dry run, not an adopted torch.distributed group)"
        )
    if launched.plan is not None:
        raise RuntimeError(
            "gpc.reform() does not shrink a job with parallel.modules yet (which module loses the "
            "ranks is the job's choice): destroy gpc and launch the smaller job with its own modules"
        )
    rank, gone = launched.rank, sorted({int(r) for r in exclude})
    if rank in gone:
        raise ValueError(
            f"rank {rank} is in reform(exclude={gone}): a rank that is gone does not call reform; "
            "every rank that stays passes the ranks that are gone"
        )
    shrunk = shrink(layout, gone, config.parallel.reform)
    if 0 in shrunk.leaving and serves_store(url):
        raise RuntimeError(
            f"gpc.reform(exclude={gone}): rank 0 leaves with its replica, but its process serves the "
            f"launch's store ({url}); launch under torchrun (its agent serves the store) to lose rank 0's "
            "replica, or restart the job from its checkpoint"
        )
    # A survivor that the abort never reached (gloo's send on a pair the peers' abort did not
    # close) learns of the loss only when its own collective times out, dist.timeout after the
    # others came, and its teardown can wait as long: by default the others wait twice that for
    # it, in the agreement and in the new launch (whose groups then have that timeout too).
    wait = to_timedelta(timeout) if timeout is not None else 2 * (launched.timeout or DEFAULT_TIMEOUT)
    agree_exclusion(meetings.plain(launched.store), rank, gone, shrunk.survivors, wait)
    smaller = config.to_dict()
    smaller["parallel"]["data"] = {"replicate": shrunk.replicate}
    new, size = shrunk.new_rank(rank), len(shrunk.survivors)
    if new is not None:  # the store this process reached, under its new rank (rank 0's server stays)
        meetings.carry(url, rank, launched.world_size, new, size)
    args = dict(
        rank=new,
        world_size=size,
        init_method=url,
        local_rank=launched.local_rank,
        timeout=wait,
    )
    return ReformPlan(Reformed(rank, new, shrunk.leaving, size), smaller, args)
