"""Run under torchrun (4 ranks) by tests/test_relaunch_in_step.py:
``torchrun ... tests/torchrun_refusal_relaunch.py OUT ROUNDS``.

A user's loop that fixes a bad config and launches again at once: each round, rank 2 first
launches with ``tensor=3`` (its own checks refuse it, so every rank's launch is refused), then
every rank launches with ``tensor=2`` and all-reduces on the world; ROUNDS rounds in the same
processes. Writes OUT/rank-<R>.json: per launch, the round, which launch ("bad" or "good"), and
the world sum or the error's type.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import gpc


def main() -> int:
    """Run the rounds on this rank; return 0 (the test reads the JSON file)."""
    out, rounds, rank = Path(sys.argv[1]), int(sys.argv[2]), int(os.environ["RANK"])
    rows = []
    for i in range(rounds):
        for kind in ("bad", "good"):
            tensor = 3 if kind == "bad" and rank == 2 else 2
            try:
                parallelctx.launch_from_torch({"parallel": {"tensor": tensor}, "dist": {"timeout": 15}})
                x = torch.tensor([float(rank + 1)])
                dist.all_reduce(x)
                ended: object = x.item()
            except Exception as exc:
                ended = type(exc).__name__
            gpc.destroy()
            rows.append([i, kind, ended])
    (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "launches": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
