"""Expert parallelism: config forms, hand-worked groups, invariants, errors, CLI, real ranks.

Parity of every expert mode with Megatron-core is in test_megatron_parity.py; here the groups
are checked against values worked out by hand and against the semantics of docs/expert.md and docs/layout.md (the
expert grid re-splits each pipeline stage with the same order string).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
import torch.distributed as dist

import parallelctx
from parallelctx import LayoutError, ParallelMode, gpc, load_config, plan
from parallelctx.cli import main as cli_main
from parallelctx.cli.verify import probe_groups, problems, verify

EXPERT_MODES = (
    ParallelMode.EXPERT,
    ParallelMode.EXPERT_TENSOR,
    ParallelMode.EXPERT_DATA,
    ParallelMode.EXPERT_TENSOR_AND_EXPERT,
    ParallelMode.EXPERT_MODEL,
)
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- config
def test_config_expert_as_int_defaults_expert_tensor_to_tensor() -> None:
    par = load_config(dict(parallel=dict(tensor=2, expert=4))).parallel
    assert (par.expert.size, par.expert_tensor) == (4, 2)


def test_config_expert_as_dict_sets_expert_tensor() -> None:
    par = load_config(dict(parallel=dict(tensor=2, expert=dict(size=4, tensor=1)))).parallel
    assert (par.expert.size, par.expert_tensor) == (4, 1)


def test_config_rejects_a_bad_expert_size_with_its_path() -> None:
    with pytest.raises(pydantic.ValidationError, match="expert"):
        load_config(dict(parallel=dict(expert=dict(size=0))))


# --------------------------------------------------------------------------- worked examples
def test_worked_example_expert_tensor_1() -> None:
    # W=8, T=2, P=2, E=2, ET=1 -> ED = 8 / (1*2*2) = 2. Expert grid, fastest first:
    # etp (1), ep (stride 1), edp (stride 2), pp (stride 4).
    layout = plan(8, tensor=2, pipeline=2, expert=2, expert_tensor=1)
    assert layout.expert_data == 2
    assert layout.groups(ParallelMode.EXPERT) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups(ParallelMode.EXPERT_TENSOR) == [[r] for r in range(8)]
    assert layout.groups(ParallelMode.EXPERT_DATA) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups(ParallelMode.EXPERT_TENSOR_AND_EXPERT) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups(ParallelMode.EXPERT_MODEL) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # the dense grid is untouched by the expert sizes
    assert layout.groups(ParallelMode.TENSOR) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups(ParallelMode.PIPELINE) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_worked_example_expert_tensor_defaults_to_tensor() -> None:
    # W=16, T=ET=2, P=2, E=2 -> ED = 16 / 8 = 2; strides etp 1, ep 2, edp 4, pp 8.
    layout = plan(16, tensor=2, pipeline=2, expert=2)
    assert (layout.expert_tensor, layout.expert_data) == (2, 2)
    assert layout.groups(ParallelMode.EXPERT_TENSOR) == layout.groups(ParallelMode.TENSOR)
    assert layout.groups(ParallelMode.EXPERT)[:3] == [[0, 2], [1, 3], [4, 6]]
    assert layout.groups(ParallelMode.EXPERT_TENSOR_AND_EXPERT)[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups(ParallelMode.EXPERT_DATA)[:5] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12]]
    assert layout.groups(ParallelMode.EXPERT_MODEL) == [
        [0, 1, 2, 3, 8, 9, 10, 11],
        [4, 5, 6, 7, 12, 13, 14, 15],
    ]


def test_expert_with_context_drops_cp_from_the_expert_grid() -> None:
    # W=8, C=2, E=4, T=ET=1: dense data = 4, expert data = 2. The expert grid has no cp, so
    # the experts spread over context and data ranks alike.
    layout = plan(8, context=2, expert=4)
    assert (layout.data, layout.expert_data) == (4, 2)
    assert layout.groups(ParallelMode.CONTEXT) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups(ParallelMode.EXPERT) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups(ParallelMode.EXPERT_DATA) == [[0, 4], [1, 5], [2, 6], [3, 7]]


# --------------------------------------------------------------------------- invariants
def _valid_layouts() -> list[Any]:
    out = []
    for order in ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-ep-dp"):
        for world in (4, 8, 16, 32, 48):
            for tp, pp, cp, ep, etp in itertools.product((1, 2, 4), repeat=5):
                try:
                    out.append(
                        plan(
                            world,
                            tensor=tp,
                            pipeline=pp,
                            context=cp,
                            expert=ep,
                            expert_tensor=etp,
                            order=order,
                        )
                    )
                except LayoutError:
                    pass
    return out


LAYOUTS = _valid_layouts()


def test_invariants_cover_many_layouts() -> None:
    assert len(LAYOUTS) > 300
    assert (
        sum(1 for lay in LAYOUTS if lay.expert > 1 and lay.pipeline > 1 and lay.expert_tensor != lay.tensor)
        > 20
    )


def test_expert_sizes_and_partitions() -> None:
    for lay in LAYOUTS:
        w = lay.world_size
        assert lay.expert_data == w // (lay.expert_tensor * lay.expert * lay.pipeline)
        sizes = {
            ParallelMode.EXPERT: lay.expert,
            ParallelMode.EXPERT_TENSOR: lay.expert_tensor,
            ParallelMode.EXPERT_DATA: lay.expert_data,
            ParallelMode.EXPERT_TENSOR_AND_EXPERT: lay.expert_tensor * lay.expert,
            ParallelMode.EXPERT_MODEL: lay.expert_tensor * lay.expert * lay.pipeline,
        }
        for mode, size in sizes.items():
            groups = lay.groups(mode)
            assert lay.size(mode) == size
            assert all(len(g) == size and g == sorted(g) for g in groups), (lay.describe(), mode)
            assert sorted(r for g in groups for r in g) == list(range(w)), (lay.describe(), mode)
            for rank in range(w):
                assert rank in lay.group_of(mode, rank)
                assert lay.group_of(mode, rank) in groups


def test_expert_modes_are_orthogonal_and_compose() -> None:
    pairs = [
        (ParallelMode.EXPERT, ParallelMode.EXPERT_DATA),
        (ParallelMode.EXPERT, ParallelMode.EXPERT_TENSOR),
        (ParallelMode.EXPERT_TENSOR, ParallelMode.EXPERT_DATA),
        (ParallelMode.EXPERT_TENSOR_AND_EXPERT, ParallelMode.EXPERT_DATA),
        (ParallelMode.EXPERT_MODEL, ParallelMode.EXPERT_DATA),
    ]
    for lay in LAYOUTS:
        for a, b in pairs:
            # two groups share at most one rank <=> the ranks of an `a` group lie in distinct
            # `b` groups
            label = {r: i for i, g in enumerate(lay.groups(b)) for r in g}
            for ga in lay.groups(a):
                assert len({label[r] for r in ga}) == len(ga), (lay.describe(), a, b, ga)
        for rank in range(lay.world_size):
            ete = set(lay.group_of(ParallelMode.EXPERT_TENSOR_AND_EXPERT, rank))
            assert ete == {
                r
                for e in lay.group_of(ParallelMode.EXPERT, rank)
                for r in lay.group_of(ParallelMode.EXPERT_TENSOR, e)
            }
            model = set(lay.group_of(ParallelMode.EXPERT_MODEL, rank))
            assert model == {
                r
                for p in lay.group_of(ParallelMode.PIPELINE, rank)
                for r in lay.group_of(ParallelMode.EXPERT_TENSOR_AND_EXPERT, p)
            }


def test_expert_grid_resplits_each_pipeline_stage_with_the_same_order() -> None:
    for lay in LAYOUTS:
        strides = lay.strides("expert")
        for rank in range(lay.world_size):
            c = lay.coords(rank)
            # the pipeline coordinate is the same in both grids (stages hold the same ranks)
            stage_members = lay.group_of(ParallelMode.EXPERT_TENSOR_AND_EXPERT, rank) + lay.group_of(
                ParallelMode.EXPERT_DATA, rank
            )
            assert {lay.coords(r)["pp"] for r in stage_members} == {c["pp"]}
            # rank = sum(coord * stride) in the expert grid, strides from the same order string
            assert (
                rank
                == c["etp"] * strides["tp"]
                + c["ep"] * strides["ep"]
                + c["edp"] * strides["dp"]
                + c["pp"] * strides["pp"]
            )
        # cp is not an expert axis; an unnamed gtp_remat sits where Megatron 0.19 places it in
        # each grid (after ep here), not where `tokens` lists the unnamed axes (at the end)
        tokens = [t for t in lay.tokens if t not in ("cp", "gtp_remat")]
        assert [strides[t] for t in tokens] == sorted(strides[t] for t in tokens)


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "parts"),
    [
        (dict(world_size=8, tensor=2, expert=8), ["expert=8", "world_size=8", "16"]),
        (
            dict(world_size=12, pipeline=2, expert=4, expert_tensor=1),
            ["expert=4", "pipeline=2", "world_size=12"],
        ),
        (dict(world_size=8, expert=0), ["expert=0"]),
        (dict(world_size=8, expert_tensor=-1), ["expert_tensor=-1"]),
        (dict(world_size=8, expert=2, order="tp-dp-pp"), ["order='tp-dp-pp'", "'ep'", "expert size is 2"]),
        (
            dict(world_size=16, tensor=2, pipeline=2, expert=2, expert_tensor=2, order="tp-cp-ep-pp-dp"),
            ["'pp'", "expert-data size (2)", "data size (4)"],
        ),
    ],
)
def test_expert_errors_name_the_values(kwargs: dict[str, Any], parts: list[str]) -> None:
    world = kwargs.pop("world_size")
    with pytest.raises(LayoutError) as info:
        plan(world, **kwargs)
    for part in parts:
        assert part in str(info.value), (part, str(info.value))


# --------------------------------------------------------------------------- CLI
CLI_ARGS = [
    "plan",
    "--world-size",
    "16",
    "--tensor",
    "2",
    "--pipeline",
    "2",
    "--expert",
    "2",
    "--expert-tensor",
    "1",
    "--json",
]


def test_cli_plan_json_prints_expert_modes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(CLI_ARGS) == 0
    printed = json.loads(capsys.readouterr().out)
    layout = plan(16, tensor=2, pipeline=2, expert=2, expert_tensor=1)
    for mode in EXPERT_MODES:
        assert printed[mode.value] == layout.groups(mode)
    assert {"expert", "expert_tensor", "expert_data", "expert_tensor_and_expert", "expert_model"} <= set(
        printed
    )
    assert printed["expert_data"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_cli_expert_tensor_defaults_to_tensor(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--world-size", "8", "--tensor", "2", "--expert", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["expert_tensor"] == printed["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert printed["expert_data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_cli_bad_expert_size_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--world-size", "8", "--expert", "3"]) == 2
    assert "expert=3" in capsys.readouterr().err


def test_python_m_parallelctx_plan_expert_json() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "parallelctx", *CLI_ARGS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["expert_model"] == plan(16, tensor=2, pipeline=2, expert=2, expert_tensor=1).groups(
        "expert_model"
    )


# --------------------------------------------------------------------------- real ranks
def _expert_worker(out_dir: str) -> None:
    """Every rank: probe every mode's group by collectives, then an all-to-all token dispatch
    over the expert group, as an MoE layer does."""
    rank = gpc.get_global_rank()
    probed = probe_groups(gpc)
    group = gpc.get_group(ParallelMode.EXPERT)
    size = gpc.get_world_size(ParallelMode.EXPERT)
    send = torch.tensor([rank * 100 + j for j in range(size)], dtype=torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # expert-data gradient reduction: the sum of the global ranks of the expert-data group
    grad = torch.tensor([float(rank)])
    dist.all_reduce(grad, group=gpc.get_group(ParallelMode.EXPERT_DATA))
    views = {
        mode.value: [getattr(gpc, mode.value).rank, getattr(gpc, mode.value).size] for mode in EXPERT_MODES
    }
    result = {"rank": rank, "probed": probed, "a2a": recv.tolist(), "grad": grad.item(), "views": views}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def test_expert_groups_on_8_ranks(tmp_path: Path) -> None:
    parallel = dict(tensor=2, pipeline=2, expert=dict(size=2, tensor=1))
    parallelctx.spawn(
        _expert_worker,
        8,
        args=(str(tmp_path),),
        config=dict(parallel=parallel),
        backend="gloo",
        timeout=120,
        join_timeout=240,
    )
    layout = plan(8, tensor=2, pipeline=2, expert=2, expert_tensor=1)
    for rank in range(8):
        res = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert res["rank"] == rank
        assert problems(verify(layout, {rank: res["probed"]})) == []
        for mode in EXPERT_MODES:
            assert res["probed"][mode.value]["members"] == layout.group_of(mode, rank)
            assert res["views"][mode.value] == [layout.local_rank(mode, rank), layout.size(mode)]
        experts = layout.group_of(ParallelMode.EXPERT, rank)
        me = experts.index(rank)
        assert res["a2a"] == [src * 100 + me for src in experts]
        assert res["grad"] == float(sum(layout.group_of(ParallelMode.EXPERT_DATA, rank)))
