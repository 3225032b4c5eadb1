"""Exact parity with Megatron-core's rank layouts (``megatron.core.parallel_state``).

For every point of a grid of sizes and order strings this module asks Megatron-core's pure
``RankGenerator`` for the groups ``initialize_model_parallel`` would build, and compares them
with :func:`parallelctx.plan`. Megatron's rejections are reproduced without processes: the
divisibility ``RuntimeError``\\ s, the order-string ``RuntimeError`` that ``RankGenerator``
raises, the "pp last or equal data sizes" assert and the equal-pipeline-groups assert of
``initialize_model_parallel``. parallelctx must raise :class:`LayoutError` for exactly those.

The grid is pure function calls, so it runs in seconds. One more test starts 4 gloo ranks, runs
Megatron's own ``initialize_model_parallel`` beside parallelctx on the same default group and
checks every row of docs/migration.md's Megatron table: getter against its stated equivalent.
megatron-core is a hard requirement of the test extra, never skipped: without it this module
fails to import.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

try:
    import megatron.core as mcore
    from megatron.core.parallel_state import RankGenerator, default_embedding_ranks
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "tests/test_megatron_parity.py needs megatron-core==0.16.1 (part of the `test` extra): "
        ".venv/bin/python -m pip install -c requirements/constraints.txt -e '.[test]'"
    ) from exc

from parallelctx import Layout, LayoutError, ParallelMode, plan

MEGATRON_VERSION = "0.16.1"
SIZES = (1, 2, 4, 8)
WORLD_SIZES = range(1, 65)
ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")

# Further orders, on a smaller grid: every place for pp and dp, and orders that leave axes out,
# so that Megatron's order-string error and its equal-pipeline-groups assert are exercised too
# (neither can fire with the two orders above).
EXTRA_ORDERS = (
    "pp-tp-cp-ep-dp",
    "tp-pp-cp-ep-dp",
    "tp-cp-pp-ep-dp",
    "tp-pp-ep-cp-dp",
    "dp-tp-cp-ep-pp",
    "ep-tp-cp-dp-pp",
    "cp-tp-ep-dp-pp",
    "tp-dp-cp-ep-pp",
    "dp-pp-tp-cp-ep",
    "tp-pp-dp",
    "tp-dp-pp",
    "tp-cp-dp-pp",
    "tp-ep-dp-pp",
    "tp-cp-ep-dp",
)
EXTRA_WORLD_SIZES = (8, 16)
EXTRA_SIZES = (1, 2, 4)

# parallelctx mode -> (which Megatron generator, the token initialize_model_parallel passes).
DENSE, EXPERT = "dense", "expert"
MEGATRON_TOKENS: dict[ParallelMode, tuple[str, str]] = {
    ParallelMode.TENSOR: (DENSE, "tp"),
    ParallelMode.PIPELINE: (DENSE, "pp"),
    ParallelMode.DATA: (DENSE, "dp"),
    ParallelMode.CONTEXT: (DENSE, "cp"),
    ParallelMode.DATA_CONTEXT: (DENSE, "dp-cp"),
    ParallelMode.MODEL: (DENSE, "tp-pp"),
    ParallelMode.EXPERT: (EXPERT, "ep"),
    ParallelMode.EXPERT_TENSOR: (EXPERT, "tp"),
    ParallelMode.EXPERT_DATA: (EXPERT, "dp"),
    ParallelMode.EXPERT_TENSOR_AND_EXPERT: (EXPERT, "tp-ep"),
    ParallelMode.EXPERT_MODEL: (EXPERT, "tp-ep-pp"),
}
COMPARED_MODES = (*MEGATRON_TOKENS, ParallelMode.EMBEDDING)


@dataclass(frozen=True)
class Point:
    """One grid point: the sizes and order passed to both libraries."""

    world: int
    tensor: int
    pipeline: int
    context: int
    expert: int
    expert_tensor: int
    order: str

    def plan(self) -> Layout:
        """parallelctx's layout for this point (raises LayoutError when it rejects it)."""
        return plan(
            self.world,
            tensor=self.tensor,
            pipeline=self.pipeline,
            context=self.context,
            expert=self.expert,
            expert_tensor=self.expert_tensor,
            order=self.order,
        )


@dataclass(frozen=True)
class MegatronResult:
    """What Megatron-core does with a point: its groups per mode, or why it rejects it."""

    groups: dict[ParallelMode, list[list[int]]] | None
    rejected: str | None  # "divisible", "expert_divisible", "order", "pp_last", "pp_groups"
    detail: str = ""


