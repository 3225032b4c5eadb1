"""Eight real processes on gloo: every (tensor, pipeline) factorisation of 8 in both orders,
a context-parallel case and an expert case, in the same processes one after another (destroy,
then launch again). Membership is proven by collectives in the workers (tests/mp_workers.py)
and compared here with the pure layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import parallelctx
from parallelctx import ParallelMode, plan
from parallelctx.launch import free_port

from mp_workers import case_config, run_cases

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


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("mp")
    port = free_port()
    # every case after the first relaunches in the same processes on the same host and port
    parallelctx.spawn(
        run_cases,
        nprocs_per_node=WORLD,
        dist_url=f"tcp://127.0.0.1:{port}",
        args=(str(out), CASES, port),
        config=case_config(CASES[0]),
        join_timeout=600,
    )
    found: dict[int, list[dict[str, Any]]] = {}
    for i in range(len(CASES)):
        found[i] = [json.loads(Path(out, f"case{i}_rank{r}.json").read_text()) for r in range(WORLD)]
    return found


@pytest.mark.timeout(700)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    "-".join(f"{k}{v}" for k, v in c.items()) for c in CASES
])
def test_groups_proven_by_collectives(results, index: int) -> None:
    case = CASES[index]
    layout = _layout(case)
    for record in results[index]:
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
    loggers = [r["rank"] for r in results[index] if r["rank_for_log"]]
    assert len(loggers) == 1
    assert loggers[0] == layout.group_of(ParallelMode.PIPELINE, loggers[0])[-1]


@pytest.mark.timeout(700)
@pytest.mark.parametrize("index", range(len(CASES)))
def test_seed_properties_across_ranks(results, index: int) -> None:
    layout = _layout(CASES[index])
    every = {e["rank"]: e for e in results[index][0]["seeds_all"]}

    def first(rank: int, mode: ParallelMode) -> tuple[float, ...]:
        return tuple(every[rank]["draws"][mode.value][0])

    for group in layout.groups(ParallelMode.TENSOR):
        assert len({first(r, ParallelMode.GLOBAL) for r in group}) == 1, "default stream same in a tensor group"
        assert len({first(r, ParallelMode.TENSOR) for r in group}) == len(group), "tensor stream differs per tp rank"
    for group in layout.groups(ParallelMode.DATA):
        assert len({first(r, ParallelMode.TENSOR) for r in group}) == 1, "tensor stream same across data replicas"
        assert len({first(r, ParallelMode.DATA) for r in group}) == 1, "data stream same across a data group"
    for group in layout.groups(ParallelMode.PIPELINE):
        assert len({first(r, ParallelMode.DATA) for r in group}) == len(group), "data stream differs per stage"
    for rank, entry in every.items():
        seeds = list(entry["seeds"].values())
        assert len(set(seeds)) == len(seeds), "modes never share a starting seed"
        for mode in ParallelMode:
            if mode is ParallelMode.GLOBAL:
                continue
            # the stream starts at its seed and the second block continues where the first stopped
            gen = torch.Generator().manual_seed(entry["seeds"][mode.value])
            assert entry["draws"][mode.value][0] + entry["draws"][mode.value][1] == torch.rand(8, generator=gen).tolist()


def test_destroy_then_launch_again(results) -> None:
    for index in range(1, len(CASES)):
        for record in results[index]:
            assert record["after_destroy"] == {"dist_initialized": False, "query_raised": True, "view_raised": True}


def test_group_creations_are_a_small_constant(results) -> None:
    # one group per distinct multi-rank group this rank is in, never O(world), counted in
    # torch's own registry rather than by parallelctx
    for index, case in enumerate(CASES):
        layout = _layout(case)
        for record in results[index]:
            rank = record["rank"]
            distinct = {
                layout.signature(m)
                for m in ParallelMode
                if len(layout.group_of(m, rank)) > 1 and layout.signature(m) != layout.signature(ParallelMode.GLOBAL)
            }
            # plus one one-rank group that every size-1 mode of this rank shares
            alone = any(len(layout.group_of(m, rank)) == 1 for m in ParallelMode)
            assert record["torch_groups"] == 1 + len(distinct) + alone
