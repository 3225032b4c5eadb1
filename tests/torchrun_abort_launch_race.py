"""Run under torchrun (4 ranks) by tests/test_abort_states.py:
``torchrun ... tests/torchrun_abort_launch_race.py OUT SEED [CYCLES [WINDOW]]``.

Every rank calls ``gpc.abort()`` from a timer 0 to WINDOW s (default 0.4; random, per rank) into
its launch (a timer that fires before the launch begins is an abort the launch never sees), so
the ranks' launches are aborted at different points of the rendezvous; then every rank destroys,
relaunches in the same process and all-reduces on the data and global groups. CYCLES cycles
(default 3). Writes
OUT/rank-<R>.json: per cycle, how the aborted launch ended and the relaunch's sums (or its error).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc


def main() -> int:
    """Run the cycles on this rank; return 0 (the test reads the JSON file)."""
    out, seed, rank = Path(sys.argv[1]), int(sys.argv[2]), int(os.environ["RANK"])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    window = float(sys.argv[4]) if len(sys.argv) > 4 else 0.4
    rng = random.Random(rank * 7 + seed)
    config = {"parallel": {"tensor": 2}, "dist": {"timeout": 10}}
    cycles = []
    for _ in range(count):
        timer = threading.Timer(rng.uniform(0, window), gpc.abort)
        timer.start()
        try:
            parallelctx.launch_from_torch(config)
            ended = "launched"
        except Exception as exc:
            ended = type(exc).__name__
        timer.join()
        gpc.destroy()
        began = time.monotonic()
        try:
            parallelctx.launch_from_torch(config)
            x, y = torch.tensor([float(rank + 1)]), torch.tensor([float(rank + 1)])
            dist.all_reduce(x, group=gpc.get_group(ParallelMode.DATA))
            dist.all_reduce(y)
            relaunch = [x.item(), y.item()]
            took = time.monotonic() - began
        except Exception as exc:
            relaunch = f"{type(exc).__name__}: {str(exc)[:300]}"
            took = time.monotonic() - began
        gpc.destroy()
        cycles.append({"ended": ended, "relaunch": relaunch, "relaunch_s": round(took, 3)})
    (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "cycles": cycles}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
