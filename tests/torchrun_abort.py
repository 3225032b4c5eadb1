"""Run under torchrun by tests/test_abort_states.py: ``torchrun ... tests/torchrun_abort.py OUT STATES``.

STATES is a comma-separated list, one abort cycle each, in the same processes (parallel.tensor=2,
so the tensor groups are {0,1}, {2,3}, ...):

* ``lazy``: ranks 0 and 3 each all-reduce alone on their tensor group, whose peer (1, 2) never
  enters it: the group has never connected (gloo connects lazily, on a group's first
  collective), and of each pair the rank with the lower address waits with no socket at all.
* ``connected``: the same after one warm-up all-reduce on the tensor group (connected pairs).
* ``data``: rank 0 all-reduces alone on its data group {0, 2, 4, 6} (never connected).
* ``launch``: rank 7 does not arrive at a launch before ranks 0-6, waiting at its rendezvous,
  abort it (it then launches too, alone, and aborts that: ranks launch in step).

In each cycle a thread on every waiting rank calls ``gpc.abort()`` 1 s after the wait began;
the wait must then raise. Every rank destroys, and the next cycle launches again in the same
process; after the last cycle a launch is proved by all-reduces on the tensor and data groups
against the serial sums. Writes OUT/rank-<R>.json with, per cycle, how long after ``abort()``
the wait raised and what it raised.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc

CONFIG = {"parallel": {"tensor": 2}, "dist": {"timeout": 60}}
ALONE = {"lazy": (0, 3), "connected": (0, 3), "data": (0,), "launch": (0, 1, 2, 3, 4, 5, 6)}


def aborting(row: dict[str, Any]) -> threading.Thread:
    """Start a thread that calls gpc.abort() in 1 s, noting the time in ``row``."""

    def run() -> None:
        time.sleep(1.0)
        row["abort_at"] = time.perf_counter()
        gpc.abort()
        row["abort_s"] = time.perf_counter() - row["abort_at"]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def cycle(state: str, rank: int) -> dict[str, Any]:
    """Run one abort cycle; return this rank's row (ends with gpc destroyed)."""
    row: dict[str, Any] = {"state": state, "waited": rank in ALONE[state]}
    if state == "launch":
        if rank == 7:
            # Comes only after the others aborted this launch (and aborts its own in turn): every
            # rank launches as often as the others, so the next launch pairs with theirs.
            time.sleep(1.5)
            late = aborting({})
            with contextlib.suppress(RuntimeError):
                parallelctx.launch_from_torch(CONFIG)
            late.join(10)
            gpc.destroy()
            time.sleep(1.0)
            return row
        thread = aborting(row)
        try:
            parallelctx.launch_from_torch(CONFIG)
            row["raised"] = None
        except RuntimeError as exc:
            row["raised"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        row["after_abort_s"] = time.perf_counter() - row.get("abort_at", time.perf_counter())
        thread.join(10)
        gpc.destroy()
        time.sleep(max(3.5 - 1 - row["after_abort_s"], 0.0))
        return row
    parallelctx.launch_from_torch(CONFIG)
    tensor = gpc.get_group(ParallelMode.TENSOR)
    if state == "connected":
        dist.all_reduce(torch.ones(1), group=tensor)
    if rank in ALONE[state]:
        thread = aborting(row)
        group = gpc.get_group(ParallelMode.DATA if state == "data" else ParallelMode.TENSOR)
        try:
            dist.all_reduce(torch.ones(4), group=group)
            row["raised"] = None
        except RuntimeError as exc:
            row["raised"] = str(exc).splitlines()[0][:200]
        row["after_abort_s"] = time.perf_counter() - row.get("abort_at", time.perf_counter())
        thread.join(10)
    else:
        time.sleep(2.5)  # never enters the collective
    gpc.destroy()
    return row


def main() -> int:
    """Run the cycles on this rank; return 0 (the test reads the JSON file)."""
    out, states = Path(sys.argv[1]), sys.argv[2].split(",")
    rank = int(os.environ["RANK"])
    record: dict[str, Any] = {"rank": rank, "cycles": [cycle(state, rank) for state in states]}
    parallelctx.launch_from_torch(CONFIG)
    for mode in (ParallelMode.TENSOR, ParallelMode.DATA):
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=gpc.get_group(mode))
        record[mode.value] = [x.item(), float(sum(r + 1 for r in gpc.get_ranks_in_group(mode)))]
    gpc.destroy()
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
