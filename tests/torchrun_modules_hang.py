"""Run under torchrun by tests/test_modules.py: ``torchrun --nproc-per-node 8 ... OUT``.

Two colocated modules on 8 ranks: language (tensor 2, pipeline 2: the primary module of every
rank) and vision (tensor 2, data 4: vision's data groups {0,2,4,6} and {1,3,5,7}). Ranks 1, 5
and 7 all-reduce on vision's data group; rank 3 never enters it. ``dist.hang_report.after`` is
4 s; each report is recorded and aborts the launch 2 s later. Writes OUT/rank-<R>.json.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import HangReport, gpc

CONFIG = {
    "parallel": {
        "modules": {
            "language": {"ranks": 8, "tensor": 2, "pipeline": 2},
            "vision": {"colocated_with": "language", "tensor": 2},
        }
    },
    "dist": {"timeout": 60, "hang_report": {"after": 4.0}},
}


def main() -> int:
    """Run the scenario on this rank; return 0 (the test reads the JSON file)."""
    out, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    record: dict = {"rank": rank, "reports": [], "raised": False}

    def on_hang(report: HangReport) -> None:
        record["reports"].append(
            {"mode": report.mode.value, "op": report.op, "missing": list(report.missing), "text": str(report)}
        )
        threading.Timer(2.0, report.abort).start()

    gpc.on_hang(on_hang)
    parallelctx.launch_from_torch(CONFIG)
    record["primary"] = gpc.summary()
    dist.barrier()
    if rank in (1, 5, 7):
        try:
            dist.all_reduce(torch.ones(4), group=gpc.module("vision").get_group("data"))
        except RuntimeError:
            record["raised"] = True
    else:
        time.sleep(9)
    time.sleep(3)  # every report comes before the teardown
    gpc.destroy()
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
