"""Run under torchrun (8 ranks): ZeRO stage 1, 2 and 3 through ``deepspeed.initialize(...,
mpu=parallelctx.deepspeed.mpu())`` with a tensor=2 model; each rank writes what it saw.

Then ZeRO-2 with the gradient norm clipped (the norm summed over gpc's model-parallel group),
ZeRO-2 again with tensor=2 × pipeline=2 (each pipeline stage a replica here: the
four model-parallel ranks name four checkpoint files), and ZeRO-2 and ZeRO-3 with tensor=2 ×
context=2 in the order "cp-tp-dp-pp" (DeepSpeed's sequence parallelism on gpc's context axis):
ZeRO-3 built under ``parallelctx.deepspeed.zero_init``, twice, with DeepSpeed's answer to "does
this CPU support fp16?" forced to False and to True. Then, in the same layout (a second file per
rank): the dtypes ``zero_init`` builds under either answer, the wrong ZeRO-3 builds
``deepspeed.initialize`` refuses, and what a model built without ``zero_init`` would have trained
(the refusal switched off).

In the tensor=2 × pipeline=2 layout (a third file per rank): ``deepspeed.initialize`` refusing
clipping under ZeRO-3 and under float32 without ZeRO (DeepSpeed's norm would count the first
stage's replicated parameters only), and DeepSpeed's own pipeline: two TPMLP blocks as two stages
of a ``PipelineModule`` built with ``topology=parallelctx.deepspeed.pipe_topology()``, trained by
``engine.train_batch`` with the gradient clipped, under ZeRO-1 (equal to the serial clipped run)
and without ZeRO (refused by ``check_pipe_engine``; trained anyway, it equals the serial run
clipped by the norm without the second stage's b2, and not the serial run).

Usage: torchrun --standalone --nproc-per-node 8 tests/engine_deepspeed_train.py OUT_DIR
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from engine_models import LR, ROWS, STEPS, TPMLP, batches, check_equals_serial, full_weights, my_share, shard

import parallelctx
import parallelctx.deepspeed
from parallelctx import ParallelMode, gpc
from parallelctx.deepspeed import DeepSpeedMPU, ZeroPartitionError, zero_init

CLIP = 0.05


def ds_config(stage: int, clip: float = 0.0) -> dict:
    """The DeepSpeed config of every run here (float32: no bf16 / fp16 section)."""
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
    }


@contextlib.contextmanager
def fp16_support(answer: bool | None) -> Iterator[None]:
    """Inside, DeepSpeed's accelerator answers ``answer`` to ``is_fp16_supported()`` (None: the CPU's
    own answer). DeepSpeed 0.19.8's zero.Init picks bfloat16 over an explicit dtype when it is False."""
    accelerator = get_accelerator()
    if answer is not None:
        accelerator.is_fp16_supported = lambda: answer
    try:
        yield
    finally:
        accelerator.__dict__.pop("is_fp16_supported", None)


class UncheckedMPU(DeepSpeedMPU):
    """gpc's mpu without the ZeRO-3 partition check: what a wrong build would have trained."""

    def get_sequence_data_parallel_group(self) -> object:
        return self._ctx.get_group(ParallelMode.DATA_CONTEXT)


def train(stage: int, out: Path, clip: float = 0.0, fp16: bool | None = None, checked: bool = True) -> dict:
    """Train 3 steps under ZeRO ``stage`` (gradient norm clipped to ``clip`` when > 0; DeepSpeed's
    fp16 answer forced to ``fp16`` unless None); save a DeepSpeed checkpoint; return this rank's
    record. ZeRO-3 with context > 1 builds the model under ``zero_init``; with ``checked`` False
    it builds it plainly and trains with the partition check off, without comparing (the
    record's ``worst`` says how far from the serial run it went)."""
    with fp16_support(fp16):
        return _train(stage, out, clip, fp16, checked)


