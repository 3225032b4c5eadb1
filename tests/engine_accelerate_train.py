"""Run under torchrun (4 ranks): Hugging Face Accelerate creates the default group
(``Accelerator(cpu=True)``), gpc adopts it with tensor=2 (so data=2), and the tensor-parallel MLP
trains with Accelerate's optimizer wrapper and ``accelerator.backward``; the model is wrapped in
DDP over gpc's data group by the user, because ``accelerator.prepare(model)`` would wrap it in DDP
over every process (parallelctx refuses it: tests/engine_guarded_train.py). Each rank writes what
it saw.

Usage: torchrun --standalone --nproc-per-node 4 tests/engine_accelerate_train.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from engine_models import TPMLP, batches, check_equals_serial, my_share
from torch.nn.parallel import DistributedDataParallel

import parallelctx
from parallelctx import ParallelMode, gpc


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    assert dist.is_initialized() and accelerator.num_processes == 4
    accelerates_group = dist.group.WORLD
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=2), dist=dict(timeout=300)))
    adopted = gpc.get_group(ParallelMode.GLOBAL) is accelerates_group
    model = DistributedDataParallel(TPMLP(), process_group=gpc.get_group(ParallelMode.DATA))
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in batches(gpc.data.size):
        x, y = my_share(batch, gpc.data.rank)
        opt.zero_grad()
        accelerator.backward(F.mse_loss(model(x), y))
        opt.step()
    worst = check_equals_serial({n: p.detach() for n, p in model.module.named_parameters()})
    record = {
        "rank": gpc.get_global_rank(),
        "accelerate_rank": accelerator.process_index,
        "tensor": [gpc.tensor.rank, gpc.tensor.size],
        "data": [gpc.data.rank, gpc.data.size],
        "worst": worst,
        "adopted": adopted,
    }
    del model
    gpc.destroy()
    t = torch.ones(1)
    dist.all_reduce(t)  # Accelerate's group is still there: gpc did not make it, so it keeps it
    record["after_destroy"] = {"initialized": dist.is_initialized(), "world_sum": t.item()}
    accelerator.wait_for_everyone()
    Path(out, f"rank-{record['rank']}.json").write_text(json.dumps(record))
    accelerator.end_training()  # Accelerate tears its own group down
    assert not dist.is_initialized()


if __name__ == "__main__":
    main()
