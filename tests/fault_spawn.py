"""Worker of tests/test_faults.py's spawn test: rank 2 raises while ranks 0 and 1 wait for it in
an all-reduce (which then fails in them with gloo's secondary error)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from parallelctx import gpc


def rank_two_raises() -> None:
    """Rank 2 raises ValueError after a second; the others enter an all-reduce and fail later."""
    if gpc.get_global_rank() == 2:
        time.sleep(1.0)
        raise ValueError("batch 7 is broken on rank 2")
    dist.all_reduce(torch.ones(1))
