"""Run under torchrun (4 ranks, ``--max-restarts 1``) by tests/test_relaunch_in_step.py:
``torchrun ... tests/torchrun_restart_after_early_death.py OUT``.

A restart at the same world size after a rank died before its first launch (a crash while
loading data, say): in attempt 0 rank 3 exits after 6 s without launching, while ranks 0-2 retry
``launch_from_torch`` (``dist.timeout`` 2 s), so rank 0 posts its 2nd and later launches on the
agent's store, which outlives the attempt. In attempt 1 the new rank 3 is the first process of
its rank on that store, and it comes before the new rank 0 (1 s late): every rank launches twice
and all-reduces. Writes OUT/rank-<R>.json (attempt 1): per launch, the world sum or the error
and the seconds it took.
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
    """Run this rank's attempt; return 3 on rank 3 of attempt 0 (which restarts the job), else 0."""
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0:
        if rank == 3:
            time.sleep(6)
            return 3  # torchrun restarts every rank
        began = time.monotonic()
        while time.monotonic() - began < 60:  # torchrun stops this loop when rank 3 fails
            try:
                parallelctx.launch_from_torch({"dist": {"timeout": 2}})
            except Exception:
                pass  # rank 3 never comes
            gpc.destroy()
        return 0
    if rank == 0:
        time.sleep(1.0)
    rows: list[object] = []
    for _ in range(2):
        began = time.monotonic()
        try:
            parallelctx.launch_from_torch({"dist": {"timeout": 10}})
            x = torch.tensor([float(rank + 1)])
            dist.all_reduce(x)
            rows.append(x.item())
        except Exception as exc:
            rows.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        rows.append(round(time.monotonic() - began, 2))
        gpc.destroy()
    (out / f"rank-{rank}.json").write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