def _train(stage: int, out: Path, clip: float, fp16: bool | None, checked: bool) -> dict:
    config = ds_config(stage, clip)
    built = "plain"
    if stage == 3 and checked:
        # ZeRO-3 partitions (and reduce-scatters) each parameter over the group it was made in:
        # DATA_CONTEXT (with sequence parallelism more than DATA), which zero_init gives, in
        # float32 whatever DeepSpeed thinks of the CPU's fp16 support (docs/engines.md)
        with zero_init(config, dtype=torch.float32 if fp16 is False else None):
            model = TPMLP()
        built = "zero_init"
    else:
        model = TPMLP()
    param_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    mpu = parallelctx.deepspeed.mpu() if checked else UncheckedMPU(gpc)
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
    worst = check_equals_serial(
        mine, atol=1e-6 if checked else math.inf, clip=clip or None, replicas=replicas
    )
    # where ZeRO partitions and reduces: ZeRO-3 each parameter's own group, ZeRO-1/2 the engine's
    group = params[0].ds_process_group if stage == 3 else engine.seq_data_parallel_group
    ckpt = out / f"zero{stage}-tp{gpc.tensor.size}-pp{gpc.pipeline.size}-cp{gpc.context.size}-clip{clip}"
    ckpt = ckpt.with_name(f"{ckpt.name}-fp16{fp16}-{built}")
    engine.save_checkpoint(str(ckpt), tag="t")
    dist.barrier()
    record = {
        "stage": stage,
        "clip": clip,
        "built": built,
        "fp16_supported": fp16,
        "param_dtypes": param_dtypes,
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
    accepted = accepts_a_plain_build()  # context 1: DeepSpeed partitions it over DATA = DATA_CONTEXT
    marks = unmarked_shard()
    # clipping: DeepSpeed sums the gradient norm over gpc's data and model-parallel groups
    records.append(train(2, out, clip=CLIP))
    # checkpoint names follow gpc's model-parallel rank (tensor × pipeline): 4 model shards here
    gpc.destroy()
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=2, pipeline=2), dist=dict(timeout=300)))
    records.append(train(2, out))
    pipe = {"refused": stage_norm_refusals(), **pipeline_runs()}
    Path(out, f"rank-{gpc.get_global_rank()}-pipe.json").write_text(json.dumps(pipe))
    # sequence parallelism = gpc's context axis, in an order where no group is a run of neighbours
    # (TENSOR [0,2] [1,3]..., CONTEXT [0,1] [2,3]..., DATA [0,4]..., DATA_CONTEXT [0,1,4,5] [2,3,6,7]):
    # ZeRO-2 and ZeRO-3 must partition and reduce over DATA_CONTEXT
    gpc.destroy()
    parallelctx.launch_from_torch(
        dict(parallel=dict(tensor=2, context=2, order="cp-tp-dp-pp"), dist=dict(timeout=300))
    )
    records += [train(2, out), train(3, out, fp16=False), train(3, out, fp16=True)]
    Path(out, f"rank-{gpc.get_global_rank()}.json").write_text(json.dumps(records))
    checks = {
        "accepted_context_1": accepted,
        "dtypes": zero_init_dtypes(),
        "refused": refusals(),
        "marks": marks,
    }
    checks["unchecked"] = train(3, out, checked=False)
    Path(out, f"rank-{gpc.get_global_rank()}-zero3.json").write_text(json.dumps(checks))
    gpc.destroy()


def zero_init_dtypes() -> dict[str, str]:
    """The parameter dtype each way of building under ZeRO-3 gives, with DeepSpeed's fp16 answer
    forced each way: ``zero_init`` with the float32 config, with no config and each ``dtype``, and
    DeepSpeed's own ``zero.Init(dtype=torch.float32)``; ``refused`` what zero_init says to a dtype
    its config contradicts."""
    config = ds_config(3)
    seen = {}
    for fp16 in (False, True):
        with fp16_support(fp16):
            ways = {
                "zero_init(config)": lambda: zero_init(config),
                "zero_init(config, dtype=torch.float32)": lambda: zero_init(config, dtype=torch.float32),
                "zero_init(dtype=torch.float32)": lambda: zero_init(dtype=torch.float32),
                "zero_init(dtype=torch.bfloat16)": lambda: zero_init(dtype=torch.bfloat16),
                "zero.Init(dtype=torch.float32)": lambda: deepspeed.zero.Init(
                    data_parallel_group=gpc.get_group(ParallelMode.DATA_CONTEXT), dtype=torch.float32
                ),
            }
            for way, init in ways.items():
                with init():
                    model = TPMLP()
                seen[f"{way} fp16={fp16}"] = ",".join(sorted({str(p.dtype) for p in model.parameters()}))
    try:
        zero_init(config, dtype=torch.bfloat16)
    except ValueError as exc:
        seen["refused"] = str(exc)
    return seen


