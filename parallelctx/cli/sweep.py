"""Cross-rank checks of a dry-run sweep (``parallelctx dry-run --ranks ...``); torch-free.

Input: the reports of the swept ranks (:meth:`parallelctx.dryrun.DryRun.report`), by rank.
Each check returns messages that name the ranks involved; an empty list means it passed.
A check only compares ranks that were swept: with ``--ranks sample:N`` a group member that did
not run is not compared.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ..config import Config
from ..planning.layout import Layout
from ..planning.modules import ModulePlan
from .sequences import check_calls

__all__ = [
    "check_all",
    "check_creation_order",
    "check_membership",
    "check_plan",
    "check_same_across",
    "covering_set",
    "parse_ranks",
    "plan_of",
]

Reports = Mapping[int, Mapping[str, Any]]

# The keys of one layout's sizes in the parallel section (``order`` aside): beside
# ``parallel.modules`` they are refused, so a report's section is read without them.
_SIZE_KEYS = ("tensor", "pipeline", "context", "expert", "data", "gtp_remat")


def plan_of(parallel: Mapping[str, Any], world_size: int) -> Layout | ModulePlan:
    """Return the layout a report's ``parallel`` section makes on ``world_size`` ranks: a
    :class:`~parallelctx.planning.layout.Layout`, or with ``modules`` the
    :class:`~parallelctx.planning.modules.ModulePlan` (the sizes beside ``modules``, which an
    older report lists at their defaults, are left out).

    Raises:
        ValueError: the section is not a valid ``parallel`` section (ConfigError).
        LayoutError: its sizes or modules do not fit ``world_size``.
    """
    section = dict(parallel)
    if section.get("modules"):
        section = {key: value for key, value in section.items() if key not in _SIZE_KEYS}
    par = Config({"parallel": section}).parallel
    return par.module_plan(world_size) if par.modules else par.to_layout(world_size)


def covering_set(layout: Layout | ModulePlan) -> list[int]:
    """Return the covering set of ``layout``
    (:func:`parallelctx.planning.covering.covering_ranks`): with modules, every module's covering
    set on its own ranks, together; ascending global ranks. Raises nothing."""
    from ..planning.covering import covering_ranks

    if isinstance(layout, Layout):
        return covering_ranks(layout)
    return sorted({rank for lay in layout.layouts.values() for rank in covering_ranks(lay)})


def parse_ranks(
    spec: str, world_size: int, seed: int = 0, layout: Layout | ModulePlan | None = None
) -> list[int]:
    """Return the ranks ``--ranks`` names: ``all``, a list ``0,17,9000``, ``sample:N`` (rank 0,
    the last rank and N-2 others drawn with ``seed``), or ``cover`` (``layout``'s covering set,
    :func:`covering_set`: every coordinate of every axis, of every module with
    ``parallel.modules``, rank 0 and the last rank), ascending.

    Raises:
        ValueError: a malformed spec, a rank outside ``[0, world_size)``, or ``cover`` without a
            layout or with one of another world size (the message names it).
    """
    spec = spec.strip()
    if spec == "all":
        return list(range(world_size))
    if spec == "cover":
        if layout is None:
            raise ValueError("--ranks cover needs the layout (the ranks cover its axes); pass layout=")
        if layout.world_size != world_size:
            raise ValueError(
                f"--ranks cover: the layout has {layout.world_size} ranks, not world_size={world_size}; "
                "plan the layout for the world size swept"
            )
        return covering_set(layout)
    if spec.startswith("sample:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--ranks {spec!r}: sample:N needs an integer N, e.g. sample:64") from None
        if n < 1:
            raise ValueError(f"--ranks {spec!r}: N must be at least 1")
        if n >= world_size:
            return list(range(world_size))
        picked = {0, world_size - 1} if n >= 2 else {0}
        rng = random.Random(seed)
        while len(picked) < n:
            picked.add(rng.randrange(world_size))
        return sorted(picked)
    ranks: set[int] = set()
    for part in spec.split(","):
        try:
            r = int(part)
        except ValueError:
            raise ValueError(
                f"--ranks {spec!r}: {part!r} is not a rank; use all, cover, 0,17,9000 or sample:N"
            ) from None
        if not 0 <= r < world_size:
            raise ValueError(f"--ranks: rank {r} is outside [0, world_size={world_size})")
        ranks.add(r)
    return sorted(ranks)


def _short(ranks: list[int] | None, limit: int = 12) -> str:
    if ranks is None:
        return "the whole world"
    if len(ranks) <= limit:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:limit]))}, ... ({len(ranks)} ranks)]"


def _plan_differences(rank: int, layout: Layout, got: Mapping[str, Any], whose: str) -> list[str]:
    """``rank``'s groups ``got`` (mode -> members) against ``layout``'s for it; ``whose`` names
    the module (``"vision "``) or is empty."""
    want = {m.value: layout.group_of(m, rank) for m in layout.modes() if m.value != "global"}
    want = {m: g for m, g in want.items() if g}
    return [
        f"rank {rank}: its {whose}{mode} group is {_short(got.get(mode))} but plan says "
        f"{_short(want.get(mode)) if mode in want else 'none'}"
        for mode in sorted(set(want) | set(got))
        if want.get(mode) != got.get(mode)
    ]


def _span(layout: Layout) -> str:
    return f"{layout.offset}-{layout.offset + layout.world_size - 1}"


def _module_differences(rank: int, rep: Mapping[str, Any], plan: ModulePlan) -> list[str]:
    """A report of a job with ``parallel.modules`` against the plan: the rank's modules, the one
    it answers for, and each module's ranks and groups."""
    mine = plan.of_rank(rank)
    got = rep.get("modules")
    if not isinstance(got, Mapping):
        return [
            f"rank {rank}: its report holds no modules, but plan says it belongs to {', '.join(mine)}; "
            "the dry run recorded one layout for a job of several"
        ]
    out: list[str] = []
    if tuple(got) != mine:
        out.append(
            f"rank {rank}: its report holds modules {', '.join(got) or 'none'} but plan says "
            f"{', '.join(mine)} (in the config's order)"
        )
    primary = plan.primary(rank)
    if rep.get("module") != primary:
        out.append(f"rank {rank}: gpc answers for module {rep.get('module')!r} but plan says {primary!r}")
    else:  # the top-level groups are the primary module's
        out += _plan_differences(rank, plan.layouts[primary], rep.get("groups", {}), "")
    for name in mine:
        if name not in got:
            continue
        layout = plan.layouts[name]
        ranks = got[name].get("ranks")
        if ranks != [[layout.offset, layout.offset + layout.world_size - 1]]:
            shown = ", ".join(f"{a}-{b}" for a, b in ranks) if isinstance(ranks, list) else repr(ranks)
            out.append(f"rank {rank}: module {name}'s ranks are {shown} but plan says {_span(layout)}")
        out += _plan_differences(rank, layout, got[name].get("groups", {}), f"{name} ")
    return out


