"""The main demo: launch under torchrun, prove every group and the seed streams, print on rank 0.

    torchrun --standalone --nproc-per-node 8 -m parallelctx.demo --config configs/demo_3d.py

Every rank probes its groups with collectives; rank 0 gathers the results, compares them with
the pure layout and prints the layout, one check line per mode and the seed check. The exit code
is 1 on every rank when any check fails.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc
from parallelctx.check import probe_groups, probe_seeds, verify, verify_seeds
from parallelctx.show import render


def main(argv: list[str] | None = None) -> int:
    """Run the demo in this process; return 0 when every check passed, else 1."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/demo_3d.py", help="config file (.py/.json/.toml/.yaml)")
    args = parser.parse_args(argv)

    parallelctx.launch_from_env(args.config)
    rank = gpc.get_global_rank()
    probed = probe_groups(gpc)
    everything = [None] * gpc.get_world_size(ParallelMode.GLOBAL)
    dist.all_gather_object(everything, probed, group=gpc.get_cpu_group(ParallelMode.GLOBAL))
    seeds = probe_seeds(gpc)
    failures = 0
    if rank == 0:
        layout = gpc.layout
        print(render(layout))
        print(gpc.summary())
        print("group checks (all-reduce of one-hot rank vectors + all-gather of ranks, per group):")
        for mode in ParallelMode:
            errors = [e for r in range(layout.world_size) for e in verify(layout, r, everything[r]) if e.startswith(mode.value + ":") or e.startswith(mode.value + ".")]
            groups = layout.groups(mode)
            verdict = "ok" if not errors else "FAILED: " + "; ".join(errors[:3])
            print(f"  {mode.value:<26} {len(groups):>3} groups of {len(groups[0]) if groups else 0:<3} {verdict}")
            failures += len(errors)
        seed_errors = verify_seeds(layout, seeds)
        print("seed check (draws gathered from every rank): " + ("ok" if not seed_errors else "FAILED"))
        for error in seed_errors:
            print("  " + error)
        failures += len(seed_errors)
        print(f"processes on this node: {gpc.num_processes_on_current_node}, nodes: {gpc.num_nodes}")
        print("demo: all checks passed" if failures == 0 else f"demo: {failures} checks FAILED")
    verdict = torch.tensor([failures])
    if gpc.get_world_size(ParallelMode.GLOBAL) > 1:  # every rank exits with rank 0's verdict
        dist.broadcast(verdict, src=0, group=gpc.get_cpu_group(ParallelMode.GLOBAL))
    gpc.destroy()
    return 0 if int(verdict.item()) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
