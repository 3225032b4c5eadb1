"""One rank of the eager-groups race check (issue 34), under real torchrun (4 ranks):

    torchrun --standalone --nproc-per-node 4 tests/torchrun_eager_stall.py OUT_DIR ROUNDS

gpc's gloo groups connect as they are made (``dist.gloo_lazy_init=False``); tensor 2, so rank 0
shares its tensor group with rank 1 and nothing but the world with it otherwise. Each round, rank
1 is stopped for 0.5 s (SIGSTOP, SIGCONT) as it starts making its tensor group; every rank
launches and destroys at once. Rank 0 finishes its side of the tensor group without waiting for
rank 1, so without a wait at the end of the launch it destroys the group while rank 1 still
connects to it ("Connection closed by peer" on rank 1). Writes OUT_DIR/rank-<R>.json when every
round launched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

import parallelctx
from parallelctx import gpc

CONFIG = {"parallel": {"tensor": 2}, "dist": {"gloo_lazy_init": False, "timeout": 60}}


def main(out_dir: str, rounds: int) -> None:
    """The rounds on this rank; writes its record."""
    rank = int(os.environ["RANK"])
    stop = None
    if rank == 1:
        stop = subprocess.Popen(
            [
                "sh",
                "-c",
                f"while read x; do kill -STOP {os.getpid()}; sleep 0.5; kill -CONT {os.getpid()}; done",
            ],
            stdin=subprocess.PIPE,
        )
        real = dist.new_group

        def new_group(ranks: object = None, *args: object, **kwargs: object) -> object:
            if stop is not None and stop.stdin is not None and ranks is not None and list(ranks) == [0, 1]:  # type: ignore[call-overload]
                stop.stdin.write(b"go\n")
                stop.stdin.flush()
            return real(ranks, *args, **kwargs)  # type: ignore[arg-type]

        dist.new_group = new_group  # type: ignore[assignment]
    for _ in range(rounds):
        parallelctx.launch_from_torch(CONFIG)
        gpc.destroy()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "rounds": rounds}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
