"""Run under torchrun (4 ranks) by tests/test_abort.py: ``torchrun ... tests/torchrun_abort_churn.py OUT``.

A thread of every rank opens and closes event loops (an epoll with a listening socket, as a
``selectors`` server does) throughout the launch, so that they land in the descriptor slots the
guard reads for each group's gloo loop, and the gloo groups connect as made
(``dist.gloo_lazy_init=False``: connections made after another thread freed a lower number).
Then ranks 0-2 all-reduce over the world while rank 3 stays away, and each calls
``gpc.abort()`` 1.5 s in. Writes OUT/rank-<R>.json: whether and when the all-reduce raised,
a relaunch's all-reduce over the world and the tensor group, and the guard's warnings that a
group's loop was not found.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import ParallelMode, gpc

CONFIG = {"parallel": {"tensor": 2}, "dist": {"timeout": 30, "gloo_lazy_init": False}}


def churn(stop: threading.Event) -> None:
    """Open an event loop with a listener, hold it 2 ms, close it; until ``stop``."""
    while not stop.is_set():
        selector = selectors.EpollSelector()
        server = socket.create_server(("127.0.0.1", 0))
        selector.register(server, selectors.EVENT_READ)
        time.sleep(0.002)
        selector.close()
        server.close()
        time.sleep(0.0002)


def main() -> int:
    """Run one rank; return 0 (the test reads the JSON files)."""
    out = Path(sys.argv[1])
    missed: list[str] = []  # the guard's warnings that a group's loop was not found, on this rank

    class Missed(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "was not found" in record.getMessage():
                missed.append(record.getMessage())

    logging.getLogger("parallelctx").addHandler(Missed())
    stop = threading.Event()
    thread = threading.Thread(target=churn, args=(stop,), daemon=True)
    thread.start()
    parallelctx.launch_from_torch(CONFIG)
    stop.set()
    thread.join()
    rank = gpc.get_global_rank()
    record: dict = {"rank": rank, "raised": None, "ended_s": None, "missed": missed}
    if rank != 3:
        timer = threading.Timer(1.5, gpc.abort)
        timer.start()
        begin = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as exc:
            record["raised"] = str(exc).splitlines()[0][:200]
        record["ended_s"] = time.monotonic() - begin
        timer.cancel()
    else:
        time.sleep(4.0)
    gpc.destroy()
    parallelctx.launch_from_torch(CONFIG)
    world, tensor = torch.ones(1), torch.ones(1)
    dist.all_reduce(world)
    dist.all_reduce(tensor, group=gpc.get_group(ParallelMode.TENSOR))
    record["relaunch_sums"] = [world.item(), tensor.item()]
    gpc.destroy()
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
