"""Run under torchrun (4 ranks, ``--max-restarts 1``) by tests/test_relaunch_in_step.py:
``torchrun ... tests/torchrun_restart_after_early_death.py OUT [PLAN]`` (also under two agents,
tests/test_elastic.py; PLAN is JSON, ``{"dies": R}``, default rank 3).

A restart at the same world size after a rank died before its first launch (a crash while
loading data, say): in attempt 0 rank R exits after 6 s without launching, while rank 0 retries
``launch_from_torch`` (``dist.timeout`` 2 s), so it posts its 2nd and later launches on the
agent's store, which outlives the attempt. In attempt 1 (told by the file OUT/died: under two
agents the one whose worker did not fail may keep its restart count) the new rank R is the
first process of its rank on that store, and the other ranks come before the new rank 0 (1 s
late): every rank launches twice and all-reduces. Writes OUT/rank-<R>.json (attempt 1): per
launch, the world sum or the error and the seconds it took.
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
    dies = json.loads(sys.argv[2])["dies"] if len(sys.argv) > 2 else 3
    if not (out / "died").exists():
        if rank == dies:
            time.sleep(6)
            (out / "died").touch()
            return 3  # torchrun restarts every rank
        began = time.monotonic()
        while rank == 0 and time.monotonic() - began < 60:  # torchrun stops it when rank R fails
            try:
                parallelctx.launch_from_torch({"dist": {"timeout": 2}})
            except Exception:
                pass  # rank R never comes
            gpc.destroy()
        time.sleep(60)  # torchrun stops this rank when rank R fails
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
