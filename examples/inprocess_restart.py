"""In-process restart with parallelctx: the hang report names the rank that hung, the survivors
abort, tear down and relaunch in their own processes, and only the named rank is replaced.

    python examples/inprocess_restart.py [--world 4] [--steps 30] [--fault-step 10] [--json OUT]

The script is its own supervisor: it starts WORLD workers (``--worker``) on one host, each
launching with ``parallelctx.launch(rank=, world_size=, port=)`` (rank 0 serves the store), with
``dist.hang_report=dict(after=HANG)``. The workers train a toy model (one float64 weight, a
data-parallel all-reduce of a gradient per step). At ``--fault-step`` rank 3 hangs (it stops in
a sleep, as on a hung device), so ranks 0-2 wait in an all-reduce that will never complete.
After ``--hang`` seconds each of them gets a hang report (``gpc.on_hang``) naming the group, the
call and the rank that never entered it; its handler writes the report to the events file and
calls ``gpc.abort()``. Their all-reduce raises; they call ``gpc.destroy()`` and launch again in
the same process, with the same world. The supervisor reads the reports and replaces the ranks
they name as missing (here rank 3, killed and started anew), and nothing else; the new rank 3
joins the relaunch. After it rank 0 broadcasts the step and weight it last committed, and
training goes on. The final weight is checked against the serial computation. With ``--json
OUT`` the events and times are written to OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import HangReport, gpc
from parallelctx.env import free_port

LR = 0.01


def gradient(step: int, rank: int) -> float:
    """The toy gradient of ``rank`` at ``step`` (exactly representable, so sums are exact)."""
    return float((rank + 1) * (step % 7 + 1))


def serial_weight(world: int, steps: int) -> float:
    """The weight a single process computes with no fault: the reference."""
    w = 1.0
    for step in range(steps):
        w -= LR * sum(gradient(step, r) for r in range(world)) / world
    return w


def worker(args: argparse.Namespace) -> int:
    """One rank: launch, train, and relaunch in this process after a fault."""
    out = Path(args.events)

    def log(event: str, **extra: Any) -> None:
        row = {"t": time.time(), "rank": args.rank, "pid": os.getpid(), "event": event, **extra}
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def on_hang(report: HangReport) -> None:
        # Every waiting rank gets one report per hung call: write it (the supervisor replaces
        # the ranks it names as missing) and end the wait.
        log("hang-report", mode=report.mode.value, call=report.call, missing=list(report.missing))
        log("abort")
        log("aborted", connections=report.abort())  # this launch's groups, never the relaunch's

    gpc.on_hang(on_hang)  # kept across destroy() and relaunches
    config = {"dist": {"timeout": 120, "backend": "gloo", "hang_report": {"after": args.hang}}}
    step, weight, life = 0, 1.0, 0
    while True:
        life += 1
        log("launch", life=life)
        parallelctx.launch(config, rank=args.rank, world_size=args.world, port=args.port)
        state = torch.tensor([float(step), weight], dtype=torch.float64)
        dist.broadcast(state, src=0)  # rank 0 survived: its last committed step and weight
        step, weight = int(state[0].item()), state[1].item()
        log("launched", life=life, step=step)
        try:
            while step < args.steps:
                if step == args.fault_step and args.rank == 3 and not args.replacement:
                    log("hang", step=step)
                    time.sleep(3600)
                grad = torch.tensor([gradient(step, args.rank)], dtype=torch.float64)
                dist.all_reduce(grad)
                weight -= LR * grad.item() / args.world
                step += 1
                if life > 1 and step == state[0].item() + 1:
                    log("resumed", step=step)
        except RuntimeError as exc:
            log("raised", error=str(exc).splitlines()[0][:160])
            start = time.perf_counter()
            gpc.destroy()
            log("destroyed", seconds=time.perf_counter() - start)
            continue
        log("done", step=step, weight=weight)
        gpc.destroy()
        return 0


def supervise(args: argparse.Namespace) -> dict[str, Any]:
    """Start the workers; replace the ranks the hang reports name as missing (and a rank that
    fails); wait for all. Returns the events and times."""
    port = free_port()
    events = (
        Path(args.json).with_suffix(".events.jsonl") if args.json else Path(f"/tmp/inprocess-{port}.jsonl")
    )
    events.unlink(missing_ok=True)

    def start(rank: int, replacement: bool) -> subprocess.Popen:
        argv = [
            sys.executable,
            __file__,
            "--worker",
            "--rank",
            str(rank),
            "--port",
            str(port),
            "--events",
            str(events),
        ]
        argv += ["--world", str(args.world), "--steps", str(args.steps), "--fault-step", str(args.fault_step)]
        argv += ["--hang", str(args.hang)] + (["--replacement"] if replacement else [])
        return subprocess.Popen(argv)

    seen = 0

    def named_missing() -> dict[int, list[int]]:
        """The ranks named missing by hang reports written since the last call -> who named them."""
        nonlocal seen
        if not events.exists():
            return {}
        lines = events.read_text().splitlines()
        named: dict[int, list[int]] = {}
        for line in lines[seen:]:
            row = json.loads(line)
            if row["event"] == "hang-report":
                for rank in row["missing"]:
                    named.setdefault(rank, []).append(row["rank"])
        seen = len(lines)
        return named

    began = time.time()
    procs = {rank: start(rank, False) for rank in range(args.world)}
    replaced: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.timeout
    while procs and time.monotonic() < deadline:
        for rank, by in named_missing().items():
            if rank in procs and not any(r["rank"] == rank and r["t"] > began for r in replaced):
                procs[rank].kill()  # hung: named by the others' hang reports
                procs[rank].wait()
                replaced.append({"rank": rank, "named_by": sorted(set(by)), "t": time.time()})
                procs[rank] = start(rank, True)
        for rank, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            if code == 0:
                del procs[rank]
            elif len(replaced) < args.world:
                replaced.append({"rank": rank, "code": code, "t": time.time()})
                procs[rank] = start(rank, True)
            else:
                raise RuntimeError(f"rank {rank} failed again (exit code {code}); giving up")
        time.sleep(0.05)
    for proc in procs.values():
        proc.kill()
    if procs:
        raise RuntimeError(f"ranks {sorted(procs)} did not finish within {args.timeout} s")
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    return {"began": began, "replaced": replaced, "events": rows, "times": summarize(rows, replaced, args)}


def summarize(rows: list[dict], replaced: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    """The recovery's timeline in seconds: detection, unblock, teardown, replacement, relaunch."""

    def first(event: str, **match: Any) -> float:
        return min(
            r["t"] for r in rows if r["event"] == event and all(r.get(k) == v for k, v in match.items())
        )

    def last(event: str, **match: Any) -> float:
        return max(
            r["t"] for r in rows if r["event"] == event and all(r.get(k) == v for k, v in match.items())
        )

    survivors = [r for r in range(args.world) if r != 3]
    hang = first("hang")
    # the first survivor to abort; a survivor whose own report had not come yet is woken by that
    # abort (its all-reduce raises: a peer closed the connection) and has no abort of its own
    abort = min(r["t"] for r in rows if r["event"] == "abort" and r["rank"] in survivors)
    raised = max(first("raised", rank=r) for r in survivors)
    destroyed = max(r["seconds"] for r in rows if r["event"] == "destroyed")
    relaunched = last("launched", life=2)
    resumed = last("resumed")
    final = {r["rank"]: r["weight"] for r in rows if r["event"] == "done"}
    return {
        "hang_to_abort_s": abort - hang,
        "abort_to_raise_s": raised - abort,
        "destroy_s": destroyed,
        "hung_rank_exit_to_replacement_launched_s": relaunched - replaced[0]["t"] if replaced else None,
        "abort_to_relaunched_s": relaunched - abort,
        "abort_to_resumed_s": resumed - abort,
        "final_weights": final,
        "serial_weight": serial_weight(args.world, args.steps),
    }


def main() -> int:
    """Parse the arguments; run a worker or the supervisor."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault-step", type=int, default=10)
    parser.add_argument(
        "--hang", type=float, default=3.0, help="dist.hang_report.after: seconds before a report"
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--replacement", action="store_true")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--events")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    result = supervise(args)
    times = result["times"]
    for key, value in times.items():
        print(f"{key}: {value if not isinstance(value, float) else round(value, 3)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = (
        all(w == times["serial_weight"] for w in times["final_weights"].values())
        and len(times["final_weights"]) == args.world
    )
    print("final weight matches the serial computation on every rank" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
