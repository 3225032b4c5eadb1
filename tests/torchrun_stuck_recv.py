"""Run under torchrun by tests/test_stuck_recv.py: ``torchrun ... tests/torchrun_stuck_recv.py OUT VARIANT``.

Rank 0 posts a receive from rank 1 on gpc's tensor group and leaves it (model code whose step
raised between ``irecv`` and ``wait``: the request is dropped), then rank 1 sends. gloo's pair on
rank 0 then has data for a buffer that no longer exists: it never reads again, its connection
stays readable and gloo's event loop wakes for it without pause (a core at 100%); destroying a
lazily connected group then waits on that loop forever. parallelctx quiets the groups'
connections before it destroys them.

* ``destroy`` (4 ranks, tensor 2; the user's own gloo default group, adopted): rank 0 calls
  ``gpc.destroy()`` and drops its last reference to the group.
* ``abort`` (2 ranks): rank 0 calls ``gpc.abort()``, then destroys.

Rank 0 writes OUT/rank-0.json: the gloo loop threads' CPU (ticks over 1 s) while stuck, after the
abort and at the end, and the seconds ``gpc.destroy()`` took (or "hung" past 20 s). Rank 1
sends only once rank 0 has dropped its receive (a file in OUT says so).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc


def busy_loops() -> list[int]:
    """CPU ticks each gloo event-loop thread of this process used over one second."""

    def ticks() -> dict[str, int]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                if Path(f"/proc/self/task/{tid}/comm").read_text().strip() != "gloo_tcp_loop":
                    continue
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                out[tid] = int(fields[11]) + int(fields[12])
            except OSError:
                continue
        return out

    before = ticks()
    time.sleep(1.0)
    after = ticks()
    return sorted((after[t] - before[t] for t in after if t in before), reverse=True)


def main() -> int:
    """Run VARIANT on this rank; rank 0 writes its record; returns 0."""
    out, variant = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    if variant == "destroy":
        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    parallelctx.launch_from_torch({"parallel": {"tensor": 2}, "dist": {"timeout": 30}})
    group = gpc.get_group(ParallelMode.TENSOR)
    dist.all_reduce(torch.ones(1), group=group)  # a step before: the pair is connected (lazy groups)
    dist.barrier()
    dropped = out / "dropped"
    if rank == 1:
        deadline = time.monotonic() + 60
        while not dropped.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # until rank 0 dropped its receive
        dist.send(torch.ones(4), dst=0, group=group)
    if rank != 0:
        time.sleep(8.0)  # rank 0 is done before anyone leaves
        os._exit(0)
    record: dict = {}
    work = dist.irecv(torch.zeros(4), src=1, group=group)
    time.sleep(0.3)
    del work  # the step raised before its wait(): the receive is dropped
    gc.collect()
    dropped.touch()
    time.sleep(2.0)  # rank 1's data comes
    record["stuck"] = busy_loops()
    if variant == "abort":
        gpc.abort()
        time.sleep(0.5)
        record["after_abort"] = busy_loops()
    holder = [group]
    del group
    start = time.monotonic()

    def destroy() -> None:
        gpc.destroy()
        holder.clear()  # the last reference: torch destroys the group here
        gc.collect()

    thread = threading.Thread(target=destroy, daemon=True)
    thread.start()
    thread.join(20.0)
    record["destroy_s"] = "hung" if thread.is_alive() else time.monotonic() - start
    record["end"] = busy_loops()
    (out / "rank-0.json").write_text(json.dumps(record))
    os._exit(0)  # a hung destructor would keep the interpreter from exiting


if __name__ == "__main__":
    sys.exit(main())
