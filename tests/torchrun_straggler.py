"""Run under torchrun (2 ranks) by tests/test_abort_states.py:
``torchrun ... tests/torchrun_straggler.py OUT``.

A straggler, as a user's retry loop meets it: rank 1 starts its launch 4 s late; rank 0's first
launch (timeout 2 s) fails without it and rank 0 launches again at once, so rank 1's first launch
is one behind rank 0's. Each rank retries ``launch_from_torch`` on ``RendezvousError`` (timeout
6 s, at most 4 tries), then all-reduces on the world. Writes OUT/rank-<R>.json: the errors of the
failed tries (type and first line) and the sum (or None).
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
from parallelctx.rendezvous import RendezvousError


def main() -> int:
    """Launch with retries on this rank; return 0 (the test reads the JSON file)."""
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    failed: list[str] = []
    total = None
    if rank == 1:
        time.sleep(4.0)
    for attempt in range(4):
        timeout = 2 if rank == 0 and attempt == 0 else 6
        try:
            parallelctx.launch_from_torch({"dist": {"timeout": timeout}})
        except RendezvousError as exc:
            failed.append(str(exc).splitlines()[0][:240])
            gpc.destroy()
            continue
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        total = x.item()
        gpc.destroy()
        break
    (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "failed": failed, "sum": total}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
