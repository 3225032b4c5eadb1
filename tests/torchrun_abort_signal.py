"""Run under torchrun (2 ranks) by tests/test_abort.py: ``torchrun ... tests/torchrun_abort_signal.py OUT``.

docs/reliability.md's recipe for aborting on a signal: a Python signal handler runs only when
the main thread is back in Python, so one that calls ``gpc.abort()`` while the main thread waits
in a hung collective runs only after the collective's timeout. ``signal.set_wakeup_fd`` is
written by the C-level handler at once, and a thread that reads it calls ``gpc.abort()``. Rank
0 all-reduces alone on the tensor group (dist.timeout 30 s) and sends itself SIGUSR1 after 1 s;
rank 1 never comes. Writes OUT/rank-0.json: how long the all-reduce took to raise, and a
relaunch's all-reduce.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc


def abort_on(signum: int) -> None:
    """The recipe: abort when ``signum`` arrives, even while the main thread is blocked."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)  # the C-level handler writes the signal number here
    signal.signal(signum, lambda *_: None)  # a Python handler, so that the C-level one is set

    def watchdog() -> None:
        while os.read(read_end, 1):
            gpc.abort()

    threading.Thread(target=watchdog, name="abort-on-signal", daemon=True).start()


def main() -> int:
    """Run the scenario on this rank; return 0."""
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    config = {"parallel": {"tensor": 2}, "dist": {"timeout": 30}}
    parallelctx.launch_from_torch(config)
    tensor = gpc.get_group(ParallelMode.TENSOR)
    dist.all_reduce(torch.ones(1), group=tensor)  # connected
    record: dict = {"rank": rank}
    if rank == 0:
        abort_on(signal.SIGUSR1)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1), group=tensor)
            record["raised"] = None
        except RuntimeError as exc:
            record["raised"] = str(exc).splitlines()[0][:200]
        record["ended_s"] = time.perf_counter() - start
    else:
        time.sleep(4)  # never enters the all-reduce
    gpc.destroy()
    parallelctx.launch_from_torch(config)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=gpc.get_group(ParallelMode.TENSOR))
    record["relaunch_sum"] = x.item()
    gpc.destroy()
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
