"""Run under torchrun by tests/test_hang.py: ``torchrun --nproc-per-node 8 tests/torchrun_pipeline_hang.py OUT``.

A user's pipeline forward (tensor 2, pipeline 4): each stage receives its activation from the
stage before and sends its own to the next, 3 micro-batches, with torch's own ``dist.send`` and
``dist.recv``. Stage 2 of the pipeline whose tensor rank is 0 skips the receive of micro-batch 1.
On gloo a send waits for its receive: stage 1 waits in its third send, which stage 2 never
receives (stage 2 then sends all three; the last stage does not wait). ``dist.hang_report.after`` is 5 s
(at 2 s, a loaded machine can hold a healthy rank's neighbour off the CPU that long: the report
is then right, and this handler would end a rank the others still talk to; one run failed so,
probably, its error lost in the tail of torchrun's output);
the hung rank's handler writes the report and ends its process. Writes OUT/rank-<R>.json: the
rank's place, its pipeline neighbours and the reports.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torchrun_helpers import hang_report_row

from parallelctx import ParallelMode, gpc, launch_from_torch

out = Path(sys.argv[1])
launch_from_torch({"parallel": {"tensor": 2, "pipeline": 4}, "dist": {"hang_report": {"after": 5.0}}})
dist.barrier()  # every rank launched before any waits on a neighbour (a late one would be named)
rank = dist.get_rank()
stage = gpc.get_local_rank(ParallelMode.PIPELINE)
first, last = gpc.is_first_rank(ParallelMode.PIPELINE), gpc.is_last_rank(ParallelMode.PIPELINE)
prev = None if first else gpc.get_prev_global_rank(ParallelMode.PIPELINE)
nxt = None if last else gpc.get_next_global_rank(ParallelMode.PIPELINE)
skips = stage == 2 and gpc.get_local_rank(ParallelMode.TENSOR) == 0
row = {"rank": rank, "stage": stage, "prev": prev, "next": nxt, "skips": skips, "reports": []}
entered: list[float] = []


def write() -> None:
    (out / f"rank-{rank}.json").write_text(json.dumps(row))


def on_hang(report) -> None:  # type: ignore[no-untyped-def]
    row["reports"].append(hang_report_row(report, entered[-1]))
    write()
    os._exit(0)  # the hung rank ends here; its pending receive never completes


gpc.on_hang(on_hang)
activation = torch.zeros(4, 8)
for micro in range(3):
    if prev is not None and not (skips and micro == 1):
        entered.append(time.monotonic())
        dist.recv(activation, src=prev)
    activation = activation + 1
    if nxt is not None:
        dist.send(activation, dst=nxt)
write()
time.sleep(15)  # the others keep their progress posted while the hung rank is reported
os._exit(0)