def accepts_a_plain_build() -> bool:
    """Whether ``deepspeed.initialize`` under ZeRO-3 takes a model built without zero.Init."""
    model = TPMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config(3), mpu=parallelctx.deepspeed.mpu()
    )
    engine.destroy()
    return True


def unmarked_shard() -> dict[str, str]:
    """What ``deepspeed.initialize(..., mpu=...)`` (ZeRO-2, tensor=2) says to the MLP with w1's
    ``tensor_model_parallel`` mark taken off: with clipping (its norm would count w1 once), and
    without (the warning logged)."""
    import logging.handlers

    said = {}
    for key, clip in (("clipped", CLIP), ("unclipped", 0.0)):
        model = TPMLP()
        model.w1.tensor_model_parallel = False  # type: ignore[union-attr]
        handler = logging.handlers.BufferingHandler(100)
        logging.getLogger("parallelctx.deepspeed").addHandler(handler)
        try:
            engine, *_ = deepspeed.initialize(
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                config=ds_config(2, clip=clip),
                mpu=parallelctx.deepspeed.mpu(),
            )
            engine.destroy()
            said[key] = "accepted; logged: " + " | ".join(r.getMessage() for r in handler.buffer)
        except ValueError as exc:
            said[key] = str(exc)
        finally:
            logging.getLogger("parallelctx.deepspeed").removeHandler(handler)
    return said


def stage_norm_refusals() -> dict[str, str]:
    """What ``deepspeed.initialize(..., mpu=...)`` says to clipping with pipeline > 1 under ZeRO-3
    and under float32 without ZeRO (the TPMLP's b2 is replicated on every stage)."""
    said = {}
    for stage in (0, 3):
        model = TPMLP()
        try:
            engine, *_ = deepspeed.initialize(
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                config=ds_config(stage, clip=CLIP),
                mpu=parallelctx.deepspeed.mpu(),
            )
            engine.destroy()
            said[f"zero{stage}"] = "accepted"
        except ValueError as exc:
            said[f"zero{stage}"] = str(exc)
    return said


def serial_pipeline(replicas: int, clip: float, left_out: str = "") -> list[dict[str, torch.Tensor]]:
    """Two TPMLP blocks in a row (the whole model, the whole batch, in this process) after STEPS
    SGD steps, the gradient clipped to ``clip`` by the global norm of every weight but
    ``left_out`` (``"1.b2"``: the second block's b2); every step asserts it is clipped."""
    blocks = [{k: v.clone().requires_grad_(True) for k, v in full_weights().items()} for _ in range(2)]
    named = {f"{i}.{k}": v for i, block in enumerate(blocks) for k, v in block.items()}
    opt = torch.optim.SGD(list(named.values()), lr=LR)
    for x, y in batches(replicas):
        opt.zero_grad()
        h = x
        for w in blocks:
            h = F.linear(torch.tanh(F.linear(h, w["w1"], w["b1"])), w["w2"], w["b2"])
        F.mse_loss(h, y).backward()
        grads = {k: v.grad for k, v in named.items() if v.grad is not None}
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for k, g in grads.items() if k != left_out]))
        assert norm > 2 * clip, f"the gradient norm {norm} is not clipped by {clip}"
        coef = min(1.0, clip / (float(norm) + 1e-6))  # DeepSpeed's and torch's rule
        for g in grads.values():
            g.mul_(coef)
        opt.step()
    return [{k: v.detach() for k, v in block.items()} for block in blocks]


