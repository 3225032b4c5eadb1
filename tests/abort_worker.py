"""One rank of the aborted-collective test (tests/test_elastic.py), started with explicit ranks:

    python tests/abort_worker.py RANK WORLD PORT OUT_DIR WHO

Launches (tensor=2, pipeline=2) with ``parallelctx.launch``. Then the ranks in WHO (``all-but-3``:
ranks 0-2; ``only-0``: rank 0) enter a world all-reduce that the others never join (they are
"hung": they sleep 4 s), and a watchdog thread on each of them calls ``gpc.abort()`` 1.5 s later.
Every rank then calls ``gpc.destroy()`` and launches again in the same process with the same
world and port, and proves the new launch with collectives (every group against the pure layout,
and a tensor-group all-reduce against the serial sum). Writes OUT_DIR/rank-<R>.json with the
times: how long abort() took, how long after it the collective raised, and what it raised.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc
from parallelctx.cli.verify import probe_groups, problems, verify

CONFIG = {"parallel": {"tensor": 2, "pipeline": 2}, "dist": {"timeout": 60}}


def proven(rank: int) -> dict:
    """Prove this launch: every group by collectives, and a tensor all-reduce's value."""
    errors = problems(verify(gpc.layout, {rank: probe_groups(gpc)}))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=gpc.get_group(ParallelMode.TENSOR))
    expected = float(sum(r + 1 for r in gpc.get_ranks_in_group(ParallelMode.TENSOR)))
    return {"errors": errors, "tensor_sum": value.item(), "tensor_expected": expected}


def main() -> int:
    """Run the test on this rank; return 0 (the test reads the JSON file)."""
    rank, world, port, out, who = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        Path(sys.argv[4]),
        sys.argv[5],
    )
    parallelctx.launch(CONFIG, rank=rank, world_size=world, port=port)
    record: dict = {"rank": rank, "first": proven(rank)}
    stuck = rank != 3 if who == "all-but-3" else rank == 0
    if stuck:
        times: dict = {}

        def watchdog() -> None:
            time.sleep(1.5)
            times["abort_called"] = time.perf_counter()
            times["shut"] = gpc.abort()
            times["abort_s"] = time.perf_counter() - times["abort_called"]

        dog = threading.Thread(target=watchdog, daemon=True)
        dog.start()
        start = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1))
            record["raised"] = None
        except RuntimeError as exc:
            record["raised"] = str(exc).splitlines()[0][:200]
        ended = time.perf_counter()
        dog.join(10)
        record["waited_s"] = ended - start
        record["after_abort_s"] = ended - times.get("abort_called", ended)
        record["abort_s"] = times.get("abort_s")
        record["connections_shut"] = times.get("shut")
    else:
        time.sleep(4)  # hung: never joins the all-reduce
    start = time.perf_counter()
    gpc.destroy()
    record["destroy_s"] = time.perf_counter() - start
    start = time.perf_counter()
    parallelctx.launch(CONFIG, rank=rank, world_size=world, port=port)
    record["relaunch_s"] = time.perf_counter() - start
    record["second"] = proven(rank)
    gpc.destroy()
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
