"""Run under torchrun (4 ranks, ``--max-restarts 1``) by tests/test_relaunch_in_step.py:
``torchrun ... tests/torchrun_restart_relaunch.py OUT``.

A restart after a job that launched several times: in attempt 0 every rank launches, all-reduces
and destroys 4 times, then rank 3 fails, so torchrun restarts every rank (the store, with attempt
0's keys, stays). In attempt 1 the new processes launch 3 times the same way. Writes
OUT/rank-<R>-a<ATTEMPT>.json: per launch, the world sum or the error (type and first 200
characters).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import gpc


def main() -> int:
    """Launch on this rank; return 3 on rank 3 of attempt 0 (which restarts the job), else 0."""
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rows: list[object] = []
    for _ in range(4 if attempt == 0 else 3):
        try:
            parallelctx.launch_from_torch({"parallel": {"tensor": 2}, "dist": {"timeout": 10}})
            x = torch.tensor([float(rank + 1)])
            dist.all_reduce(x)
            rows.append(x.item())
        except Exception as exc:
            rows.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        gpc.destroy()
    (out / f"rank-{rank}-a{attempt}.json").write_text(json.dumps(rows))
    if attempt == 0:
        if rank == 3:
            return 3
        time.sleep(60)  # torchrun stops this rank when rank 3 fails
    return 0


if __name__ == "__main__":
    sys.exit(main())
