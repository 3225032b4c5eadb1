"""Megatron-core's ``parallel_state`` unit cases, asked of the bridge (``parallelctx.megatron``).

The cases follow what Megatron-core's own ``tests/unit_tests/test_parallel_state.py`` checks
(tag core_v0.16.1): lifecycle and refusals, the rank/size/source/neighbour getters on 8 ranks for
both orders it tests, the overrides, order consistency, and the rank generator against the
groups of older Megatron code. Here each layout is a gpc launch on the plugin's 8-rank pool and
``parallelctx.megatron.install()``; the expected values are stated independently of both gpc and
Megatron (arithmetic on the global rank), so a wrong bridge and a wrong layout cannot agree.
Written for this repository; no code of Megatron's test file is used.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import parallelctx
from parallelctx import LayoutError, ParallelMode, gpc, plan

warnings.simplefilter("ignore")  # megatron warns at import about optional packages
from megatron.core import parallel_state as ps  # noqa: E402

import parallelctx.megatron as bridge  # noqa: E402

W = 8
ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-pp-ep-dp"]


def members(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


# --------------------------------------------------------------------------- lifecycle
def test_layouts_megatron_refuses_are_refused() -> None:
    # Megatron raises RuntimeError for these sizes on 8 ranks; gpc refuses them at plan/launch.
    for sizes in (dict(tensor=2 * W), dict(pipeline=2 * W), dict(tensor=W, pipeline=W)):
        with pytest.raises(LayoutError, match="divide"):
            plan(W, **sizes)


def test_install_before_launch_is_refused() -> None:
    with pytest.raises(parallelctx.NotLaunchedError, match="launch"):
        bridge.install()
    with pytest.raises(parallelctx.NotLaunchedError, match="launch"):
        bridge.process_groups()


@pytest.mark.parallel(world_size=W, layouts=[dict(order=o) for o in ORDERS])
def test_virtual_pipeline_without_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a pipeline of size > 1"):
        bridge.install(virtual_pipeline_model_parallel_size=2)
    assert not bridge.is_installed() and not ps.model_parallel_is_initialized()


@pytest.mark.parallel(world_size=W, layouts=[dict(tensor=2, pipeline=4, order=o) for o in ORDERS])
def test_install_then_uninstall() -> None:
    bridge.install()
    assert ps.model_parallel_is_initialized()
    for getter in (
        ps.get_model_parallel_group,
        ps.get_tensor_model_parallel_group,
        ps.get_pipeline_model_parallel_group,
        ps.get_data_parallel_group,
        ps.get_expert_model_parallel_group,
        ps.get_expert_tensor_parallel_group,
        ps.get_expert_data_parallel_group,
        ps.get_expert_tensor_model_pipeline_parallel_group,
    ):
        assert getter() is not None, getter.__name__
    bridge.uninstall()
    assert ps._MODEL_PARALLEL_GROUP is None and not ps.model_parallel_is_initialized()


# --------------------------------------------------------------------------- getters
@pytest.mark.parallel(world_size=W, layouts=[dict(tensor=2, pipeline=4, order=o) for o in ORDERS])
def test_pipeline_neighbours_tp2_pp4() -> None:
    bridge.install()
    rank = gpc.get_global_rank()
    assert ps.get_pipeline_model_parallel_first_rank() == rank % 2
    assert ps.get_data_parallel_src_rank() == rank  # data size 1
    assert ps.get_pipeline_model_parallel_next_rank() == (rank + 2) % W
    assert ps.get_pipeline_model_parallel_prev_rank() == (rank - 2) % W


@pytest.mark.parallel(world_size=W, layouts=[dict(pipeline=W, order=o) for o in ORDERS])
def test_pipeline_over_the_world() -> None:
    bridge.install()
    rank = gpc.get_global_rank()
    assert ps.get_data_parallel_src_rank() == rank
    assert (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()) == (1, 0)
    assert ps.get_pipeline_model_parallel_world_size() == W
    assert ps.get_pipeline_model_parallel_rank() == rank
    assert ps.is_pipeline_first_stage(ignore_virtual=True) == ps.is_pipeline_first_stage() == (rank == 0)
    assert ps.is_pipeline_last_stage(ignore_virtual=True) == ps.is_pipeline_last_stage() == (rank == W - 1)
    # the overrides: clearing one falls back to the group
    ps.set_pipeline_model_parallel_world_size(None)
    ps.set_pipeline_model_parallel_rank(None)
    assert ps.get_pipeline_model_parallel_world_size() == W and ps.get_pipeline_model_parallel_rank() == rank
    ps.set_virtual_pipeline_model_parallel_rank(rank)
    assert ps.get_virtual_pipeline_model_parallel_rank() == rank


@pytest.mark.parallel(world_size=W, layouts=[dict(tensor=W, order=o) for o in ORDERS])
def test_tensor_over_the_world() -> None:
    bridge.install()
    rank = gpc.get_global_rank()
    assert ps.get_tensor_model_parallel_world_size() == W and ps.get_tensor_model_parallel_rank() == rank
    ps.set_tensor_model_parallel_world_size(None)
    ps.set_tensor_model_parallel_rank(None)
    assert ps.get_tensor_model_parallel_world_size() == W and ps.get_tensor_model_parallel_rank() == rank
    assert ps.get_tensor_model_parallel_src_rank() == 0


@pytest.mark.parallel(world_size=W, layouts=[dict(expert_tensor=W, order=o) for o in ORDERS])
def test_expert_tensor_over_the_world() -> None:
    bridge.install()
    rank = gpc.get_global_rank()
    assert ps.get_expert_tensor_parallel_world_size() == W and ps.get_expert_tensor_parallel_rank() == rank
    ps.set_expert_tensor_parallel_world_size(None)
    ps.set_expert_tensor_parallel_rank(None)
    assert ps.get_expert_tensor_parallel_world_size() == W and ps.get_expert_tensor_parallel_rank() == rank


@pytest.mark.parallel(world_size=W, context=W)
def test_context_over_the_world() -> None:
    bridge.install()
    assert ps.get_context_parallel_rank() == gpc.get_global_rank()
    assert ps.get_context_parallel_world_size() == W


@pytest.mark.parallel(world_size=W, expert=W)
def test_expert_over_the_world() -> None:
    bridge.install()
    rank = gpc.get_global_rank()
    assert ps.get_expert_model_parallel_rank() == rank
    ps.set_expert_model_parallel_rank(None)
    assert ps.get_expert_model_parallel_rank() == rank


# --------------------------------------------------------------------------- orders
CONSISTENT = [(1, 8, 1), (2, 4, 1), (4, 2, 1), (8, 1, 1), (4, 1, 2), (1, 1, 8), (1, 1, 2), (2, 1, 4)]


@pytest.mark.parallel(
    world_size=W,
    layouts=[dict(tensor=t, pipeline=p, expert=e, order="tp-ep-dp-pp") for t, p, e in CONSISTENT],
)
def test_orders_that_give_the_same_groups() -> None:
    # For these sizes 'tp-ep-dp-pp' and 'tp-pp-ep-dp' describe the same layout: every group and
    # rank the bridge answers equals the pure plan of the other order.
    bridge.install()
    lay = gpc.layout
    other = plan(W, tensor=lay.tensor, pipeline=lay.pipeline, expert=lay.expert, order="tp-pp-ep-dp")
    rank = gpc.get_global_rank()
    M = ParallelMode
    answers = {
        M.TENSOR: ps.get_tensor_model_parallel_group(),
        M.DATA: ps.get_data_parallel_group(),
        M.PIPELINE: ps.get_pipeline_model_parallel_group(),
        M.EXPERT_DATA: ps.get_expert_data_parallel_group(),
        M.CONTEXT: ps.get_context_parallel_group(),
        M.MODEL: ps.get_model_parallel_group(),
        M.EXPERT_TENSOR_AND_EXPERT: ps.get_expert_tensor_and_model_parallel_group(),
    }
    for mode, group in answers.items():
        assert members(group) == other.group_of(mode, rank), mode
    assert ps.get_tensor_model_parallel_rank() == other.local_rank(M.TENSOR, rank)
    assert ps.get_data_parallel_rank() == other.local_rank(M.DATA, rank)
    assert ps.get_pipeline_model_parallel_rank() == other.local_rank(M.PIPELINE, rank)
    assert ps.get_expert_model_parallel_rank() == other.local_rank(M.EXPERT, rank)
    # tensor x data, made by install(): within one pipeline stage, all its tensor and data ranks
    stage = other.local_rank(M.PIPELINE, rank)
    same_stage = [r for r in range(W) if other.local_rank(M.PIPELINE, r) == stage]
    assert members(ps.get_tensor_and_data_parallel_group()) == same_stage


# --------------------------------------------------------------------------- rank generator
def _old_style_groups(world: int, tp: int, pp: int, cp: int, ep: int) -> dict[str, list[list[int]]]:
    """Groups by the loops older Megatron code used (default order), written out as plain
    arithmetic: ranks are tp fastest, then cp, then dp, then pp; the expert grid is tp, ep,
    expert-dp, pp."""
    dp = world // (tp * pp * cp)
    per_stage = world // pp
    out: dict[str, list[list[int]]] = {
        k: [] for k in ("dp", "dp-cp", "cp", "tp", "pp", "tp-dp-cp", "tp-ep", "edp")
    }
    for stage in range(pp):
        base = stage * per_stage
        out["dp"] += [list(range(base + j, base + per_stage, tp * cp)) for j in range(tp * cp)]
        out["dp-cp"] += [list(range(base + j, base + per_stage, tp)) for j in range(tp)]
        for d in range(dp):
            start = base + d * tp * cp
            out["cp"] += [list(range(start + k, start + tp * cp, tp)) for k in range(tp)]
        out["tp-dp-cp"].append(list(range(base, base + per_stage)))
    out["tp"] = [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]
    out["pp"] = [list(range(i, world, per_stage)) for i in range(per_stage)]
    edp = world // (tp * ep * pp)
    for stage in range(pp):
        for d in range(edp):
            start = stage * per_stage + d * tp * ep
            out["tp-ep"].append(list(range(start, start + tp * ep)))
        for j in range(tp * ep):
            out["edp"].append(list(range(stage * per_stage + j, (stage + 1) * per_stage, tp * ep)))
    return out


@pytest.mark.parametrize(
    "nodes, gpus, tp, pp, cp, ep",
    [
        (1, 1, 1, 1, 1, 1),
        (1, 8, 8, 1, 1, 1),
        (1, 8, 2, 2, 1, 1),
        (1, 8, 2, 4, 1, 1),
        (3, 8, 8, 3, 1, 1),
        (4, 8, 2, 4, 1, 1),
        (8, 8, 8, 8, 1, 1),
        (8, 8, 2, 1, 1, 4),
        (8, 8, 2, 2, 2, 4),
        (8, 8, 2, 1, 4, 8),
        (8, 8, 2, 2, 2, 8),
        (16, 8, 4, 8, 1, 4),
        (16, 8, 4, 8, 4, 1),
        (32, 8, 8, 8, 4, 1),
        (64, 8, 4, 2, 8, 8),
        (128, 8, 4, 2, 8, 8),
        (316, 8, 4, 8, 1, 1),
        (1344, 8, 4, 8, 1, 1),
    ],
)
def test_plan_matches_older_megatron_groups(
    nodes: int, gpus: int, tp: int, pp: int, cp: int, ep: int
) -> None:
    world = nodes * gpus
    lay = plan(world, tensor=tp, pipeline=pp, context=cp, expert=ep)
    want = _old_style_groups(world, tp, pp, cp, ep)
    M = ParallelMode
    for token, mode in (
        ("dp", M.DATA),
        ("dp-cp", M.DATA_CONTEXT),
        ("cp", M.CONTEXT),
        ("tp", M.TENSOR),
        ("pp", M.PIPELINE),
        ("tp-ep", M.EXPERT_TENSOR_AND_EXPERT),
        ("edp", M.EXPERT_DATA),
    ):
        assert sorted(lay.groups(mode)) == sorted(want[token]), token
    # tensor x data x context (the FP8 amax group): every rank of one pipeline stage
    assert sorted(
        lay.axes_group_of("dense", ("tp", "dp", "cp"), r) for r in range(0, world, world // pp)
    ) == sorted(want["tp-dp-cp"])


# --------------------------------------------------------------------------- options
@pytest.mark.parallel(world_size=W, context=4, pipeline=2)
def test_context_options_make_megatrons_groups() -> None:
    # create_all_gather_group exists in 0.16 and 0.17 only (0.18 on: create_all_gather_groups())
    all_gather = "create_all_gather_group" in bridge.release.detect().options
    bridge.install(
        hybrid_context_parallel=True,
        hierarchical_context_parallel_sizes=[2, 2],
        create_gloo_process_groups=False,
        **({"create_all_gather_group": True} if all_gather else {}),
    )
    rank = gpc.get_global_rank()
    cp = gpc.get_ranks_in_group(ParallelMode.CONTEXT)  # 4 consecutive ranks (data size 1)
    assert cp == list(range(rank // 4 * 4, rank // 4 * 4 + 4))
    i = cp.index(rank)
    inner, outer = ps.get_hierarchical_context_parallel_groups()
    assert members(inner) == cp[i // 2 * 2 : i // 2 * 2 + 2]  # neighbours
    assert members(outer) == [cp[i % 2], cp[i % 2 + 2]]  # two apart
    if all_gather:
        ag = ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
        assert ps.has_separate_all_gather_group() and members(ag) == cp
        assert ag is not ps.get_data_parallel_group(with_context_parallel=True)  # a communicator of its own
    else:
        ag = ps.get_data_parallel_group(with_context_parallel=True)
    assert (
        members(ps.get_hybrid_data_context_parallel_groups(group_size=2)) == cp[i // 2 * 2 : i // 2 * 2 + 2]
    )
    assert ps.get_hybrid_data_context_parallel_groups(group_size=4) is ps.get_data_parallel_group(
        with_context_parallel=True
    )
    with pytest.raises(AssertionError, match="gloo"):  # as Megatron without gloo groups
        ps.get_data_parallel_group_gloo()
    for group in (inner, outer, ag):  # each answers a collective over its members
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        assert t.item() == len(members(group))