@contextlib.contextmanager
def unchecked_pipeline_engine() -> Iterator[None]:
    """Inside, DeepSpeed's PipelineEngine is built without parallelctx's check (its own
    ``__init__``, which the guard wrapped, put back), to train what the check refuses."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    guarded = PipelineEngine.__init__
    PipelineEngine.__init__ = guarded.__wrapped__  # type: ignore[attr-defined, method-assign]
    try:
        yield
    finally:
        PipelineEngine.__init__ = guarded  # type: ignore[method-assign]


def pipeline_runs() -> dict[str, object]:
    """DeepSpeed's PipelineModule on gpc's layout, clipped: ZeRO-1 (accepted by the check
    ``deepspeed.initialize`` now runs, compared with the serial clipped run), no ZeRO (refused
    at ``deepspeed.initialize``; built without the check and trained anyway), and
    check_pipe_engine on the ZeRO-1 engine with w1's mark taken off."""
    from parallelctx.deepspeed import check_pipe_engine

    seen: dict[str, object] = {}
    for stage in (1, 0):
        model = PipelineModule(
            [TPMLP(), TPMLP()],
            topology=parallelctx.deepspeed.pipe_topology(),
            loss_fn=F.mse_loss,
            partition_method="uniform",
        )
        config = ds_config(stage, clip=CLIP)
        config.update(train_micro_batch_size_per_gpu=ROWS // 2, gradient_accumulation_steps=2)
        build = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=LR), "config": config}
        try:  # parallelctx checks the PipelineEngine as deepspeed.initialize builds it
            engine, *_ = deepspeed.initialize(**build)
            seen[f"zero{stage}_check"] = "accepted"
        except ValueError as exc:
            seen[f"zero{stage}_check"] = str(exc)
            with unchecked_pipeline_engine():  # the refused engine, built anyway, to show why
                engine, *_ = deepspeed.initialize(**build)
        for batch in batches(gpc.data.size):  # this data rank's rows, in 2 micro-batches
            x, y = my_share(batch, gpc.data.rank)
            engine.train_batch(iter([(x[: ROWS // 2], y[: ROWS // 2]), (x[ROWS // 2 :], y[ROWS // 2 :])]))
        mine = {n.split(".")[-1]: p.detach() for n, p in engine.module.named_parameters()}
        stage_id = engine.grid.get_stage_id()
        seen["stage_id"] = stage_id
        for key, left_out in (("worst", ""), ("vs_first_stage_rule", "1.b2")):
            whole = serial_pipeline(gpc.data.size, CLIP, left_out)[stage_id]
            want = shard(whole, gpc.tensor.rank, gpc.tensor.size)
            seen[f"zero{stage}_{key}"] = max(float((mine[n] - want[n]).abs().max()) for n in want)
        start = shard(full_weights(), gpc.tensor.rank, gpc.tensor.size)
        seen[f"zero{stage}_moved"] = max(float((mine[n] - start[n]).abs().max()) for n in start)
        if stage == 1:
            w1 = next(p for n, p in engine.module.named_parameters() if n.endswith("w1"))
            w1.tensor_model_parallel = False
            try:
                check_pipe_engine(engine)
                seen["unmarked_check"] = "accepted"
            except ValueError as exc:
                seen["unmarked_check"] = str(exc)
            w1.tensor_model_parallel = True
        engine.destroy()
    return seen


def refusals() -> dict[str, str]:
    """What ``deepspeed.initialize(..., mpu=parallelctx.deepspeed.mpu())`` under ZeRO-3 says to a
    model built without zero.Init and to one built under zero.Init over the whole world."""
    config = ds_config(3)
    said = {}
    for way in ("plain", "world"):
        if way == "plain":
            model = TPMLP()
        else:
            with deepspeed.zero.Init(config_dict_or_path=config):  # DeepSpeed's default group: the world
                model = TPMLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            deepspeed.initialize(
                model=model, optimizer=optimizer, config=config, mpu=parallelctx.deepspeed.mpu()
            )
            said[way] = "accepted"
        except ZeroPartitionError as exc:
            said[way] = str(exc)
    return said


if __name__ == "__main__":
    main()
