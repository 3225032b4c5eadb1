"""Launch and ``gpc.abort()`` in a process that holds many descriptors, against one that holds none.

    python -m benchmarks.many_fds [--nproc 4] [--rounds 10] [--extra 18000] [--json PATH] [--write-results]

A training process holds many descriptors that are none of the launch's business: sharded
datasets opened eagerly, IPC handles. Starts itself under torchrun (``--standalone``, gloo,
tensor 2). Each round every rank holds ``--extra`` more open descriptors (every other round:
none), launches with ``launch_from_torch``, runs an all-reduce on its world, tensor and data
groups (every connection exists), calls ``gpc.abort()`` and destroys. Per round and rank it
records the calling thread's CPU seconds (the cost, whatever else the machine runs) and the wall
seconds of the launch and of the abort, the connections abort shut down, how often anything
listed ``/proc/self/fd`` (the scans issue 34 removed), and the descriptors open after destroy.
Prints the medians and the ratios (with extra descriptors / without; round 0 warms up and is
dropped). ``--write-results`` writes the table into benchmarks/RESULTS.md. Timings decide no test:
the fault test (tests/test_layers.py, marker faults) checks the listings, the leaks and the shut
connections.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import sections

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"parallel": {"tensor": 2}, "dist": {"timeout": 120}}


def _counting_listdir() -> list[int]:
    """Count the listings of /proc/self/fd (``os.listdir`` or ``os.scandir``) from now on."""
    count = [0]
    listdir, scandir = os.listdir, os.scandir

    def counted(original: Any) -> Any:
        def listing(path: Any = ".") -> Any:
            if str(path).startswith("/proc/self/fd"):
                count[0] += 1
            return original(path)

        return listing

    os.listdir = counted(listdir)  # type: ignore[assignment]
    os.scandir = counted(scandir)  # type: ignore[assignment]
    return count


def worker(rounds: int, extra: int, out: str) -> None:
    """One rank: the rounds; writes ``out/rank-<R>.json``."""
    import torch
    import torch.distributed as dist

    import parallelctx
    from parallelctx import ParallelMode, gpc

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, extra + 1024)), hard))
    scans = _counting_listdir()
    rows = []
    for index in range(rounds):
        held = extra if index % 2 else 0
        base = os.open(os.devnull, os.O_RDONLY)
        fds = [os.dup(base) for _ in range(held)]
        scans[0] = 0
        t0, c0 = time.perf_counter(), time.thread_time()
        parallelctx.launch_from_torch(CONFIG)
        launch = (time.thread_time() - c0, time.perf_counter() - t0)
        for mode in (ParallelMode.GLOBAL, ParallelMode.TENSOR, ParallelMode.DATA):
            dist.all_reduce(torch.ones(1), group=gpc.get_group(mode))
        dist.barrier(group=gpc.get_cpu_group(ParallelMode.GLOBAL))
        t0, c0 = time.perf_counter(), time.thread_time()
        shut = gpc.abort()
        abort = (time.thread_time() - c0, time.perf_counter() - t0)
        gpc.destroy()
        for fd in (*fds, base):
            os.close(fd)
        rows.append(
            {"extra": held, "launch_cpu": launch[0], "launch_s": launch[1], "abort_cpu": abort[0],
             "abort_s": abort[1], "shut": shut, "fd_scans": scans[0], "open_after": len(os.listdir("/proc/self/fd"))}
        )  # fmt: skip
    rank = int(os.environ["RANK"])
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "rounds": rows}))


def run(nproc: int, rounds: int, extra: int) -> dict[str, Any]:
    """Run the job under torchrun and return every rank's rounds and the medians.

    Raises:
        RuntimeError: torchrun failed (its output in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), "-m", "benchmarks.many_fds"]
        cmd += ["--worker", "--rounds", str(rounds), "--extra", str(extra), "--json", tmp]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0:
            raise RuntimeError(
                f"torchrun failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        ranks = [json.loads(Path(tmp, f"rank-{r}.json").read_text()) for r in range(nproc)]
    rows = [row for rank in ranks for row in rank["rounds"][1:]]  # round 0 warms up
    result: dict[str, Any] = {"nproc": nproc, "rounds": rounds, "extra": extra, "ranks": ranks}
    for key in ("launch_cpu", "launch_s", "abort_cpu", "abort_s"):
        none = statistics.median(r[key] for r in rows if r["extra"] == 0)
        many = statistics.median(r[key] for r in rows if r["extra"] > 0)
        result[key] = {"none": none, "many": many, "ratio": many / none}
    result["fd_scans"] = sum(r["fd_scans"] for r in rows)
    result["shut"] = statistics.median(r["shut"] for r in rows)
    return result


def table(result: dict[str, Any]) -> str:
    """The markdown table of :func:`run`'s result."""
    lines = [
        f"| {result['nproc']} ranks, tensor 2, median of {result['rounds'] - 1} rounds x ranks | none held "
        f"| {result['extra']:,} held | ratio |",
        "| --- | --- | --- | --- |",
    ]
    names = {"launch_cpu": "launch, thread CPU", "launch_s": "launch, wall", "abort_cpu": "abort(), thread CPU",
             "abort_s": "abort(), wall"}  # fmt: skip
    for key, name in names.items():
        row = result[key]
        lines.append(
            f"| {name} | {row['none'] * 1e3:.2f} ms | {row['many'] * 1e3:.2f} ms | {row['ratio']:.2f} |"
        )
    lines.append(
        f"\nListings of `/proc/self/fd` during the launches and aborts: {result['fd_scans']}; connections "
        f"each abort shut down (median): {result['shut']:.0f}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; run the job (or, with ``--worker``, be one rank); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--extra", type=int, default=18000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.rounds, args.extra, args.json)
        return 0
    result = run(args.nproc, args.rounds, args.extra)
    body = table(result)
    print(body)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.write_results:
        sections.write_run(
            ROOT / "benchmarks" / "RESULTS.md",
            "many_fds",
            "Launch and abort with many open descriptors (issue 34)",
            f"python -m benchmarks.many_fds {' '.join(argv or sys.argv[1:])}",
            "When a group is made, the descriptor slots its creation opened are noted (one fstat "
            "each); the first abort finds each group's gloo event loop among them and reaches the "
            "group's connections through it. Neither looks at the other descriptors a process holds.",
            body,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