def grid(worlds: range | tuple[int, ...], sizes: tuple[int, ...], orders: tuple[str, ...]) -> Iterator[Point]:
    """Every point: worlds x tensor, pipeline, context, expert in sizes x expert_tensor in
    {1, tensor} x orders."""
    for order, world in itertools.product(orders, worlds):
        for tp, pp, cp, ep in itertools.product(sizes, repeat=4):
            for etp in sorted({1, tp}):
                yield Point(world, tp, pp, cp, ep, etp, order)


@functools.cache  # the grid tests and the size test share the results
def megatron(point: Point) -> MegatronResult:
    """Apply initialize_model_parallel's rules (in its order) and RankGenerator to ``point``."""
    tp, pp, cp, ep, etp = point.tensor, point.pipeline, point.context, point.expert, point.expert_tensor
    world, order = point.world, point.order
    model_size = tp * pp * cp
    if world % model_size:  # RuntimeError "world_size (..) is not divisible by .."
        return MegatronResult(None, "divisible", f"{world} % {model_size}")
    dp = world // model_size
    try:
        RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order, rank_offset=0)
    except RuntimeError as exc:  # an axis of size > 1 that the order leaves out
        return MegatronResult(None, "order", str(exc))
    expert_model = etp * ep * pp
    if world % expert_model:  # RuntimeError "... expert_tensor_model_pipeline_parallel size"
        return MegatronResult(None, "expert_divisible", f"{world} % {expert_model}")
    edp = world // expert_model
    try:
        RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order, rank_offset=0)
    except RuntimeError as exc:
        return MegatronResult(None, "order", str(exc))
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        return MegatronResult(None, "pp_last", f"data {dp} != expert data {edp}")
    args = {DENSE: (tp, 1, dp, pp, cp, order), EXPERT: (etp, ep, edp, pp, 1, order)}
    if _ranks(*args[DENSE], "pp") != _ranks(*args[EXPERT], "pp"):
        return MegatronResult(None, "pp_groups")
    groups = {mode: _ranks(*args[kind], token) for mode, (kind, token) in MEGATRON_TOKENS.items()}
    groups[ParallelMode.EMBEDDING] = [default_embedding_ranks(g) for g in _ranks(*args[DENSE], "pp")]
    return MegatronResult(groups, None)


@functools.cache  # many grid points share a dense or an expert generator
def _ranks(tp: int, ep: int, dp: int, pp: int, cp: int, order: str, token: str) -> list[list[int]]:
    """``RankGenerator(...).get_ranks(token)``; callers must not modify the result."""
    return RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order, rank_offset=0).get_ranks(token)


def broken_rules(point: Point) -> set[str]:
    """Every rule of Megatron's that ``point`` breaks and that can be judged on its own."""
    p = point
    broken = set()
    if p.world % (p.tensor * p.pipeline * p.context):
        broken.add("divisible")
    if p.world % (p.expert_tensor * p.expert * p.pipeline):
        broken.add("expert_divisible")
    named = p.order.split("-")
    sizes = {"tp": max(p.tensor, p.expert_tensor), "cp": p.context, "ep": p.expert, "pp": p.pipeline}
    if any(size > 1 and token not in named for token, size in sizes.items()):
        broken.add("order")
    return broken


def _expected_message_parts(point: Point, kind: str | None) -> list[str]:
    """Substrings parallelctx's own message must contain for a rejection of this kind."""
    p = point
    if kind == "divisible":
        return [f"world_size={p.world}", str(p.tensor * p.pipeline * p.context)]
    if kind == "expert_divisible":
        return [f"world_size={p.world}", str(p.expert_tensor * p.expert * p.pipeline)]
    if kind == "order":
        return [f"order={p.order!r}", "leaves out"]
    if kind == "pp_last":
        dp = p.world // (p.tensor * p.pipeline * p.context)
        edp = p.world // (p.expert_tensor * p.expert * p.pipeline)
        return ["'pp'", f"({edp})", f"({dp})"]
    return [f"order={p.order!r}", "pipeline"]


