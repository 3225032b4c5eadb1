"""Test-only, under torchrun with 4 ranks: ``torchrun ... tests/torchrun_abort_megatron_lazy.py OUT CYCLES``.

gpc.abort() ends a collective on a group the Megatron bridge made after launch that never
connected (``dist.gloo_lazy_init``: of a pair, the rank with the lower address waits with no
socket, so only :func:`parallelctx.abort.wake` ends its wait), in CYCLES launches one after
another in the same processes, while a user thread opens and closes TCP sockets (listeners and
connections) all through the launch and install, so those sockets appear between the /proc scans
that note each group's sockets.

Per cycle: launch (tensor=2, lazy gloo), open a user server (a TCP listener, as a metrics
server started after launch would be), ``install(create_all_gather_group=True)`` (the bridge
makes the all-gather data groups [0, 2] and [1, 3]); ranks 0 and 3 all-reduce alone on theirs
(their peers 2 and 1 never enter), a thread calls ``gpc.abort()`` 1 s in; destroy. Writes
OUT/rank-<R>.json: per cycle what the wait raised, how long after abort(), how many connections
the user server was sent (``server_pokes``: abort() must leave it alone) and how many the user
thread's listeners were sent (``pokes``: one opened while a group is made cannot be told from
the group's gloo listener).
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import parallelctx
import parallelctx.megatron
from parallelctx import gpc

warnings.simplefilter("ignore")
from megatron.core import parallel_state as ps  # noqa: E402

CONFIG = {"parallel": {"tensor": 2}, "dist": {"timeout": 60, "gloo_lazy_init": True}}
ALONE = (0, 3)


class Noise:
    """A user thread that, until stopped, opens a listener it keeps (every 5 ms) and a connected
    pair it closes at once; :meth:`pokes` counts the connections the kept listeners were sent."""

    def __init__(self) -> None:
        self.kept: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
            listener.setblocking(False)
            self.kept.append(listener)
            with socket.create_connection(listener.getsockname()) as client:
                # poll, not select: a slow cycle keeps more than 1,024 listeners
                waiting = select.poll()
                waiting.register(listener, select.POLLIN)
                if waiting.poll(1000):
                    listener.accept()[0].close()
                client.close()
            time.sleep(0.005)

    def pokes(self) -> int:
        """Stop the thread; return how many connections the kept listeners hold unaccepted."""
        self.stop.set()
        self.thread.join(10)
        count = 0
        for listener in self.kept:
            while True:
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    break
                count += 1
                conn.close()
            listener.close()
        return count


def cycle(rank: int) -> dict[str, Any]:
    """One launch, install and abort; returns this rank's row (ends with gpc destroyed)."""
    row: dict[str, Any] = {"waited": rank in ALONE}
    noise = Noise()
    parallelctx.launch_from_torch(CONFIG)
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    parallelctx.megatron.install(create_all_gather_group=True)
    group = ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
    row["members"] = dist.get_process_group_ranks(group)
    if rank in ALONE:
        start: list[float] = []
        thread = threading.Thread(
            target=lambda: (time.sleep(1.0), start.append(time.perf_counter()), gpc.abort())
        )
        thread.start()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            row["raised"] = None
        except RuntimeError as exc:
            row["raised"] = str(exc).splitlines()[0][:200]
        row["after_abort_s"] = time.perf_counter() - (start[0] if start else time.perf_counter())
        thread.join(10)
    else:
        time.sleep(2.5)  # never enters the collective
    row["pokes"] = noise.pokes()
    row["server_pokes"] = 0
    while True:
        try:
            server.accept()[0].close()
        except BlockingIOError:
            break
        row["server_pokes"] += 1
    server.close()
    gpc.destroy()
    return row


def main() -> int:
    """Run the cycles on this rank, then prove a last launch with an all-reduce; returns 0."""
    out, cycles = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ["RANK"])
    record: dict[str, Any] = {"rank": rank, "cycles": [cycle(rank) for _ in range(cycles)]}
    parallelctx.launch_from_torch(CONFIG)
    parallelctx.megatron.install(create_all_gather_group=True)
    x = torch.tensor([float(rank + 1)])
    group = ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
    dist.all_reduce(x, group=group)
    record["sum"] = [x.item(), float(sum(r + 1 for r in dist.get_process_group_ranks(group)))]
    gpc.destroy()
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
