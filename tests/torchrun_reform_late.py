"""A survivor that comes to reform after ``dist.timeout`` (run by tests/test_reform.py):
``torchrun --nproc-per-node 4 tests/torchrun_reform_late.py OUT``.

4 ranks of data parallelism, ``dist.timeout`` 3 s. Rank 3 leaves for good after the launch.
Ranks 0 and 1 call ``gpc.abort()`` and ``gpc.reform(exclude=[3])`` at once; rank 2 comes 4.5 s
later, as a rank does whose collective the abort did not reach and that learned of the loss only
when that collective timed out. The default reform wait (twice ``dist.timeout``) takes it in: the
three survivors all-reduce their old ranks on the new world. Writes OUT/rank-<R>.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import gpc


def main() -> int:
    out = Path(sys.argv[1])
    parallelctx.launch_from_torch({"dist": {"timeout": 3}})
    me = gpc.get_global_rank()
    if me == 3:
        return 0
    gpc.abort()
    if me == 2:
        time.sleep(4.5)
    began = time.monotonic()
    reformed = gpc.reform(exclude=[3])
    waited = time.monotonic() - began
    ranks = torch.tensor([float(me)])
    dist.all_reduce(ranks)
    record = {"old": me, "new": reformed.rank, "world": gpc.get_world_size(parallelctx.ParallelMode.GLOBAL),
              "sum": ranks.item(), "waited_s": round(waited, 2)}  # fmt: skip
    (out / f"rank-{me}.json").write_text(json.dumps(record))
    gpc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