def compare(point: Point, check_every_rank: bool) -> tuple[str | None, list[str]]:
    """Compare one point. Returns (Megatron's rejection kind or None, list of differences)."""
    result = megatron(point)
    try:
        layout = point.plan()
    except LayoutError as exc:
        if result.rejected is None:
            return None, [f"{point}: Megatron accepts, parallelctx rejects: {exc}"]
        message = str(exc)
        # Megatron stops at the first rule a point breaks; parallelctx may check another rule
        # first. Its message must name the values of one of the rules the point breaks.
        kinds = [result.rejected, *sorted(broken_rules(point) - {result.rejected})]
        wanted = [_expected_message_parts(point, kind) for kind in kinds]
        if not any(all(part in message for part in parts) for parts in wanted):
            return result.rejected, [f"{point}: message {message!r} names none of {wanted}"]
        return result.rejected, []
    if result.rejected is not None:
        return result.rejected, [
            f"{point}: Megatron rejects ({result.rejected} {result.detail}), parallelctx accepts"
        ]
    assert result.groups is not None
    diffs: list[str] = []
    for mode in COMPARED_MODES:
        theirs = result.groups[mode]
        # Megatron's member order inside a group is the group-local rank: keep it; only the
        # order of the groups themselves is free.
        if sorted(theirs) != layout.groups(mode):
            diffs.append(
                f"{point} {mode.value}: Megatron {sorted(theirs)} != parallelctx {layout.groups(mode)}"
            )
            continue
        if check_every_rank:
            # group_of is what groups.py uses at launch: check it for every rank.
            for group in theirs:
                for rank in group:
                    if layout.group_of(mode, rank) != group:
                        diffs.append(
                            f"{point} {mode.value}: group_of({rank}) = {layout.group_of(mode, rank)} != {group}"
                        )
    # groups.py shares one process group between modes with equal signatures: the signatures
    # must be equal exactly when Megatron's groups are.
    as_sets = {mode: frozenset(map(tuple, result.groups[mode])) for mode in COMPARED_MODES}
    for a, b in itertools.combinations(COMPARED_MODES, 2):
        if (as_sets[a] == as_sets[b]) != (layout.signature(a) == layout.signature(b)):
            diffs.append(f"{point}: {a.value} and {b.value} signatures disagree with the groups")
    return None, diffs


def run_grid(points: Iterator[Point], check_every_rank: bool) -> tuple[Counter[str | None], list[str]]:
    """Compare every point; return counts by outcome (None = compared) and all differences."""
    counts: Counter[str | None] = Counter()
    diffs: list[str] = []
    for point in points:
        kind, found = compare(point, check_every_rank)
        counts[kind] += 1
        diffs.extend(found)
    return counts, diffs


# --------------------------------------------------------------------------- tests
def test_megatron_core_version() -> None:
    assert mcore.__version__ == MEGATRON_VERSION, (
        f"parity is pinned to megatron-core=={MEGATRON_VERSION}, found {mcore.__version__}; "
        f"reinstall the test extra with -c requirements/constraints.txt"
    )


def test_megatron_generator_agrees_with_design_example() -> None:
    # A fixed point checked by hand, so the harness itself is known to read Megatron right.
    result = megatron(Point(8, 2, 2, 1, 1, 2, "tp-cp-ep-dp-pp"))
    assert result.groups is not None
    assert result.groups[ParallelMode.TENSOR] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert result.groups[ParallelMode.DATA] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert result.groups[ParallelMode.PIPELINE] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert result.groups[ParallelMode.MODEL] == [[0, 1, 4, 5], [2, 3, 6, 7]]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "worlds", [range(lo, lo + 8) for lo in range(1, 65, 8)], ids=lambda r: f"world{r.start}-{r.stop - 1}"
)
def test_parity_grid(order: str, worlds: range) -> None:
    counts, diffs = run_grid(grid(worlds, SIZES, (order,)), check_every_rank=True)
    assert not diffs, f"{len(diffs)} differences, first ones:\n" + "\n".join(diffs[:20])
    assert counts[None] > 0, f"no layout in {worlds} was valid for both: the grid is empty"


def test_parity_grid_size() -> None:
    # Guards the grid itself: if it shrank or Megatron's rules changed, this says so.
    counts = Counter(megatron(p).rejected for p in grid(WORLD_SIZES, SIZES, ORDERS))
    assert sum(counts.values()) == 64 * 2 * (4**3) * (1 + 2 + 2 + 2)
    assert counts[None] == 2874
    assert counts["divisible"] == 2 * 26228
    assert counts["expert_divisible"] == 2 * 759
    assert counts["pp_last"] == 496
    assert counts["order"] == counts["pp_groups"] == 0


def test_parity_extra_orders() -> None:
    counts, diffs = run_grid(grid(EXTRA_WORLD_SIZES, EXTRA_SIZES, EXTRA_ORDERS), check_every_rank=False)
    assert not diffs, f"{len(diffs)} differences, first ones:\n" + "\n".join(diffs[:20])
    # Every one of Megatron's rules must have fired somewhere, or this grid proves nothing.
    for kind in (None, "divisible", "expert_divisible", "order", "pp_last", "pp_groups"):
        assert counts[kind] > 0, f"no point of the extra grid exercised {kind!r}: {dict(counts)}"


