"""Run under torchrun (8 ranks): ZeRO stage 1, 2 and 3 through ``deepspeed.initialize(...,
mpu=parallelctx.deepspeed.mpu())`` with a tensor=2 model; each rank writes what it saw.

Then ZeRO-2 with the gradient norm clipped (the norm summed over gpc's model-parallel group),
ZeRO-2 again with tensor=2 × pipeline=2 (each pipeline stage a replica here: the
four model-parallel ranks name four checkpoint files), and ZeRO-2 and ZeRO-3 with tensor=2 ×
context=2 in the order "cp-tp-dp-pp" (DeepSpeed's sequence parallelism on gpc's context axis).

Usage: torchrun --standalone --nproc-per-node 8 tests/engine_deepspeed_train.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_models import STEPS, TPMLP, batches, check_equals_serial, my_share

import parallelctx
import parallelctx.deepspeed
from parallelctx import ParallelMode, gpc

CLIP = 0.05


def train(stage: int, out: Path, clip: float = 0.0) -> dict:
    """Train 3 steps under ZeRO ``stage`` (gradient norm clipped to ``clip`` when > 0); save a
    DeepSpeed checkpoint; return this rank's record."""
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
    }
    if stage == 3 and gpc.context.size > 1:
        # ZeRO-3 partitions (and reduce-scatters) each parameter over the group it was made in,
        # mpu.get_data_parallel_group() (DATA) unless built under zero.Init with another: with
        # sequence parallelism that must be DATA_CONTEXT (docs/engines.md). The config, not
        # dtype=torch.float32, gives the dtype: DeepSpeed 0.19.8's zero.Init turns an explicit
        # dtype into bfloat16 on a CPU without mkldnn fp16 (an AMD EPYC here)
        with deepspeed.zero.Init(
            data_parallel_group=gpc.get_group(ParallelMode.DATA_CONTEXT), config_dict_or_path=config
        ):
            model = TPMLP()
    else:
        model = TPMLP()
    mpu = parallelctx.deepspeed.mpu()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    assert engine.dp_world_size == gpc.data.size, (engine.dp_world_size, gpc.data.size)
    assert engine.mp_world_size == gpc.get_world_size(ParallelMode.MODEL)
    # each of the data × context ranks takes its own rows: the step is the serial one on the whole
    # batch only if DeepSpeed reduces over gpc's DATA_CONTEXT group (over DATA alone the context
    # ranks would drift apart). ZeRO-1/2 (Ulysses' rule) sum over the sequence-parallel ranks and
    # average over the data ranks, so each loss is divided by the context size; ZeRO-3's
    # reduce-scatter averages over all data × context ranks (DeepSpeed 0.19.8, stage3.py)
    replicas = gpc.get_world_size(ParallelMode.DATA_CONTEXT)
    loss_scale = gpc.context.size if stage < 3 else 1
    for batch in batches(replicas):
        x, y = my_share(batch, gpc.get_local_rank(ParallelMode.DATA_CONTEXT))
        loss = F.mse_loss(engine(x), y) / loss_scale
        engine.backward(loss)
        engine.step()
    names = [n for n, _ in engine.module.named_parameters()]
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        mine = {n: p.detach().clone() for n, p in zip(names, params)}
    worst = check_equals_serial(mine, clip=clip or None, replicas=replicas)
    # where ZeRO partitions and reduces: ZeRO-3 each parameter's own group, ZeRO-1/2 the engine's
    group = params[0].ds_process_group if stage == 3 else engine.seq_data_parallel_group
    ckpt = out / f"zero{stage}-tp{gpc.tensor.size}-pp{gpc.pipeline.size}-cp{gpc.context.size}-clip{clip}"
    engine.save_checkpoint(str(ckpt), tag="t")
    dist.barrier()
    record = {
        "stage": stage,
        "clip": clip,
        "layout": [gpc.tensor.size, gpc.pipeline.size, gpc.data.size],
        "context": gpc.context.size,
        "order": gpc.config.parallel.order,
        "sequence_rank": mpu.get_sequence_parallel_rank(),
        "seq_dp_world_size": engine.seq_dp_world_size,
        "partition_ranks": sorted(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))),
        "steps": STEPS,
        "worst": worst,
        "files": sorted(p.name for p in (ckpt / "t").iterdir()),
        "model_rank": mpu.get_model_parallel_rank(),
        "tensor_rank": gpc.tensor.rank,
        "data_rank": gpc.data.rank,
        "dp_world_size": engine.dp_world_size,
    }
    if (
        stage == 2 and gpc.data.rank == 0 and gpc.pipeline.size == 1
    ):  # the file named after gpc's model-parallel rank holds its shard
        state = torch.load(
            ckpt / "t" / f"mp_rank_{record['model_rank']:02d}_model_states.pt", weights_only=False
        )
        for name, value in mine.items():
            torch.testing.assert_close(state["module"][name], value, rtol=0, atol=0)
        record["checked_file"] = True
    engine.destroy()
    return record


def main() -> None:
    out = Path(sys.argv[1])
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=2), dist=dict(timeout=300)))
    records = [train(stage, out) for stage in (1, 2, 3)]
    # clipping: DeepSpeed sums the gradient norm over gpc's data and model-parallel groups
    records.append(train(2, out, clip=CLIP))
    # checkpoint names follow gpc's model-parallel rank (tensor × pipeline): 4 model shards here
    gpc.destroy()
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=2, pipeline=2), dist=dict(timeout=300)))
    records.append(train(2, out))
    # sequence parallelism = gpc's context axis, in an order where no group is a run of neighbours
    # (TENSOR [0,2] [1,3]..., CONTEXT [0,1] [2,3]..., DATA [0,4]..., DATA_CONTEXT [0,1,4,5] [2,3,6,7]):
    # ZeRO-2 and ZeRO-3 must partition and reduce over DATA_CONTEXT
    gpc.destroy()
    parallelctx.launch_from_torch(
        dict(parallel=dict(tensor=2, context=2, order="cp-tp-dp-pp"), dist=dict(timeout=300))
    )
    records += [train(stage, out) for stage in (2, 3)]
    Path(out, f"rank-{gpc.get_global_rank()}.json").write_text(json.dumps(records))
    gpc.destroy()


if __name__ == "__main__":
    main()
