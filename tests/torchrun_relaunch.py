"""One rank of the relaunch test, started by real torchrun:

    torchrun --standalone --nproc-per-node 8 tests/torchrun_relaunch.py OUT_DIR CYCLES [--resources]

Launches with ``launch_from_torch`` and then, CYCLES times, ``gpc.destroy()`` followed by
``launch_from_torch`` again in the same process (the same MASTER_ADDR/MASTER_PORT, the launcher's
own store), each time with another layout. Every cycle is proven by collectives in every group
(``check.probe_groups`` against the pure layout). The first layout has every mode but data and
pipeline of size 1, and checks that an all-reduce over each size-1 mode's group (accelerator and
CPU group) leaves the value unchanged. Layouts that do not fit the world size are skipped.
With ``--resources``, every cycle also records this process's open file descriptors
(/proc/self/fd), Python threads and resident memory (issue 10's leak check). Writes
OUT_DIR/rank-<R>.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc
from parallelctx.cli.verify import probe_groups, problems, verify

LAYOUTS = [
    {"tensor": 1, "pipeline": 2},  # tensor, context, expert of size 1
    {"tensor": 2, "pipeline": 2},
    {"tensor": 4},
    {"tensor": 2, "context": 2, "pipeline": 2},
    {"tensor": 2, "pipeline": 2, "order": "tp-pp-dp"},
    {"tensor": 1, "pipeline": 4},
    {"tensor": 2, "expert": {"size": 2, "tensor": 1}},
    {"tensor": 8},
]


def _size_one_sums() -> dict[str, list[float]]:
    """All-reduce 1.0 over each size-1 mode's group and its CPU group; each must stay 1.0."""
    out = {}
    for mode in ParallelMode:
        if gpc.is_initialized(mode) and gpc.get_world_size(mode) == 1:
            value = torch.ones(1, device=gpc.device)
            dist.all_reduce(value, group=gpc.get_group(mode))
            cpu_value = torch.ones(1)
            dist.all_reduce(cpu_value, group=gpc.get_cpu_group(mode))
            out[mode.value] = [value.item(), cpu_value.item()]
    return out


def _resources() -> dict[str, int]:
    """Open file descriptors, Python threads and resident memory (KiB) of this process now."""
    rss = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(), "rss_kib": rss}


def _fits(parallel: dict, world: int) -> bool:
    try:
        parallelctx.load_config({"parallel": parallel}).parallel.to_layout(world)
    except ValueError:
        return False
    return True


def main() -> int:
    """Run every cycle on this rank; return 0 (the test reads the JSON files)."""
    out_dir, cycles = Path(sys.argv[1]), int(sys.argv[2])
    track = "--resources" in sys.argv[3:]
    layouts = [p for p in LAYOUTS if _fits(p, int(os.environ["WORLD_SIZE"]))]
    config = {"parallel": layouts[0], "dist": {"timeout": 120}}
    parallelctx.launch_from_torch(config)
    rank = gpc.get_global_rank()
    record: dict = {
        "rank": rank,
        "size_one": _size_one_sums(),
        "cycles": [],
        "relaunch_s": [],
        "resources": [],
    }
    for cycle in range(cycles + 1):
        if cycle > 0:
            parallel = layouts[cycle % len(layouts)]
            start = time.perf_counter()
            gpc.destroy()
            parallelctx.launch_from_torch({"parallel": parallel, "dist": {"timeout": 120}})
            record["relaunch_s"].append(time.perf_counter() - start)
        layout = gpc.layout
        record["cycles"].append(
            {"layout": layout.describe(), "errors": problems(verify(layout, {rank: probe_groups(gpc)}))}
        )
        if track:
            record["resources"].append(_resources())
    gpc.destroy()
    if record["relaunch_s"]:
        record["median_relaunch_s"] = statistics.median(record["relaunch_s"])
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