def test_rejection_is_layout_error_with_values() -> None:
    # One hand-picked point per rule, with the message parallelctx gives.
    cases = {
        Point(12, 8, 1, 1, 1, 8, "tp-cp-ep-dp-pp"): "divisible",
        Point(8, 2, 1, 1, 8, 2, "tp-cp-ep-dp-pp"): "expert_divisible",
        Point(8, 1, 1, 2, 1, 1, "tp-pp-dp"): "order",
        Point(16, 2, 2, 1, 2, 2, "tp-cp-ep-pp-dp"): "pp_last",
        Point(8, 2, 2, 2, 4, 1, "tp-pp-cp-ep-dp"): "pp_groups",
    }
    for point, kind in cases.items():
        assert megatron(point).rejected == kind, point
        with pytest.raises(LayoutError) as info:
            point.plan()
        for part in _expected_message_parts(point, kind):
            assert part in str(info.value), (part, str(info.value))


# --------------------------------------------------------------------------- real processes
def _group_ranks(group: Any) -> list[int]:
    """Members of a process group (None, parallelctx's size-1 group, is this rank alone)."""
    import torch.distributed as dist

    return [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)


def _migration_rows() -> dict[str, tuple[Any, Any]]:
    """docs/migration.md's Megatron table: row -> (Megatron's answer, parallelctx's), as thunks."""
    from megatron.core import parallel_state as ps

    from parallelctx import gpc

    M = ParallelMode
    rows: dict[str, tuple[Any, Any]] = {}
    pairs = {
        "tensor": (
            ps.get_tensor_model_parallel_group,
            ps.get_tensor_model_parallel_rank,
            ps.get_tensor_model_parallel_world_size,
            M.TENSOR,
        ),
        "pipeline": (
            ps.get_pipeline_model_parallel_group,
            ps.get_pipeline_model_parallel_rank,
            ps.get_pipeline_model_parallel_world_size,
            M.PIPELINE,
        ),
        "data": (
            ps.get_data_parallel_group,
            ps.get_data_parallel_rank,
            ps.get_data_parallel_world_size,
            M.DATA,
        ),
        "context": (
            ps.get_context_parallel_group,
            ps.get_context_parallel_rank,
            ps.get_context_parallel_world_size,
            M.CONTEXT,
        ),
        "expert": (
            ps.get_expert_model_parallel_group,
            ps.get_expert_model_parallel_rank,
            ps.get_expert_model_parallel_world_size,
            M.EXPERT,
        ),
        "expert_tensor": (
            ps.get_expert_tensor_parallel_group,
            ps.get_expert_tensor_parallel_rank,
            ps.get_expert_tensor_parallel_world_size,
            M.EXPERT_TENSOR,
        ),
        "expert_data": (
            ps.get_expert_data_parallel_group,
            ps.get_expert_data_parallel_rank,
            ps.get_expert_data_parallel_world_size,
            M.EXPERT_DATA,
        ),
    }
    for name, (group, rank, size, mode) in pairs.items():
        rows[f"{name}.group"] = (
            lambda g=group: _group_ranks(g()),
            lambda m=mode: _group_ranks(gpc.get_group(m)),
        )
        rows[f"{name}.rank"] = (rank, lambda m=mode: gpc.get_local_rank(m))
        rows[f"{name}.size"] = (size, lambda m=mode: gpc.get_world_size(m))
    rows["data_context.group"] = (
        lambda: _group_ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        lambda: _group_ranks(gpc.get_group(M.DATA_CONTEXT)),
    )
    rows["data_context.rank"] = (
        lambda: ps.get_data_parallel_rank(with_context_parallel=True),
        lambda: gpc.get_local_rank(M.DATA_CONTEXT),
    )
    rows["data_context.size"] = (
        lambda: ps.get_data_parallel_world_size(with_context_parallel=True),
        lambda: gpc.get_world_size(M.DATA_CONTEXT),
    )
    rows["data.gloo"] = (
        lambda: _group_ranks(ps.get_data_parallel_group_gloo()),
        lambda: _group_ranks(gpc.get_cpu_group(M.DATA)),
    )
    rows["expert_data.gloo"] = (
        lambda: _group_ranks(ps.get_expert_data_parallel_group_gloo()),
        lambda: _group_ranks(gpc.get_cpu_group(M.EXPERT_DATA)),
    )
    rows["model.group"] = (
        lambda: _group_ranks(ps.get_model_parallel_group()),
        lambda: _group_ranks(gpc.get_group(M.MODEL)),
    )
    rows["embedding.in"] = (ps.is_rank_in_embedding_group, lambda: gpc.is_initialized(M.EMBEDDING))
    rows["embedding.group"] = (
        lambda: _group_ranks(ps.get_embedding_group()) if ps.is_rank_in_embedding_group() else None,
        lambda: _group_ranks(gpc.get_group(M.EMBEDDING)) if gpc.is_initialized(M.EMBEDDING) else None,
    )
    rows["tensor_and_expert.group"] = (
        lambda: _group_ranks(ps.get_expert_tensor_and_model_parallel_group()),
        lambda: _group_ranks(gpc.get_group(M.EXPERT_TENSOR_AND_EXPERT)),
    )
    rows["expert_model.group"] = (
        lambda: _group_ranks(ps.get_expert_tensor_model_pipeline_parallel_group()),
        lambda: _group_ranks(gpc.get_group(M.EXPERT_MODEL)),
    )
    rows["context.ranks"] = (ps.get_context_parallel_global_ranks, lambda: gpc.get_ranks_in_group(M.CONTEXT))
    rows["tensor.src"] = (ps.get_tensor_model_parallel_src_rank, lambda: gpc.get_ranks_in_group(M.TENSOR)[0])
    rows["data.src"] = (ps.get_data_parallel_src_rank, lambda: gpc.get_ranks_in_group(M.DATA)[0])
    rows["model.src"] = (ps.get_model_parallel_src_rank, lambda: gpc.get_ranks_in_group(M.MODEL)[0])
    rows["pipeline.first"] = (
        ps.get_pipeline_model_parallel_first_rank,
        lambda: gpc.get_ranks_in_group(M.PIPELINE)[0],
    )
    rows["pipeline.last"] = (
        ps.get_pipeline_model_parallel_last_rank,
        lambda: gpc.get_ranks_in_group(M.PIPELINE)[-1],
    )
    rows["pipeline.next"] = (
        ps.get_pipeline_model_parallel_next_rank,
        lambda: gpc.get_next_global_rank(M.PIPELINE),
    )
    rows["pipeline.prev"] = (
        ps.get_pipeline_model_parallel_prev_rank,
        lambda: gpc.get_prev_global_rank(M.PIPELINE),
    )
    rows["pipeline.is_first"] = (ps.is_pipeline_first_stage, gpc.is_pipeline_first_stage)
    rows["pipeline.is_last"] = (ps.is_pipeline_last_stage, gpc.is_pipeline_last_stage)
    return rows


