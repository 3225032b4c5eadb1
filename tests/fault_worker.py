"""One rank of a fault-injection run (tests/test_faults.py), started as a plain process:

    python tests/fault_worker.py RANK WORLD_SIZE PORT CONFIG_JSON [LAUNCH_KWARGS_JSON]

Calls ``parallelctx.launch`` with an explicit rank, world size and port, then (when the launch
worked) one all-reduce over the world; prints one JSON line, ``RESULT {...}``, with ``ok``, the
error's type and message, and the seconds from the call to its end. The launch keyword
``as_version`` is not passed on: it makes this rank report another parallelctx release.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time


def main() -> int:
    """Run one rank; return 0 when the launch and the all-reduce worked, else 1."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waits too long asks where
    # Ctrl-C as a terminal delivers it: a test runner started as a background job (bash `&`,
    # nohup) hands its children SIGINT ignored, and Python then installs no handler for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    config = json.loads(sys.argv[4])
    kwargs = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    import torch
    import torch.distributed as dist

    import parallelctx
    from parallelctx import gpc

    version = kwargs.pop("as_version", None)
    if version is not None:  # this rank runs another release of parallelctx
        parallelctx.__version__ = version
    print("READY", flush=True)
    start = time.monotonic()
    result: dict = {"rank": rank}
    try:
        parallelctx.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, **kwargs)
        value = torch.ones(1)
        dist.all_reduce(value)
        result.update(ok=True, sum=value.item())
        gpc.destroy()
    except BaseException as exc:  # the result is what the test checks
        notes = "\n".join(getattr(exc, "__notes__", []))
        result.update(ok=False, type=type(exc).__name__, error=str(exc), notes=notes)
    result["seconds"] = round(time.monotonic() - start, 3)
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
