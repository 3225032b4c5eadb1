"""What the hang report costs: an 8-rank all-reduce loop with ``dist.hang_report`` off and on.

    python -m benchmarks.hang_report [--nproc 8] [--steps 300] [--rounds 5] [--numel 1024]

Starts itself under torchrun (``--standalone``, gloo). Each round launches twice in the same
processes, once with the report off and once with ``dist.hang_report=dict(after=60)``, and
times ``--steps`` all-reduces of ``--numel`` float32 values on the world group after a warm-up;
the order of off and on alternates between rounds, so a loaded machine's drift falls on both.
Prints the median time per all-reduce of each and their ratio (on / off); ``--json PATH`` writes
them. Before that, in this process (a gloo world of one), it times the counting's own cost per
call (:func:`solo`), which the noise of 8 processes on a small machine would hide. Timings on a
shared machine are noisy: compare the ratio and the per-call cost, not the times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(steps: int, rounds: int, numel: int, out: str | None) -> None:
    """One rank: the timed rounds; rank 0 prints (and writes) the result."""
    import torch
    import torch.distributed as dist

    import parallelctx
    from parallelctx import gpc

    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for label in ("off", "on") if r % 2 == 0 else ("on", "off"):
            dist_cfg: dict = {"timeout": 120}
            if label == "on":
                dist_cfg["hang_report"] = {"after": 60}
            parallelctx.launch_from_torch({"dist": dist_cfg})
            x = torch.ones(numel)
            for _ in range(20):
                dist.all_reduce(x)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                dist.all_reduce(x)
            elapsed = torch.tensor([(time.perf_counter() - start) / steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[label].append(elapsed.item())
            gpc.destroy()
    if int(os.environ["RANK"]) == 0:
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        result = {
            "world_size": int(os.environ["WORLD_SIZE"]),
            "steps": steps,
            "rounds": rounds,
            "numel": numel,
            "off_us": off * 1e6,
            "on_us": on * 1e6,
            "ratio": on / off,
            "rounds_off_us": [t * 1e6 for t in times["off"]],
            "rounds_on_us": [t * 1e6 for t in times["on"]],
        }
        print(
            f"all_reduce of {numel} float32 on {result['world_size']} ranks (gloo), median of {rounds} "
            f"rounds x {steps} steps: report off {off * 1e6:.0f} us, on {on * 1e6:.0f} us, "
            f"ratio {on / off:.3f}"
        )
        if out:
            Path(out).write_text(json.dumps(result, indent=1))


def solo(calls: int, rounds: int, numel: int, functional: bool = False) -> dict[str, float]:
    """The counting's own cost per call, without the noise of 8 processes: one process, a gloo
    world of one, ``dist.all_reduce`` (``functional``: torch's functional all-reduce and its
    wait, as DTensor makes it) timed with the group unwatched and watched (a
    :class:`~parallelctx.hang.HangWatch` over it, as a launch makes), in alternating rounds.

    Returns:
        ``{"off_us": ..., "on_us": ..., "cost_us": on - off}`` (medians per call).
    """
    import tempfile
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from parallelctx import ParallelMode
    from parallelctx.hang import HangWatch

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(f"{tmp}/store", 1)
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)
        try:
            group = dist.group.WORLD
            x = torch.ones(numel)
            times: dict[str, list[float]] = {"off": [], "on": []}
            for r in range(rounds):
                for label in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    watch = None
                    if label == "on":  # the group counted as one of two ranks (no peer is asked)
                        watch = HangWatch(
                            timedelta(seconds=60),
                            0,
                            store,
                            [(group, (ParallelMode.DATA,), False, (0, 1))],
                            [],
                        )
                        watch.start()
                    start = time.perf_counter()
                    if functional:
                        for _ in range(calls):
                            funcol.all_reduce(x, "sum", group).wait()
                    else:
                        for _ in range(calls):
                            dist.all_reduce(x)
                    times[label].append((time.perf_counter() - start) / calls)
                    if watch is not None:
                        watch.stop()
        finally:
            dist.destroy_process_group()
    off, on = statistics.median(times["off"]) * 1e6, statistics.median(times["on"]) * 1e6
    return {"off_us": off, "on_us": on, "cost_us": on - off}


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; start torchrun (or, with ``--worker``, be one rank). Returns the
    exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--numel", type=int, default=1024)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.steps, args.rounds, args.numel, args.json)
        return 0
    one = solo(5000, 9, args.numel)
    fun = solo(5000, 9, args.numel, functional=True)
    for name, got in (("all_reduce", one), ("functional all_reduce + wait", fun)):
        print(
            f"one process, world of one: {name} {got['off_us']:.1f} us unwatched, {got['on_us']:.1f} us "
            f"watched: the counting costs {got['cost_us']:.2f} us per call"
        )
    if args.json:
        Path(args.json).with_suffix(".solo.json").write_text(json.dumps({**one, "functional": fun}, indent=1))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(args.nproc), "-m", "benchmarks.hang_report"]
    cmd += ["--worker", "--steps", str(args.steps), "--rounds", str(args.rounds), "--numel", str(args.numel)]
    if args.json:
        cmd += ["--json", str(Path(args.json).resolve())]
    return subprocess.run(cmd, cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
