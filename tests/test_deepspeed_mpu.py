"""parallelctx.deepspeed.mpu(): every answer DeepSpeed asks for is gpc's, proved by collectives;
check_zero_partitions and zero_init's refusals.

DeepSpeed itself is not needed here (the object imports nothing from it); the training runs under
``deepspeed.initialize`` and zero_init's builds are in tests/test_engine_deepspeed.py (make
test-engines).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from parallelctx import ParallelMode, gpc
from parallelctx.deepspeed import DeepSpeedMPU, ZeroPartitionError, check_zero_partitions, mpu, zero_init
from parallelctx.views import NotLaunchedError

M = ParallelMode
FAMILIES = {
    "model": M.MODEL,
    "tensor_model": M.TENSOR,
    "pipeline_model": M.PIPELINE,
    "data": M.DATA,
    "sequence": M.CONTEXT,
    "sequence_data": M.DATA_CONTEXT,
}


def _members(group: object) -> list[int]:
    """The global ranks of ``group``, by an all-gather over it."""
    me = torch.tensor([dist.get_rank()])
    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]  # type: ignore[arg-type]
    dist.all_gather(out, me, group=group)  # type: ignore[arg-type]
    return sorted(int(t) for t in out)


@pytest.mark.parallel(
    world_size=8,
    layouts=[
        dict(tensor=2, pipeline=2),
        dict(tensor=2, context=2),
        # InternLM's order (data outermost) and every axis at once, in an order where no group is
        # a run of neighbouring ranks: DeepSpeed must get gpc's groups, not Megatron's arithmetic
        dict(tensor=2, pipeline=2, order="tp-pp-dp"),
        dict(tensor=2, pipeline=2, context=2, order="cp-tp-dp-pp"),
    ],
)
@pytest.mark.slow
def test_every_getter_answers_from_gpcs_groups() -> None:
    unit = mpu()
    for family, mode in FAMILIES.items():
        group = getattr(unit, f"get_{family}_parallel_group")()
        size = getattr(unit, f"get_{family}_parallel_world_size")()
        rank = getattr(unit, f"get_{family}_parallel_rank")()
        members = _members(group)
        assert members == gpc.get_ranks_in_group(mode), family
        assert size == len(members) == gpc.get_world_size(mode), family
        assert members[rank] == gpc.get_global_rank(), family
    assert unit.get_model_parallel_world_size() == gpc.tensor.size * gpc.pipeline.size
    assert unit.get_tensor_model_parallel_src_rank() == gpc.get_ranks_in_group(M.TENSOR)[0]
    assert unit.get_data_parallel_group_ranks() == gpc.get_ranks_in_group(M.DATA)
    # what ZeRO partitions over: data × context
    assert unit.get_sequence_data_parallel_world_size() == gpc.data.size * gpc.context.size


def test_it_is_not_taken_for_deepspeeds_own_sequence_parallel_helper() -> None:
    # DeepSpeed treats an mpu with initialize_sequence_parallel as its SP helper and then gives
    # ZeRO no data-parallel group (deepspeed/utils/groups.py, runtime/zero/stage_1_and_2.py)
    assert not hasattr(DeepSpeedMPU, "initialize_sequence_parallel")


def test_before_launch_it_says_so() -> None:
    with pytest.raises(NotLaunchedError):
        mpu()


@pytest.mark.parallel(world_size=2, tensor=2)
def test_after_destroy_it_refuses_to_answer() -> None:
    unit = mpu()
    assert unit.get_tensor_model_parallel_world_size() == 2
    assert repr(unit).startswith("DeepSpeedMPU(")
    gpc.destroy()
    with pytest.raises(NotLaunchedError):
        unit.get_data_parallel_group()
    # a repr never raises: a log line, a debugger or a traceback's locals may print the object
    assert repr(unit) == "DeepSpeedMPU(not launched)"


def _zero_model(group: object) -> torch.nn.Linear:
    """A model whose parameters carry what deepspeed.zero.Init leaves on them, over ``group``."""
    model = torch.nn.Linear(2, 2)
    for i, p in enumerate(model.parameters()):
        p.ds_id = i  # type: ignore[attr-defined]
        p.ds_process_group = group  # type: ignore[attr-defined]
    return model


# tensor 2 × context 2 on 4 ranks ("cp-tp-dp-pp", rank = c + 2t): DATA_CONTEXT = CONTEXT [0,1] [2,3],
# DATA one rank; tensor 2 alone: DATA_CONTEXT = DATA [0,2] [1,3]
@pytest.mark.parallel(world_size=4, layouts=[dict(tensor=2, context=2, order="cp-tp-dp-pp"), dict(tensor=2)])
def test_check_zero_partitions_wants_gpcs_data_context_group() -> None:
    want = gpc.get_ranks_in_group(M.DATA_CONTEXT)
    check_zero_partitions(_zero_model(gpc.get_group(M.DATA_CONTEXT)))  # zero_init's group: accepted
    with pytest.raises(ZeroPartitionError) as refused:  # zero.Init's default group: the world
        check_zero_partitions(_zero_model(dist.group.WORLD))
    assert str(refused.value).startswith("ZeRO-3: parameter 'weight' is partitioned over ranks [0, 1, 2, 3]")
    assert f"not over gpc's data × context group {want}" in str(refused.value)
    assert "`with parallelctx.deepspeed.zero_init(config): model = ...`" in str(refused.value)
    expert = _zero_model(dist.group.WORLD)
    for p in expert.parameters():
        p.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed-MoE's mark: its own groups
    check_zero_partitions(expert)
    plain = torch.nn.Linear(2, 2)  # not built under zero.Init
    if gpc.context.size == 1:
        check_zero_partitions(plain)  # DeepSpeed partitions it over DATA, which is DATA_CONTEXT here
        return
    with pytest.raises(ZeroPartitionError) as refused:
        check_zero_partitions(plain)
    assert str(refused.value).startswith(
        "ZeRO-3 with context 2: parameter 'weight' was not built under zero.Init, so DeepSpeed would "
        f"partition it over gpc's data group [{gpc.get_global_rank()}] and never reduce its gradient "
        f"over the context ranks {gpc.get_ranks_in_group(M.CONTEXT)}"
    )


def test_zero_init_refuses_what_it_sets_itself_and_unknown_dtypes() -> None:
    with pytest.raises(
        TypeError, match=r"zero_init\(\) sets data_parallel_group itself .* deepspeed.zero.Init directly"
    ):
        zero_init(data_parallel_group=None)
    with pytest.raises(ValueError, match=r"zero_init\(dtype=torch.int8\): ZeRO-3 builds torch.float32"):
        zero_init(dtype=torch.int8)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="DeepSpeed is installed")
@pytest.mark.parallel(world_size=2, tensor=2)
def test_zero_init_without_deepspeed_names_the_extra() -> None:
    with pytest.raises(ImportError, match=r"needs DeepSpeed .*install the optional extra 'deepspeed'"):
        zero_init()
