"""Test-only, under torchrun with 4 ranks: gpc.abort() ends a collective hung on a group the
Megatron bridge made after launch (create_all_gather_group=True), within seconds.

Rank 3 stops joining the all-gather data group [1, 3]; rank 1's watchdog calls gpc.abort() after
2 s. Rank 1 prints ``ABORT-RAISED <seconds>`` when its all-reduce raised, ``ABORT-HUNG`` if it
returned.
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import torch
import torch.distributed as dist

import parallelctx
import parallelctx.megatron
from parallelctx import gpc

warnings.simplefilter("ignore")
from megatron.core import parallel_state as ps  # noqa: E402

rank = int(os.environ["RANK"])
parallelctx.launch_from_torch({"parallel": {"tensor": 2}, "dist": {"timeout": 60}})
parallelctx.megatron.install(create_all_gather_group=True)
group = ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
x = torch.ones(1)
dist.all_reduce(x, group=group)  # warm: every connection of the group is made
if rank == 3:
    time.sleep(30)
    os._exit(0)
if rank == 1:
    threading.Thread(target=lambda: (time.sleep(2), gpc.abort()), daemon=True).start()
    start = time.monotonic()
    try:
        dist.all_reduce(x, group=group)
        print("ABORT-HUNG", flush=True)
    except RuntimeError:
        print(f"ABORT-RAISED {time.monotonic() - start:.1f}", flush=True)
os._exit(0)