def check_plan(reports: Reports) -> list[str]:
    """Every rank's groups equal ``plan``'s for that rank (the layout rebuilt from the
    report's ``parallel`` section and world size, :func:`plan_of`): a mode missing or extra, or
    other members. With ``parallel.modules``, per module: the rank holds the modules the plan
    gives it, ``gpc`` answers for its primary one, and each module's ranks and groups are the
    plan's."""
    out: list[str] = []
    layouts: dict[str, Layout | ModulePlan] = {}
    for rank, rep in sorted(reports.items()):
        if "parallel" not in rep:
            continue
        key = repr((rep["parallel"], rep["world_size"]))
        if key not in layouts:
            layouts[key] = plan_of(rep["parallel"], rep["world_size"])
        layout = layouts[key]
        if isinstance(layout, ModulePlan):
            out += _module_differences(rank, rep, layout)
        else:
            out += _plan_differences(rank, layout, rep.get("groups", {}), "")
    return out


def _listed_alike(reports: Reports, lists: Mapping[int, Mapping[str, list[int]]], whose: str) -> list[str]:
    """Each group listed in ``lists`` (rank -> {mode: members}) lists its rank and is listed the
    same by every swept member (named in ascending rank, mode and member order). Equal lists
    are compared once, so a group of thousands of swept members costs its size, not its square."""
    found: list[tuple[int, str, int, str]] = []
    by_mode: dict[str, dict[int, tuple[int, ...]]] = {}
    canonical: dict[tuple[int, ...], tuple[int, ...]] = {}
    for rank, groups in lists.items():
        for mode, members in groups.items():
            key = tuple(members)
            by_mode.setdefault(mode, {})[rank] = canonical.setdefault(key, key)
    for mode, listed in by_mode.items():
        listers: dict[tuple[int, ...], list[int]] = {}
        for rank, key in listed.items():
            listers.setdefault(key, []).append(rank)
        for key, ranks in listers.items():
            held = set(key)
            inside = []
            for rank in ranks:
                if rank in held:
                    inside.append(rank)
                else:
                    text = (
                        f"rank {rank}: its {whose}{mode} group {_short(list(key))} does not list rank {rank}"
                    )
                    found.append((rank, mode, -1, text))
            for index, peer in enumerate(key):
                if peer not in reports or listed.get(peer) is key:
                    continue
                theirs = listed.get(peer)
                for rank in inside:
                    if rank < peer:
                        text = (
                            f"{whose}{mode} group: rank {rank} lists {_short(list(key))} but rank {peer} "
                            f"lists {_short(list(theirs)) if theirs is not None else 'no such group'}"
                        )
                        found.append((rank, mode, index, text))
    return [text for *_, text in sorted(found)]


