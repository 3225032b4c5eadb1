"""DeepSpeed with ``mpu=parallelctx.deepspeed.mpu()`` (make test-engines).

One real torchrun of 8 CPU ranks (tests/engine_deepspeed_train.py) launches gpc with tensor=2
and trains a tensor-parallel MLP through ``deepspeed.initialize`` under ZeRO stage 1, 2 and 3:
after 3 SGD steps every rank's shard equals the serial run (fp32, within 1e-6; each rank checks
its own and raises otherwise), DeepSpeed's data-parallel world is gpc's data group, and DeepSpeed
names its checkpoint files after gpc's model-parallel rank. Then ZeRO-2 again with tensor=2 ×
pipeline=2: four model-parallel ranks, four ``mp_rank_XX`` files; and ZeRO-2 and ZeRO-3 with
tensor=2 × context=2 in the order "cp-tp-dp-pp": DeepSpeed's sequence parallelism on gpc's context
group, partitioning and reducing over gpc's data × context group, ZeRO-3 built under
``parallelctx.deepspeed.zero_init`` with DeepSpeed's fp16-support answer forced each way. In the
same processes: the dtypes ``zero_init`` builds, and ``deepspeed.initialize`` refusing the wrong
ZeRO-3 builds by name (with the refusal switched off, such a model trains away from serial).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torchrun_helpers import run_torchrun

pytestmark = [pytest.mark.engines, pytest.mark.timeout(720)]  # a loaded machine: the run, not a hang
pytest.importorskip(
    "deepspeed", reason="the deepspeed extra is not installed (make test-engines installs it)"
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory the one torchrun of tests/engine_deepspeed_train.py wrote its files to."""
    out = tmp_path_factory.mktemp("deepspeed")
    proc = run_torchrun(8, ["tests/engine_deepspeed_train.py", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def records(run: Path) -> list[list[dict[str, Any]]]:
    """Every rank's records, rank order: one per ZeRO run."""
    return [json.loads(Path(run, f"rank-{r}.json").read_text()) for r in range(8)]


@pytest.fixture(scope="module")
def pipe(run: Path) -> list[dict[str, Any]]:
    """Every rank's pipeline checks (tensor=2 × pipeline=2, the default order), rank order."""
    return [json.loads(Path(run, f"rank-{r}-pipe.json").read_text()) for r in range(8)]


@pytest.fixture(scope="module")
def zero3(run: Path) -> list[dict[str, Any]]:
    """Every rank's ZeRO-3 checks (tensor=2 × context=2, "cp-tp-dp-pp"), rank order."""
    return [json.loads(Path(run, f"rank-{r}-zero3.json").read_text()) for r in range(8)]


def test_zero_1_2_3_with_tensor_2_equal_a_serial_run(records: list[list[dict[str, Any]]]) -> None:
    for rank, runs in enumerate(records):
        assert [r["stage"] for r in runs] == [1, 2, 3, 2, 2, 2, 3, 3]
        assert [r["built"] for r in runs[:3]] == ["plain", "plain", "zero_init"]
        for run in runs[:3]:
            assert run["layout"] == [2, 1, 4]
            assert run["steps"] == 3
            assert run["worst"] <= 1e-6, (rank, run)
            assert run["dp_world_size"] == 4  # DeepSpeed reduced over gpc's data group, not the world
            assert run["tensor_rank"] == rank % 2 and run["data_rank"] == rank // 2


def test_checkpoint_names_follow_gpcs_model_parallel_rank(records: list[list[dict[str, Any]]]) -> None:
    for rank, runs in enumerate(records):
        for run in runs[:3]:
            assert run["model_rank"] == rank % 2  # MODEL = TENSOR when pipeline=1
        zero2 = runs[1]
        assert [f for f in zero2["files"] if not f.startswith("zero_")] == [
            "mp_rank_00_model_states.pt",
            "mp_rank_01_model_states.pt",
        ]
        assert len([f for f in zero2["files"] if f.startswith("zero_pp_rank_")]) == 8  # 4 dp × 2 mp
        zero3 = runs[2]
        assert {f.split("_mp_rank_")[1][:2] for f in zero3["files"]} == {"00", "01"}
    # rank 0 and 1 (data rank 0) loaded the file named after their model rank: it holds their shard
    assert records[0][1]["checked_file"] and records[1][1]["checked_file"]


def test_model_parallel_rank_spans_tensor_and_pipeline(records: list[list[dict[str, Any]]]) -> None:
    # tensor=2 × pipeline=2 on 8 ranks, default order: MODEL groups [0,1,4,5] [2,3,6,7]
    expected = {0: 0, 1: 1, 4: 2, 5: 3, 2: 0, 3: 1, 6: 2, 7: 3}
    for rank, runs in enumerate(records):
        run = runs[4]
        assert run["layout"] == [2, 2, 2]
        assert run["model_rank"] == expected[rank]
        assert run["worst"] <= 1e-6
        assert [f for f in run["files"] if not f.startswith("zero_")] == [
            f"mp_rank_{i:02d}_model_states.pt" for i in range(4)
        ]


def test_clipping_sums_the_norm_over_gpcs_model_parallel_group(records: list[list[dict[str, Any]]]) -> None:
    # ZeRO-2 with gradient_clipping=0.05 (the serial norm is > 0.1 at every step): the clipped steps
    # equal the serial run's only if the norm covers both tensor shards once and b2 once
    for runs in records:
        run = runs[3]
        assert run["clip"] == 0.05 and run["layout"] == [2, 1, 4]
        assert run["worst"] <= 1e-6


def test_sequence_parallel_reduces_over_gpcs_data_context_group(records: list[list[dict[str, Any]]]) -> None:
    # "cp-tp-dp-pp" on 8 ranks (rank = c + 2t + 4d): DATA_CONTEXT [0,1,4,5] [2,3,6,7]. Each of
    # the 4 data × context ranks trained on its own rows with its loss over the context size: the
    # weights equal the serial run on all 16 rows only if DeepSpeed summed over the context ranks
    # and averaged over the data ranks, i.e. reduced over exactly gpc's DATA_CONTEXT group
    for rank, runs in enumerate(records):
        tensor_rank = (rank // 2) % 2
        for run, stage in zip(runs[5:], (2, 3, 3), strict=True):
            assert run["stage"] == stage and run["order"] == "cp-tp-dp-pp"
            assert run["layout"] == [2, 1, 2] and run["context"] == 2
            assert run["tensor_rank"] == tensor_rank and run["sequence_rank"] == rank % 2
            assert run["dp_world_size"] == 2 and run["seq_dp_world_size"] == 4
            assert run["partition_ranks"] == ([0, 1, 4, 5] if tensor_rank == 0 else [2, 3, 6, 7])
            assert run["worst"] <= 1e-6, (rank, run)


def test_zero_3_with_context_2_built_by_zero_init_equals_serial_whatever_fp16_support(
    records: list[list[dict[str, Any]]],
) -> None:
    # DeepSpeed 0.19.8's zero.Init builds bfloat16 on a CPU it thinks lacks fp16 (dtype= ignored);
    # zero_init builds float32 either way, partitioned over gpc's data × context group
    for rank, runs in enumerate(records):
        tensor_rank = (rank // 2) % 2
        assert [(r["built"], r["fp16_supported"]) for r in runs[6:]] == [
            ("zero_init", False),
            ("zero_init", True),
        ]
        for run in runs[6:]:
            assert run["param_dtypes"] == ["torch.float32"], (rank, run)
            assert run["partition_ranks"] == ([0, 1, 4, 5] if tensor_rank == 0 else [2, 3, 6, 7])
            assert run["worst"] <= 1e-6, (rank, run)


def test_zero_init_builds_the_dtype_asked_whatever_fp16_support(zero3: list[dict[str, Any]]) -> None:
    for rank, checks in enumerate(zero3):
        seen = checks["dtypes"]
        for fp16 in (False, True):
            for way in (
                "zero_init(config)",
                "zero_init(config, dtype=torch.float32)",
                "zero_init(dtype=torch.float32)",
            ):
                assert seen[f"{way} fp16={fp16}"] == "torch.float32", (rank, way, fp16)
            assert seen[f"zero_init(dtype=torch.bfloat16) fp16={fp16}"] == "torch.bfloat16", rank
        # the slip zero_init steers around, seen through the same forcing: DeepSpeed's own dtype=
        assert seen["zero.Init(dtype=torch.float32) fp16=False"] == "torch.bfloat16", rank
        assert seen["zero.Init(dtype=torch.float32) fp16=True"] == "torch.float32", rank
        # a dtype the config contradicts is refused, naming both and the fix
        assert "zero_init(dtype=torch.bfloat16): the config gives torch.float32" in seen["refused"]
        assert "enable its 'bf16' section" in seen["refused"]


def test_zero_3_with_context_refuses_a_model_not_built_under_zero_init(zero3: list[dict[str, Any]]) -> None:
    for rank, checks in enumerate(zero3):
        assert checks["accepted_context_1"]  # tensor=2, context 1: DATA is the data × context group
        tensor_rank = (rank // 2) % 2
        said = checks["refused"]["plain"]
        assert said.startswith("ZeRO-3 with context 2: parameter 'w1' was not built under zero.Init"), said
        data = [rank % 2 + 2 * tensor_rank, rank % 2 + 2 * tensor_rank + 4]  # rank = c + 2t + 4d
        context = [2 * tensor_rank + 4 * (rank // 4), 2 * tensor_rank + 4 * (rank // 4) + 1]
        assert f"over gpc's data group {data}" in said and f"context ranks {context}" in said, said
        assert "`with parallelctx.deepspeed.zero_init(config): model = ...`" in said
        # why it is refused, not warned: with the check off the same model trains away from serial
        unchecked = checks["unchecked"]
        assert unchecked["built"] == "plain" and unchecked["stage"] == 3
        assert unchecked["partition_ranks"] == data
        assert unchecked["worst"] > 1e-3, unchecked


def test_zero_3_refuses_parameters_partitioned_over_another_group(zero3: list[dict[str, Any]]) -> None:
    # built under DeepSpeed's own zero.Init, whose default group is the world: tensor shards would
    # be reduce-scattered together with the other tensor rank's
    for rank, checks in enumerate(zero3):
        tensor_rank = (rank // 2) % 2
        said = checks["refused"]["world"]
        want = [0, 1, 4, 5] if tensor_rank == 0 else [2, 3, 6, 7]
        assert said.startswith("ZeRO-3: parameter 'w1' is partitioned over ranks [0, 1, 2, 3, 4, 5, 6, 7]"), (
            said
        )
        assert f"not over gpc's data × context group {want}" in said, said
        assert "`with parallelctx.deepspeed.zero_init(config): model = ...`" in said


def test_a_shard_without_megatrons_mark_is_refused_when_clipping_and_warned_otherwise(
    zero3: list[dict[str, Any]],
) -> None:
    # DeepSpeed's norm counts an unmarked parameter once, as a replica: w1 (a shard) without its
    # mark would make every clipped step too large
    for checks in zero3:
        clipped, unclipped = checks["marks"]["clipped"], checks["marks"]["unclipped"]
        assert clipped.startswith("deepspeed.initialize with gradient_clipping=0.05: parameter 'w1'"), clipped
        assert "no tensor_model_parallel mark" in clipped and "p.tensor_model_parallel = True" in clipped
        assert unclipped.startswith("accepted; logged: parallelctx: parameter 'w1'"), unclipped
        assert unclipped.count("parameter 'w1'") == 1  # once per engine, though DeepSpeed asks 5 times
        assert "gradient_clipping is off" in unclipped


def test_clipping_with_pipeline_is_refused_where_deepspeed_counts_the_first_stage_alone(
    pipe: list[dict[str, Any]],
) -> None:
    # ZeRO-3 and float32 without ZeRO count an unmarked parameter on model-parallel rank 0 alone:
    # with pipeline 2, the second stage's b2 would be left out of every clipped step's norm
    for checks in pipe:
        for stage, how in (("zero0", "float32 without ZeRO"), ("zero3", "ZeRO-3")):
            said = checks["refused"][stage]
            assert said.startswith(f"DeepSpeed with gradient_clipping=0.05, {how} and pipeline=2:"), said
            assert "replicated parameters of stage 1 are left out of the norm" in said, said
            assert "use ZeRO stage 1 or 2" in said and "gradient_clipping=0.0" in said, said


def test_deepspeeds_pipeline_clipped_under_zero_1_equals_the_serial_clipped_run(
    pipe: list[dict[str, Any]],
) -> None:
    for rank, checks in enumerate(pipe):
        assert checks["stage_id"] == rank // 4  # gpc's pipeline rank (default order: pipeline slowest)
        assert checks["zero1_check"] == "accepted"
        assert checks["zero1_worst"] <= 1e-6, (rank, checks)
        assert checks["zero1_moved"] > 1e-3


def test_deepspeeds_pipeline_clipped_in_float32_without_zero_is_refused_and_would_train_wrong(
    pipe: list[dict[str, Any]],
) -> None:
    for rank, checks in enumerate(pipe):
        said = checks["zero0_check"]
        assert said.startswith(
            "DeepSpeed with gradient_clipping=0.05, float32 without ZeRO and pipeline=2"
        ), said
        assert "use zero_optimization.stage=1" in said, said
        # why refused: trained anyway, it equals the serial run clipped by the norm without the
        # second stage's b2 (DeepSpeed's rule), and not the serial run
        assert checks["zero0_vs_first_stage_rule"] <= 1e-6, (rank, checks)
        assert checks["zero0_worst"] > 1e-5, (rank, checks)


def test_check_pipe_engine_refuses_an_unmarked_shard_when_clipping(pipe: list[dict[str, Any]]) -> None:
    for checks in pipe:
        said = checks["unmarked_check"]
        assert said.startswith("deepspeed.initialize with gradient_clipping=0.05: parameter '"), said
        assert "w1' (shape [8, 8]) has no tensor_model_parallel mark" in said, said


def test_deepspeeds_process_topology_is_gpcs_layout_for_every_order() -> None:
    # process-free, against DeepSpeed's own ProcessTopology (tests/test_deepspeed_topology.py
    # checks the same rule without DeepSpeed): each rank's coordinates and DeepSpeed's groups
    import itertools

    from deepspeed.runtime.pipe.topology import ProcessTopology

    from parallelctx import ParallelMode
    from parallelctx.deepspeed import pipe_axes
    from parallelctx.planning.layout import Layout

    modes = {"pipe": ParallelMode.PIPELINE, "data": ParallelMode.DATA, "model": ParallelMode.TENSOR}
    for order in ("-".join(p) for p in itertools.permutations(["tp", "pp", "dp"])):
        for tensor, pipeline, data in ((2, 2, 2), (2, 4, 1), (1, 2, 4), (4, 2, 2), (2, 3, 2)):
            layout = Layout(tensor * pipeline * data, tensor=tensor, pipeline=pipeline, order=order)
            topo = ProcessTopology(*pipe_axes(layout))
            for rank in range(layout.world_size):
                coord = topo.get_coord(rank)
                for axis, mode in modes.items():
                    assert getattr(coord, axis) == layout.local_rank(mode, rank), (order, rank, axis)
            for axis, mode in modes.items():
                groups = sorted(sorted(g) for g in topo.get_axis_comm_lists(axis))
                want = sorted(sorted(int(r) for r in g) for g in layout.group_array(mode))
                assert groups == want, (order, axis)
