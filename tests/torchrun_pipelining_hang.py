"""Run under torchrun by tests/test_hang.py: ``torchrun --nproc-per-node 4 tests/torchrun_pipelining_hang.py OUT``.

A user's training loop with torch.distributed.pipelining (pipeline 4, one linear layer per
stage, ``ScheduleGPipe`` with 4 micro-batches, forward and backward). The stage-2 rank stops
after the first step (an early stop decided on one rank: its own loss, its own data): in the
second step its neighbours wait for it in the schedule's point-to-point calls.
``dist.hang_report.after`` is 2 s; each rank that reports writes its report and ends its
process. Writes OUT/rank-<R>.json: the rank's stage, its pipeline neighbours and its reports.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torchrun_helpers import hang_report_row

from parallelctx import ParallelMode, gpc, launch_from_torch

out = Path(sys.argv[1])
launch_from_torch({"parallel": {"pipeline": 4}, "dist": {"hang_report": {"after": 2.0}}})
torch.distributed.barrier()  # every rank launched before any waits on a neighbour (a late one would be named)
stage_index, stages = gpc.get_local_rank(ParallelMode.PIPELINE), gpc.get_world_size(ParallelMode.PIPELINE)
first, last = stage_index == 0, stage_index == stages - 1
row: dict = {
    "rank": gpc.get_global_rank(),
    "stage": stage_index,
    "prev": None if first else gpc.get_prev_global_rank(ParallelMode.PIPELINE),
    "next": None if last else gpc.get_next_global_rank(ParallelMode.PIPELINE),
    "reports": [],
}
entered: list[float] = []


def write() -> None:
    (out / f"rank-{row['rank']}.json").write_text(json.dumps(row))


def on_hang(report) -> None:  # type: ignore[no-untyped-def]
    if not report.missing:  # slow, not hung (a loaded machine's first call on a fresh group)
        row.setdefault("slow", []).append(str(report))
        return
    row["reports"].append(hang_report_row(report, entered[-1]))
    write()
    os._exit(0)  # the hung rank ends here


gpc.on_hang(on_hang)
torch.manual_seed(0)
stage = PipelineStage(
    nn.Linear(8, 8), stage_index, stages, gpc.device, group=gpc.get_group(ParallelMode.PIPELINE)
)
schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
x, y = torch.randn(8, 8), torch.randn(8, 8)
for step in range(2):
    if stage_index == 2 and step == 1:
        row["stopped"] = True
        write()
        time.sleep(12)  # stopped early; its process stays, so nothing fails, it just never comes
        os._exit(0)
    entered.append(time.monotonic())
    if first:
        schedule.step(x)
    elif last:
        schedule.step(target=y, losses=[])
    else:
        schedule.step()
    row[f"step{step}"] = True
write()
time.sleep(12)
os._exit(0)
