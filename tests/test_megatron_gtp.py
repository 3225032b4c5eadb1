"""gpc's ``gtp_remat`` axes against megatron-core 0.19's own ``RankGenerator``.

For every point of a grid (dense and expert sizes 1, 2 and 4, ``gtp_remat`` and
``expert_gtp_remat`` 1, 2 and 4, the order strings of tests/test_megatron_parity.py and orders
that name ``gtp_remat``), the groups Megatron's ``initialize_model_parallel`` would build are
taken from the installed release's ``RankGenerator`` with the order its own
``_inject_gtp_remat_axis`` gives each grid, and compared with :func:`parallelctx.plan`; the points
Megatron refuses must be refused with a :class:`LayoutError` naming the values.

Needs megatron-core 0.19 or later (``make test-megatron-next``); under 0.16.1, which has no
``gtp_remat`` axis, the module is skipped with that reason.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections import Counter
from collections.abc import Iterator

import pytest
from megatron.core import parallel_state as ps

if "gtp_remat" not in inspect.signature(ps.RankGenerator).parameters:
    pytest.skip(
        "megatron-core before 0.19 has no gtp_remat axis; run `make test-megatron-next`",
        allow_module_level=True,
    )

from parallelctx import LayoutError, ParallelMode, plan

DENSE, EXPERT = "dense", "expert"
# parallelctx mode -> (which generator, the token 0.19's initialize_model_parallel passes).
TOKENS: dict[ParallelMode, tuple[str, str]] = {
    ParallelMode.TENSOR: (DENSE, "tp"),
    ParallelMode.PIPELINE: (DENSE, "pp"),
    ParallelMode.DATA: (DENSE, "dp"),
    ParallelMode.CONTEXT: (DENSE, "cp"),
    ParallelMode.DATA_CONTEXT: (DENSE, "dp-cp"),
    ParallelMode.MODEL: (DENSE, "tp-gtp_remat-pp"),
    ParallelMode.GTP_REMAT: (DENSE, "gtp_remat"),
    ParallelMode.EXPERT: (EXPERT, "ep"),
    ParallelMode.EXPERT_TENSOR: (EXPERT, "tp"),
    ParallelMode.EXPERT_DATA: (EXPERT, "dp"),
    ParallelMode.EXPERT_TENSOR_AND_EXPERT: (EXPERT, "tp-ep"),
    ParallelMode.EXPERT_MODEL: (EXPERT, "tp-ep-pp"),
    ParallelMode.EXPERT_GTP_REMAT: (EXPERT, "gtp_remat"),
}
ORDERS = (
    "tp-cp-ep-dp-pp",
    "tp-cp-ep-pp-dp",
    "pp-tp-cp-ep-dp",
    "tp-pp-cp-ep-dp",
    "dp-tp-cp-ep-pp",
    "ep-tp-cp-dp-pp",
    "cp-tp-ep-dp-pp",
    "tp-pp-dp",
    "tp-cp-dp-pp",
    "cp-ep-dp-pp",
    # gtp_remat named: both grids take it where it is named
    "gtp_remat-tp-cp-ep-dp-pp",
    "tp-cp-gtp_remat-ep-dp-pp",
    "tp-cp-ep-dp-gtp_remat-pp",
    "tp-cp-ep-dp-pp-gtp_remat",
)
SIZES = (1, 2, 4)
GTP_SIZES = (1, 2, 4)
WORLDS = (8, 16, 32)


@functools.cache
def _ranks(tp: int, ep: int, dp: int, pp: int, cp: int, order: str, gtp: int, token: str) -> list[list[int]]:
    gen = ps.RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order, rank_offset=0, gtp_remat=gtp)
    return sorted(gen.get_ranks(token))


def megatron(world: int, tp: int, pp: int, cp: int, ep: int, etp: int, gtp: int, egtp: int, order: str):
    """0.19's rules in its order: (groups by mode, None) or (None, the rule it breaks)."""
    model = tp * pp * cp * gtp
    if world % model:
        return None, "divisible"
    dp = world // model
    dense_order = ps._inject_gtp_remat_axis(order, after="tp")
    try:
        ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=dense_order, gtp_remat=gtp)
    except RuntimeError:
        return None, "order"
    expert_model = etp * ep * pp * egtp
    if world % expert_model:
        return None, "expert_divisible"
    edp = world // expert_model
    expert_order = ps._inject_gtp_remat_axis(order, after="ep")
    try:
        ps.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=expert_order, gtp_remat=egtp)
    except RuntimeError:
        return None, "order"
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        return None, "pp_last"
    args = {DENSE: (tp, 1, dp, pp, cp, dense_order, gtp), EXPERT: (etp, ep, edp, pp, 1, expert_order, egtp)}
    if "tp" not in order.split("-"):
        # 0.19's RankGenerator finds "tp" inside "gtp_remat" and does not append it, so
        # get_ranks("tp") raises ValueError: Megatron cannot build these (gpc can; not compared).
        with pytest.raises(ValueError, match="'tp' is not in list"):
            _ranks(*args[DENSE], "tp")
        return None, "megatron_crash"
    if _ranks(*args[DENSE], "pp") != _ranks(*args[EXPERT], "pp"):
        return None, "pp_groups"
    return {mode: _ranks(*args[kind], token) for mode, (kind, token) in TOKENS.items()}, None


