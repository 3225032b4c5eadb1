"""Run under torchrun (4 ranks): Lightning Fabric creates the default group (``fabric.launch()``
with the DDP strategy on CPU), gpc adopts it with tensor=2 (so data=2), and the tensor-parallel
MLP trains with Fabric's optimizer wrapper and ``fabric.backward``; the model is wrapped in DDP
over gpc's data group by the user (the recipe of docs/engines.md; ``fabric.setup(model)``, which
parallelctx makes right, is tests/engine_guarded_train.py's). Each rank writes what it saw.

Usage: torchrun --standalone --nproc-per-node 4 tests/engine_lightning_train.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_models import TPMLP, batches, check_equals_serial, my_share
from lightning.fabric import Fabric
from torch.nn.parallel import DistributedDataParallel

import parallelctx
from parallelctx import ParallelMode, gpc


def main() -> None:
    out = Path(sys.argv[1])
    fabric = Fabric(accelerator="cpu", devices=4, strategy="ddp")
    fabric.launch()
    assert dist.is_initialized() and fabric.world_size == 4
    fabrics_group = dist.group.WORLD
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=2), dist=dict(timeout=300)))
    adopted = gpc.get_group(ParallelMode.GLOBAL) is fabrics_group
    model = DistributedDataParallel(TPMLP(), process_group=gpc.get_group(ParallelMode.DATA))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in batches(gpc.data.size):
        x, y = my_share(batch, gpc.data.rank)
        opt.zero_grad()
        fabric.backward(F.mse_loss(model(x), y))
        opt.step()
    worst = check_equals_serial({n: p.detach() for n, p in model.module.named_parameters()})
    record = {
        "rank": gpc.get_global_rank(),
        "fabric_rank": fabric.global_rank,
        "tensor": [gpc.tensor.rank, gpc.tensor.size],
        "data": [gpc.data.rank, gpc.data.size],
        "worst": worst,
        "adopted": adopted,
    }
    del model
    gpc.destroy()
    t = torch.ones(1)
    dist.all_reduce(t)  # Fabric's group is still there: gpc did not make it, so it keeps it
    record["after_destroy"] = {"initialized": dist.is_initialized(), "world_sum": t.item()}
    fabric.barrier()
    Path(out, f"rank-{record['rank']}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
