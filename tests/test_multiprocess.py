"""Eight real processes on gloo: every (tensor, pipeline) factorisation of 8 in both orders,
a context-parallel case and an expert case, run by parallelctx's pytest plugin on its pool of 8
processes (gpc destroyed and launched again in the same processes between tests, on the same host
and port). Membership is proven by collectives on every rank (tests/mp_workers.py); rank 0
compares what all ranks saw with the pure layout.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_workers import _record, case_config

import parallelctx
from parallelctx import NotLaunchedError, ParallelMode, gpc, plan

WORLD = 8
FACTORISATIONS = [(t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) if t * p <= WORLD]
CASES: list[dict[str, Any]] = [
    {"tensor": t, "pipeline": p, "order": order}
    for order in ("tp-cp-ep-dp-pp", "tp-pp-dp")
    for t, p in FACTORISATIONS
] + [
    {"tensor": 2, "context": 2, "pipeline": 2, "order": "tp-cp-ep-dp-pp"},
    {"tensor": 2, "pipeline": 1, "expert": 4, "expert_tensor": 1, "order": "tp-cp-ep-dp-pp"},
]


def _layout(case: dict[str, Any]):
    cfg = case_config(case)["parallel"]
    return plan(
        WORLD,
        tensor=cfg["tensor"],
        pipeline=cfg["pipeline"]["size"],
        context=cfg["context"],
        expert=cfg.get("expert", {}).get("size", 1),
        expert_tensor=cfg.get("expert", {}).get("tensor"),
        order=cfg["order"],
    )


CONFIG = {k: v for k, v in case_config({}).items() if k != "parallel"}  # dist timeout 120, seed, model


def _layouts() -> list[dict[str, Any]]:
    """The marker's layouts: each case with pipeline/expert given as plain sizes."""
    return [dict(case) for case in CASES]