def check_membership(reports: Reports) -> list[str]:
    """Each group's member list is the same on all its (swept) members, and a rank is in the
    group it lists; with ``parallel.modules`` also each module's groups, module by module."""
    out = _listed_alike(reports, {r: rep.get("groups", {}) for r, rep in reports.items()}, "")
    names: dict[str, None] = {}
    for rep in reports.values():
        names.update(dict.fromkeys(rep.get("modules") or {}))
    for name in names:
        lists = {
            r: rep["modules"][name].get("groups", {})
            for r, rep in reports.items()
            if name in (rep.get("modules") or {})
        }
        out += _listed_alike(reports, lists, f"{name} ")
    return out


def _world_calls(rep: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [c for c in rep.get("new_groups", []) if not c.get("local")]


def check_creation_order(reports: Reports) -> list[str]:
    """Group creations torch needs in the same order:

    * ``new_group`` without local synchronization is a call of every rank of the world, in the
      same sequence: a rank whose sequence differs from the most common one is named with the
      group it skipped (or made in addition) and where the others called it;
    * a group made with local synchronization is a call of each of its members, and torch names
      it by its members and the number of process groups the process held before (the report's
      ``held``): a swept member that did not make it, or made it after another number of groups,
      is named.
    """
    out: list[str] = []
    seqs = {r: [(tuple(c["ranks"]) if c["ranks"] is not None else None) for c in _world_calls(rep)]
            for r, rep in reports.items()}  # fmt: skip
    if seqs:
        common, _ = Counter(tuple(s) for s in seqs.values()).most_common(1)[0]
        ref_rank = min(r for r, s in seqs.items() if tuple(s) == common)
        ref_calls = _world_calls(reports[ref_rank])
        for rank in sorted(seqs):
            seq = seqs[rank]
            if tuple(seq) == common:
                continue
            out.append(_sequence_difference(rank, seq, list(common), ref_calls, _world_calls(reports[rank])))
    made: dict[tuple[int, ...], dict[int, int]] = {}
    where: dict[tuple[int, ...], str] = {}
    for rank, rep in reports.items():
        for index, call in enumerate(rep.get("new_groups", [])):
            if call.get("local") and call.get("ranks") is not None:
                key = tuple(call["ranks"])
                held = call.get("held", -1)
                made.setdefault(key, {}).setdefault(rank, held if held >= 0 else index)
                where.setdefault(key, call.get("where", "?"))
    for key, by_rank in sorted(made.items()):
        swept = [r for r in key if r in reports]
        missing = [r for r in swept if r not in by_rank]
        if missing:
            out.append(
                f"ranks {_short(missing)} are members of new_group({_short(list(key))}, "
                f"use_local_synchronization=True), made by ranks {_short(sorted(by_rank))} at "
                f"{where[key]}, but did not make it: its members wait for them forever"
            )
        positions = Counter(by_rank.values())
        if len(positions) > 1:
            usual = positions.most_common(1)[0][0]
            odd = sorted(r for r, i in by_rank.items() if i != usual)
            out.append(
                f"new_group({_short(list(key))}, use_local_synchronization=True) at {where[key]} comes "
                f"after {usual} process groups on most of its members but not on ranks {_short(odd)} "
                f"(after {', '.join(str(by_rank[r]) for r in odd[:5])}); torch names the group by "
                "its members and the number of groups made before it, so its members will not meet"
            )
    return out


def _sequence_difference(
    rank: int,
    seq: list[Any],
    common: list[Any],
    ref_calls: list[dict[str, Any]],
    own_calls: list[dict[str, Any]],
) -> str:
    """Say how ``rank``'s world-wide ``new_group`` sequence differs from the common one."""

    def shown(members: Any) -> str:
        return "new_group()" if members is None else f"new_group({_short(list(members))})"

    first = next((i for i, (a, b) in enumerate(zip(seq, common)) if a != b), min(len(seq), len(common)))
    if len(seq) < len(common) and seq[first:] == common[first + 1 :]:
        return (
            f"rank {rank} skipped {shown(common[first])}, call {first + 1} of the "
            f"{len(common)} world-wide new_group calls every other rank made (at "
            f"{ref_calls[first].get('where', '?')}): every rank of the world must make it, so "
            "the others wait for rank " + str(rank) + " forever"
        )
    if len(seq) > len(common) and seq[first + 1 :] == common[first:]:
        return (
            f"rank {rank} made {shown(seq[first])} at {own_calls[first].get('where', '?')} "
            f"(its world-wide new_group call {first + 1}), which the other ranks did not make"
        )
    got = shown(seq[first]) if first < len(seq) else "nothing"
    want = shown(common[first]) if first < len(common) else "nothing"
    return (
        f"rank {rank}: world-wide new_group call {first + 1} is {got}, but on the other ranks "
        f"{want} (at {ref_calls[first].get('where', '?') if first < len(ref_calls) else '?'}): "
        "every rank of the world must make the same groups in the same order"
    )


def check_same_across(reports: Reports) -> list[str]:
    """Values a script declared ``same_across=MODE`` (:func:`parallelctx.dryrun.record`) agree
    on every swept rank of each group of that mode (``MODULE:MODE``: of that module's)."""
    out: list[str] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for _, rep in sorted(reports.items()):
        for key, mode in sorted(rep.get("same_across", {}).items()):
            module, _, bare = mode.rpartition(":")
            groups = (
                rep.get("modules", {}).get(module, {}).get("groups", {}) if module else rep.get("groups", {})
            )
            members = groups.get(bare)
            if members is None:
                continue
            ident = (key, tuple(members))
            if ident in seen:
                continue
            seen.add(ident)
            swept = [r for r in members if r in reports]
            values = {r: reports[r].get("values", {}).get(key, "<not recorded>") for r in swept}
            distinct: dict[str, list[int]] = {}
            for r, v in values.items():
                distinct.setdefault(repr(v), []).append(r)
            if len(distinct) > 1:
                parts = "; ".join(f"ranks {_short(rs)}: {v[:120]}" for v, rs in distinct.items())
                out.append(f"{key!r} must be the same across the {mode} group {_short(members)}, but {parts}")
    return out


def check_all(reports: Reports) -> list[str]:
    """Run every check; return all messages (empty: the sweep passed)."""
    return [
        *check_plan(reports),
        *check_membership(reports),
        *check_creation_order(reports),
        *check_same_across(reports),
        *check_calls(reports),
    ]
