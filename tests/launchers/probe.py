"""One rank of a launcher test: launch from the environment, prove the groups by collectives.

    <launcher> ... python tests/launchers/probe.py OUT_DIR [--entry env|slurm|mpi|torch]

Every rank runs ``parallelctx.launch_from_env`` (or the named entry point) with tensor=2 when
the world is even, probes its groups with real collectives (``check.probe_groups``), compares
them with the pure layout (``check.verify``) and writes ``OUT_DIR/rank-<R>.json`` with what the
detector read, what ``gpc`` counted (processes on this node, nodes, node rank, local rank), the
host name and the mismatches. The exit code is 1 when any check on this rank failed.
A launch error is written to ``OUT_DIR/error-<pid>.txt`` and exits with 3.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Run one rank; return its exit code (0 ok, 1 a check failed, 3 the launch failed)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--entry", default="env", choices=["env", "slurm", "mpi", "torch"])
    parser.add_argument("--timeout", type=float, default=240.0, help="distributed timeout (s)")
    parser.add_argument(
        "--relaunch",
        type=int,
        default=0,
        help="then destroy and launch again this many times (same entry point, host and port)",
    )
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    import torch.distributed as dist

    import parallelctx
    from parallelctx import ParallelMode, gpc
    from parallelctx.cli.verify import probe_groups, problems, verify
    from parallelctx.env import detect

    try:
        found = detect()
        tensor = 2 if found.world_size % 2 == 0 else 1
        config = {"parallel": {"tensor": tensor}}
        entry = {
            "env": parallelctx.launch_from_env,
            "slurm": parallelctx.launch_from_slurm,
            "mpi": parallelctx.launch_from_openmpi,
            "torch": parallelctx.launch_from_torch,
        }[args.entry]
        entry(config, timeout=args.timeout)
    except Exception:
        (args.out_dir / f"error-{os.getpid()}.txt").write_text(traceback.format_exc())
        sys.stderr.write(traceback.format_exc())
        return 3

    rank = gpc.get_global_rank()
    world = gpc.get_world_size(ParallelMode.GLOBAL)
    layout = parallelctx.plan(world, tensor=tensor)
    probed = probe_groups(gpc)
    errors = problems(verify(layout, {rank: probed}))
    # one more collective: every rank reports its detected local rank and host, gathered by all
    gathered: list = [None] * world
    if world > 1:
        dist.all_gather_object(
            gathered,
            (rank, found.local_rank, socket.gethostname()),
            group=gpc.get_cpu_group(ParallelMode.GLOBAL),
        )
    else:
        gathered = [(rank, found.local_rank, socket.gethostname())]
    result = {
        "launcher": found.launcher,
        "detected": {k: v for k, v in found.as_dict().items() if k != "variables"},
        "rank": rank,
        "world_size": world,
        "host": socket.gethostname(),
        "procs_on_node": gpc.num_processes_on_current_node,
        "num_nodes": gpc.num_nodes,
        "node_rank": gpc.node_rank,
        "local_rank": gpc.local_rank,
        "device": str(gpc.device),
        "tensor_group": probed.get("tensor", {}).get("members"),
        "data_group": probed.get("data", {}).get("members"),
        "gathered": gathered,
        "errors": errors,
    }
    # relaunch in the same process through the same entry point, alternating the layout; each
    # cycle is proven by collectives in every group
    result["relaunches"] = []
    for cycle in range(args.relaunch):
        cycle_tensor = 1 if cycle % 2 == 0 else tensor
        start = time.perf_counter()
        gpc.destroy()
        entry({"parallel": {"tensor": cycle_tensor}}, timeout=args.timeout)
        seconds = time.perf_counter() - start
        cycle_layout = parallelctx.plan(world, tensor=cycle_tensor)
        result["relaunches"].append(
            {"seconds": seconds, "errors": problems(verify(cycle_layout, {rank: probe_groups(gpc)}))}
        )
    gpc.destroy()
    (args.out_dir / f"rank-{rank}.json").write_text(json.dumps(result))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
