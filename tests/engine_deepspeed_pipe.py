"""Run under torchrun (8 ranks, DS_ACCELERATOR=cpu): DeepSpeed's PipelineModule on gpc's layout
tensor 2 × pipeline 2 × data 2 in the order ``"tp-pp-dp"`` (DeepSpeed's default places these
ranks elsewhere). Each rank writes a record.

Usage: torchrun --standalone --nproc-per-node 8 tests/engine_deepspeed_pipe.py OUT_DIR

1. ``PipelineModule(layers, num_stages=2)`` (DeepSpeed's own topology) and one with DeepSpeed's
   ``PipeModelDataParallelTopology`` are refused (the text is recorded).
2. Two tensor-parallel MLP blocks written as a user writes them (column-parallel then
   row-parallel, the reduce in the forward, so each stage's output is replicated over the tensor
   group as at Megatron's stage boundaries), one per stage, built with
   ``topology=parallelctx.deepspeed.pipe_topology()``, trained by ``engine.train_batch`` for
   ``STEPS`` SGD steps (2 micro-batches of 4 rows per data rank, its rows by gpc's data rank):
   this rank's stage equals the same stage of the serial run (whole model, whole batch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from torch import nn
from user_tp_model import HIDDEN, MLP, ROWS, STEPS

import parallelctx
import parallelctx.deepspeed
from parallelctx import ParallelMode, gpc
from parallelctx.deepspeed import PipeTopologyError

MICRO = ROWS // 2
LR = 0.01
WIDTH = 6


def block(seed: int, part: int = 0, parts: int = 1) -> MLP:
    """One pipeline stage: the user-style MLP WIDTH in and out, its weights from ``seed``. Its
    output is summed over gpc's tensor group, so it is the same on every tensor rank, as at
    Megatron's stage boundaries (DeepSpeed's pipeline splits it over the tensor ranks to send it)."""
    return MLP(part, parts, seed=seed, sizes=(WIDTH, HIDDEN, WIDTH), scale=0.5)


def data(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of ``replicas * ROWS`` rows, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(replicas * ROWS, WIDTH, generator=g), torch.randn(replicas * ROWS, WIDTH, generator=g))
            for _ in range(STEPS)]  # fmt: skip


def serial(replicas: int) -> tuple[list[MLP], list[float]]:
    """Both blocks trained on the whole batch in this process: (blocks, losses)."""
    blocks = [block(10), block(11)]
    model = nn.Sequential(*blocks)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in data(replicas):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return blocks, losses


def refused(build: Any) -> str:
    """The PipeTopologyError text ``build()`` raised ('' when it did not raise)."""
    try:
        build()
    except PipeTopologyError as exc:
        return str(exc)
    return ""


def main() -> None:
    out = Path(sys.argv[1])
    parallelctx.launch_from_torch(
        dict(parallel=dict(tensor=2, pipeline=2, order="tp-pp-dp"), dist=dict(timeout=300))
    )
    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule asks deepspeed.comm: gpc's world
    record: dict[str, Any] = {
        "rank": gpc.get_global_rank(),
        "tensor": gpc.tensor.rank,
        "pipeline": gpc.get_local_rank(ParallelMode.PIPELINE),
        "data": gpc.data.rank,
    }
    record["default_refused"] = refused(lambda: PipelineModule([block(10), block(11)], num_stages=2))
    record["megatron_topology_refused"] = refused(
        lambda: PipelineModule([block(10), block(11)], topology=PipeModelDataParallelTopology(2, 2, 2))
    )
    topology = parallelctx.deepspeed.pipe_topology()
    record["axes"] = list(topology.get_axis_names())
    model = PipelineModule(
        [block(10, gpc.tensor.rank, gpc.tensor.size), block(11, gpc.tensor.rank, gpc.tensor.size)],
        topology=topology,
        loss_fn=nn.functional.mse_loss,
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ROWS // MICRO,
        "train_batch_size": ROWS * gpc.data.size,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=LR), config=config)
    grid = engine.grid
    record["deepspeed"] = {
        "stage": grid.get_stage_id(),
        "data": grid.get_data_parallel_id(),
        "dp_group": sorted(grid.dp_group),
        "pp_group": sorted(grid.pp_group),
    }
    record["gpc"] = {
        "dp_group": gpc.get_ranks_in_group(ParallelMode.DATA),
        "pp_group": gpc.get_ranks_in_group(ParallelMode.PIPELINE),
    }
    losses = []
    for x, y in data(gpc.data.size):
        d = gpc.data.rank
        mine = [
            (x[d * ROWS + i : d * ROWS + i + MICRO], y[d * ROWS + i : d * ROWS + i + MICRO])
            for i in (0, MICRO)
        ]
        losses.append(float(engine.train_batch(iter(mine))))
    blocks, serial_losses = serial(gpc.data.size)
    whole = blocks[grid.get_stage_id()]
    rows = slice(gpc.tensor.rank * HIDDEN // 2, (gpc.tensor.rank + 1) * HIDDEN // 2)
    want = {"w1": whole.w1[rows], "b1": whole.b1[rows], "w2": whole.w2[:, rows], "b2": whole.b2}
    mine_params = {n.split(".")[-1]: p for n, p in engine.module.named_parameters()}
    record["names"] = sorted(mine_params)
    record["worst"] = max(float((mine_params[n].detach() - w.detach()).abs().max()) for n, w in want.items())
    start = block(10 + grid.get_stage_id(), gpc.tensor.rank, gpc.tensor.size)
    record["moved"] = max(
        float((mine_params[n].detach() - p.detach()).abs().max()) for n, p in start.named_parameters()
    )
    record["serial_losses"] = serial_losses
    record["losses"] = losses
    record["steps"] = STEPS
    Path(out, f"rank-{record['rank']}.json").write_text(json.dumps(record))
    dist.barrier()
    gpc.destroy()


if __name__ == "__main__":
    main()