MIGRATION_SIZES = dict(tensor=2, pipeline=2, expert=2, expert_tensor=1)


def _migration_worker(out_dir: str) -> None:
    """Every rank: build Megatron's groups beside parallelctx's on the same default group and
    answer each row of the migration table both ways."""
    import json
    import warnings
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    warnings.simplefilter("ignore")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=MIGRATION_SIZES["tensor"],
        pipeline_model_parallel_size=MIGRATION_SIZES["pipeline"],
        expert_model_parallel_size=MIGRATION_SIZES["expert"],
        expert_tensor_parallel_size=MIGRATION_SIZES["expert_tensor"],
    )
    try:
        answers = {row: [theirs(), ours()] for row, (theirs, ours) in _migration_rows().items()}
    finally:
        ps.destroy_model_parallel()
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(answers))


@pytest.mark.slow
def test_migration_table_against_megatron_getters_4_ranks(tmp_path: Any) -> None:
    import json
    from pathlib import Path

    import parallelctx

    parallel = dict(
        tensor=MIGRATION_SIZES["tensor"],
        pipeline=MIGRATION_SIZES["pipeline"],
        expert=dict(size=MIGRATION_SIZES["expert"], tensor=MIGRATION_SIZES["expert_tensor"]),
    )
    parallelctx.spawn(
        _migration_worker,
        4,
        args=(str(tmp_path),),
        config=dict(parallel=parallel),
        backend="gloo",
        timeout=120,
        join_timeout=300,
    )
    layout = plan(4, **MIGRATION_SIZES)
    for rank in range(4):
        answers = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert len(answers) == 41
        wrong = {row: pair for row, pair in answers.items() if pair[0] != pair[1]}
        assert not wrong, f"rank {rank}: Megatron and parallelctx disagree: {wrong}"
        # and the answers are the real layout, not two equal mistakes
        assert answers["tensor.group"][1] == layout.group_of(ParallelMode.TENSOR, rank)
        assert answers["expert.group"][1] == layout.group_of(ParallelMode.EXPERT, rank)
        assert answers["embedding.group"][1] == (layout.group_of(ParallelMode.EMBEDDING, rank) or None)