def points() -> Iterator[tuple[int, ...]]:
    for world, order in itertools.product(WORLDS, ORDERS):
        for tp, pp, cp, ep, gtp, egtp in itertools.product(SIZES, SIZES, SIZES, SIZES, GTP_SIZES, GTP_SIZES):
            for etp in sorted({1, tp}):
                yield world, tp, pp, cp, ep, etp, gtp, egtp, order


def test_gtp_remat_layouts_equal_rank_generator_on_the_grid() -> None:
    counts: Counter[str | None] = Counter()
    diffs: list[str] = []
    for world, tp, pp, cp, ep, etp, gtp, egtp, order in points():
        groups, rejected = megatron(world, tp, pp, cp, ep, etp, gtp, egtp, order)
        point = f"world={world} tp={tp} pp={pp} cp={cp} ep={ep} etp={etp} gtp={gtp} egtp={egtp} {order}"
        try:
            layout = plan(
                world,
                tensor=tp,
                pipeline=pp,
                context=cp,
                expert=ep,
                expert_tensor=etp,
                order=order,
                gtp_remat=gtp,
                expert_gtp_remat=egtp,
            )
        except LayoutError as exc:
            counts[rejected] += 1
            if rejected == "megatron_crash":
                continue
            if rejected is None:
                diffs.append(f"{point}: Megatron accepts, parallelctx refuses: {exc}")
            elif rejected == "divisible" and str(tp * pp * cp * gtp) not in str(exc):
                diffs.append(f"{point}: message {exc} does not name {tp * pp * cp * gtp}")
            continue
        counts[rejected] += 1
        if rejected == "megatron_crash":
            continue
        if groups is None:
            diffs.append(f"{point}: Megatron refuses ({rejected}), parallelctx accepts")
            continue
        for mode, theirs in groups.items():
            if layout.groups(mode) != theirs:
                diffs.append(f"{point} {mode.value}: Megatron {theirs} != parallelctx {layout.groups(mode)}")
        if len(diffs) > 20:
            break
    assert not diffs, "\n".join(diffs[:20])
    # The grid must exercise both outcomes, and gtp_remat > 1 on compared points.
    print(dict(counts))
    assert counts[None] > 1000 and counts["divisible"] > 1000 and counts["expert_divisible"] > 100, counts


def test_gtp_remat_group_of_every_rank() -> None:
    # group_of (what gpc's launch uses) agrees with groups() for the GTP modes, MODEL and DATA.
    checked = 0
    for gtp, egtp, order in itertools.product((2, 4), (1, 2), ORDERS):
        try:
            layout = plan(16, tensor=2, expert=2, gtp_remat=gtp, expert_gtp_remat=egtp, order=order)
        except LayoutError:
            continue
        for mode in (
            ParallelMode.GTP_REMAT,
            ParallelMode.EXPERT_GTP_REMAT,
            ParallelMode.MODEL,
            ParallelMode.DATA,
        ):
            for group in layout.groups(mode):
                for rank in group:
                    assert layout.group_of(mode, rank) == group, (gtp, egtp, order, mode, rank)
                    checked += 1
    assert checked > 1000, checked


def test_megatron_places_gtp_remat_first_in_an_upper_case_order() -> None:
    # Why parallelctx refuses an order not in lowercase with a gtp_remat size > 1
    # (tests/test_gtp_layout.py): 0.19 matches 'tp' and 'ep' case-sensitively when it places
    # gtp_remat, so its groups differ from the lowercase order's.
    order = ps._inject_gtp_remat_axis("TP-CP-EP-DP-PP", after="tp")
    gen = ps.RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order=order, gtp_remat=2)
    assert sorted(gen.get_ranks("gtp_remat")) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan(8, tensor=2, gtp_remat=2).groups(ParallelMode.GTP_REMAT)[0] == [0, 2]
    with pytest.raises(LayoutError, match="lowercase"):
        plan(8, tensor=2, gtp_remat=2, order="TP-CP-EP-DP-PP")


def test_install_refuses_megatrons_upper_case_order_with_gtp_remat() -> None:
    # install()'s order check compared gpc's layout of the order read in lowercase, so
    # initialize_model_parallel(order="TP-CP-EP-DP-PP", gtp_remat_size=2) was taken as gpc's own
    # order although Megatron's init would place gtp_remat first.
    from parallelctx.megatron.options import parse_options
    from parallelctx.megatron.release import detect

    layout = plan(8, tensor=2, gtp_remat=2)
    with pytest.raises(ValueError, match=r"install\(order='TP-CP-EP-DP-PP'\).*lowercase"):
        parse_options(layout, {"order": "TP-CP-EP-DP-PP", "gtp_remat_size": 2}, detect())
    parse_options(layout, {"order": "tp-cp-ep-dp-pp", "gtp_remat_size": 2}, detect())
