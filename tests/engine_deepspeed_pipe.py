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
from user_tp_model import HIDDEN, ROWS, STEPS, _AllReduce, _Copy

import parallelctx
import parallelctx.deepspeed
from parallelctx import ParallelMode, gpc
from parallelctx.deepspeed import PipeTopologyError

MICRO = ROWS // 2
LR = 0.01
WIDTH = 6


class Block(nn.Module):
    """``relu(x w1ᵀ + b1) w2ᵀ + b2``, WIDTH in and out, w1 and b1 split by rows and w2 by
    columns over ``parts`` tensor ranks (marked), b2 replicated; the partial outputs summed over
    gpc's tensor group, so a stage's output is the same on every tensor rank, as at Megatron's
    stage boundaries (DeepSpeed's pipeline splits it over the tensor ranks to send it)."""

    def __init__(self, seed: int, part: int = 0, parts: int = 1) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w1, b1 = torch.randn(HIDDEN, WIDTH, generator=g) / 2, torch.randn(HIDDEN, generator=g)
        w2, b2 = torch.randn(WIDTH, HIDDEN, generator=g) / 2, torch.randn(WIDTH, generator=g)
        rows = slice(part * HIDDEN // parts, (part + 1) * HIDDEN // parts)
        self.w1, self.b1 = nn.Parameter(w1[rows].clone()), nn.Parameter(b1[rows].clone())
        self.w2, self.b2 = nn.Parameter(w2[:, rows].clone()), nn.Parameter(b2.clone())
        self.sharded = parts > 1
        if self.sharded:
            for p in (self.w1, self.b1, self.w2):
                p.tensor_model_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sharded:
            x = _Copy.apply(x)
        y = torch.relu(x @ self.w1.T + self.b1) @ self.w2.T
        if self.sharded:
            y = _AllReduce.apply(y)
        return y + self.b2


def data(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of ``replicas * ROWS`` rows, the same on every rank."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(replicas * ROWS, WIDTH, generator=g), torch.randn(replicas * ROWS, WIDTH, generator=g))
            for _ in range(STEPS)]  # fmt: skip


def serial(replicas: int) -> tuple[list[Block], list[float]]:
    """Both blocks trained on the whole batch in this process: (blocks, losses)."""
    blocks = [Block(10), Block(11)]
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
    record["default_refused"] = refused(lambda: PipelineModule([Block(10), Block(11)], num_stages=2))
    record["megatron_topology_refused"] = refused(
        lambda: PipelineModule([Block(10), Block(11)], topology=PipeModelDataParallelTopology(2, 2, 2))
    )
    topology = parallelctx.deepspeed.pipe_topology()
    record["axes"] = list(topology.get_axis_names())
    model = PipelineModule(
        [Block(10, gpc.tensor.rank, gpc.tensor.size), Block(11, gpc.tensor.rank, gpc.tensor.size)],
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
    record["moved"] = max(float((mine_params[n].detach() - w.detach()).abs().max()) for n, w in
                          {k: v for k, v in Block(10 + grid.get_stage_id(), gpc.tensor.rank, 2).named_parameters()}.items())  # fmt: skip
    record["serial_losses"] = serial_losses
    record["losses"] = losses
    record["steps"] = STEPS
    Path(out, f"rank-{record['rank']}.json").write_text(json.dumps(record))
    dist.barrier()
    gpc.destroy()


if __name__ == "__main__":
    main()