def _results(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Measure this rank's groups and seeds (mp_workers._record) and gather every rank's record."""
    records: list[Any] = [None] * WORLD
    dist.all_gather_object(records, _record(case))
    return sorted(records, key=lambda r: r["rank"])


@pytest.mark.parallel(world_size=WORLD, config=CONFIG, layouts=_layouts())
def test_groups_proven_by_collectives(parallel_layout: dict[str, Any]) -> None:
    case = parallel_layout
    layout = _layout(case)
    results = _results(case)
    if gpc.get_global_rank() != 0:
        return
    for record in results:
        rank = record["rank"]
        assert record["case"] == case
        for mode in ParallelMode:
            expected = layout.group_of(mode, rank)
            entry = record["modes"][mode.value]
            if not expected:  # embedding on a middle pipeline stage
                assert entry is None, (mode, rank)
                continue
            local = expected.index(rank)
            assert entry["ranks"] == expected, (mode, rank)
            assert entry["local_rank"] == entry["local_rank_str"] == local
            assert entry["size"] == len(expected)
            assert entry["view"] == [local, len(expected), expected]
            assert entry["next"] == expected[(local + 1) % len(expected)]
            assert entry["prev"] == expected[(local - 1) % len(expected)]
            assert entry["first"] == (local == 0) and entry["last"] == (local == len(expected) - 1)
            # every mode has a real group, size 1 included (None would mean the whole world)
            assert entry["has_group"]
            for key in ("measured", "measured_cpu"):
                measured = entry[key]
                # the one-hot all-reduce sums exactly the members, each once
                assert measured["sum"] == [1 if r in expected else 0 for r in range(WORLD)], (mode, rank, key)
                # the group's own rank order is ascending global rank, and ours matches it
                assert measured["order"] == expected
                assert measured["group_rank"] == local
                # the config's timeout (120 s) reached the subgroup, as torch holds it
                assert measured["timeout"] == 120.0
        pipe = layout.group_of(ParallelMode.PIPELINE, rank)
        assert record["pipeline_first"] == (rank == pipe[0])
        assert record["pipeline_last"] == (rank == pipe[-1])
        assert record["procs_on_node"] == WORLD
        assert record["num_nodes"] == 1 and record["node_rank"] == 0
        assert record["local_rank"] == rank
        assert record["config_model"] == 64
    # exactly one rank logs, and it sits on the last pipeline stage
    loggers = [r["rank"] for r in results if r["rank_for_log"]]
    assert len(loggers) == 1
    assert loggers[0] == layout.group_of(ParallelMode.PIPELINE, loggers[0])[-1]


@pytest.mark.parallel(world_size=WORLD, config=CONFIG, layouts=_layouts())
def test_seed_properties_across_ranks(parallel_layout: dict[str, Any]) -> None:
    layout = _layout(parallel_layout)
    every = {e["rank"]: e for e in _record(parallel_layout)["seeds_all"]}

    def first(rank: int, mode: ParallelMode) -> tuple[float, ...]:
        return tuple(every[rank]["draws"][mode.value][0])

    for group in layout.groups(ParallelMode.TENSOR):
        assert len({first(r, ParallelMode.GLOBAL) for r in group}) == 1, (
            "default stream same in a tensor group"
        )
        assert len({first(r, ParallelMode.TENSOR) for r in group}) == len(group), (
            "tensor stream differs per tp rank"
        )
    for group in layout.groups(ParallelMode.DATA):
        assert len({first(r, ParallelMode.TENSOR) for r in group}) == 1, (
            "tensor stream same across data replicas"
        )
        assert len({first(r, ParallelMode.DATA) for r in group}) == 1, "data stream same across a data group"
    for group in layout.groups(ParallelMode.PIPELINE):
        assert len({first(r, ParallelMode.DATA) for r in group}) == len(group), (
            "data stream differs per stage"
        )
    for entry in every.values():
        seeds = list(entry["seeds"].values())
        assert len(set(seeds)) == len(seeds), "modes never share a starting seed"
        for mode in ParallelMode:
            if mode is ParallelMode.GLOBAL:
                continue
            # the stream starts at its seed and the second block continues where the first stopped
            gen = torch.Generator().manual_seed(entry["seeds"][mode.value])
            assert (
                entry["draws"][mode.value][0] + entry["draws"][mode.value][1]
                == torch.rand(8, generator=gen).tolist()
            )


@pytest.mark.parallel(world_size=WORLD, config=CONFIG, tensor=2, pipeline=2)
def test_destroy_then_launch_again(tmp_path) -> None:
    # (every test here already runs on gpc launched again in the same processes and port)
    rank = gpc.get_global_rank()
    gpc.destroy()
    assert not dist.is_initialized()
    with pytest.raises(NotLaunchedError):
        gpc.get_local_rank(ParallelMode.TENSOR)
    with pytest.raises(NotLaunchedError):
        gpc.tensor.rank
    parallelctx.launch(
        case_config({"tensor": 4}),
        rank=rank,
        world_size=WORLD,
        local_rank=rank,
        init_method=f"file://{tmp_path}/rendezvous",
    )
    assert gpc.get_world_size(ParallelMode.TENSOR) == 4
    assert _record({"tensor": 4})["modes"]["tensor"]["measured"]["order"] == plan(WORLD, tensor=4).group_of(
        ParallelMode.TENSOR, rank
    )


@pytest.mark.parallel(world_size=WORLD, config=CONFIG, layouts=_layouts())
def test_group_creations_are_a_small_constant(parallel_layout: dict[str, Any]) -> None:
    # one group per distinct multi-rank group this rank is in, never O(world), counted in
    # torch's own registry rather than by parallelctx
    for case in (parallel_layout,):
        layout = _layout(case)
        for record in (_record(case),):
            rank = record["rank"]
            distinct = {
                layout.signature(m)
                for m in ParallelMode
                if len(layout.group_of(m, rank)) > 1
                and layout.signature(m) != layout.signature(ParallelMode.GLOBAL)
            }
            # plus one one-rank group that every size-1 mode of this rank shares
            alone = any(len(layout.group_of(m, rank)) == 1 for m in ParallelMode)
            assert record["torch_groups"] == 1 + len(distinct) + alone
