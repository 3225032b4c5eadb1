"""Where the start-up's time goes: ``launch_from_torch`` + ``parallelctx.megatron.process_groups()``
on an existing default group, phase by phase, on every rank.

    python -m benchmarks.startup_phases [--nproc 16] [--rounds 6] [--write-results]

Starts itself under torchrun (``--standalone``, gloo, tensor 2, pipeline 4 at 16 ranks), once
with lazy gloo (``TORCH_GLOO_LAZY_INIT=1``: pairs connect on first use) and once eager. Each round
every rank joins a barrier, launches and builds the collection, and the time each phase of the
start-up took is recorded on every rank (wall and the calling thread's CPU) by wrapping the
functions that make it: the checks, the meeting (``meet``: the launch's key prefix and every
rank's arrival in one round trip), this rank's groups (``new_group`` calls inside), hosts, device, seeds, the bridge's
groups. Before each round, in the same job, torch alone makes the same groups
(``benchmarks.peers.setup_torch_groups``: plain ``new_group`` calls, no config, rendezvous or
seeds), timed the same way: both see the same machine and the same groups held. The last two
rows are the floor of this design: torch alone's CPU plus only the phases no trimming can remove
(the checks, the meeting, the descriptor slots and the guard's hold of each group, the seeds).
Prints the medians over ranks and rounds (round 0 warms up and is dropped);
``--write-results`` writes them into benchmarks/RESULTS.md. The wall time of a rendezvous phase is
mostly waiting for the last rank to be scheduled; the CPU time is this rank's own work.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import sections

ROOT = Path(__file__).resolve().parent.parent
PHASES = [
    ("startup", "_checked", "checks (config, arguments, layout)"),
    ("meetings", "meet", "the meeting: prefix and arrivals (one rendezvous round)"),
    ("Launched", "with_groups", "this rank's groups"),
    ("GroupMaker", "new_group", "  of which torch's new_group + noting the gloo loop"),
    ("FdSlots", "reserve", "  of which reading the free descriptor slots before each group"),
    ("Guard", "hold", "  of which the guard's hold of each group (its descriptors noted)"),
    ("Launched", "with_hosts", "hosts, local rank"),
    ("Launched", "with_streams", "seeds and streams"),
    ("bridge", "_build", "Megatron bridge: its groups and values"),
]

# The phases a launch of this design needs whatever else it trims (the floor row of the table)
FLOOR = ("_checked", "meet", "reserve", "hold", "with_streams")


def worker(rounds: int, out: str) -> None:
    """One rank: the rounds; rank 0 writes the medians to ``out``."""
    import warnings

    warnings.simplefilter("ignore")
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    import megatron.core.parallel_state  # noqa: F401  (import cost is not start-up cost)

    import parallelctx
    import parallelctx.megatron as bridge
    from parallelctx import gpc
    from parallelctx.guard.core import Guard
    from parallelctx.guard.sockets import FdSlots
    from parallelctx.runtime import groups, meetings, startup

    owners = {"startup": startup, "meetings": meetings, "Launched": startup.Launched}
    owners.update(GroupMaker=groups.GroupMaker, bridge=bridge, Guard=Guard, FdSlots=FdSlots)
    spent: dict[str, list[float]] = {}

    def timed(owner: Any, name: str) -> None:
        function = getattr(owner, name)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                wall, cpu = spent.setdefault(name, [0.0, 0.0])
                spent[name] = [wall + time.perf_counter() - t, cpu + time.thread_time() - c]

        setattr(owner, name, wrapper)

    for owner, name, _ in PHASES:
        timed(owners[owner], name)
    from .peers import _fresh_names, _held_everywhere, setup_torch_groups

    pipeline = max(1, dist.get_world_size() // 4)
    rows = []
    for _ in range(rounds):
        # the floor first, in the same job and round: torch alone making the same groups
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        built = setup_torch_groups(2, pipeline)
        alone = [time.perf_counter() - t, time.thread_time() - c]
        dist.barrier()
        built.teardown()  # keeps one-rank groups: the next groups get fresh names
        # and frees them: a destroyed gloo group still referenced keeps its threads, whose event
        # loop wakes 100 times a second, a load on every later measurement
        del built
        spent.clear()
        dist.barrier()
        t, c = time.perf_counter(), time.thread_time()
        parallelctx.launch_from_torch({"parallel": {"tensor": 2, "pipeline": pipeline}})
        bridge.process_groups()
        spent["total"] = [time.perf_counter() - t, time.thread_time() - c]
        spent["torch_alone"] = alone
        rows.append(dict(spent))
        dist.barrier()
        held = _held_everywhere()
        gpc.destroy()
        # torch names a locally synchronized group by the groups the process holds: one-rank groups
        # kept alive give the next round fresh names (parallelctx refuses to reuse destroyed ones)
        _fresh_names(held)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows[1:])
    if dist.get_rank() == 0:
        medians = {}
        for name in [n for _, n, _ in PHASES] + ["total", "torch_alone"]:
            walls = [r[name][0] for rank in every for r in rank if name in r]
            cpus = [r[name][1] for rank in every for r in rank if name in r]
            medians[name] = [statistics.median(walls), statistics.median(cpus)] if walls else [0.0, 0.0]
        Path(out).write_text(json.dumps(medians))
    dist.barrier()
    dist.destroy_process_group()


def run(nproc: int, rounds: int, lazy: bool) -> dict[str, list[float]]:
    """One torchrun job; returns ``{phase: [median wall s, median thread CPU s]}``.

    Raises:
        RuntimeError: torchrun failed (its output in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "phases.json")
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "-m",
            "benchmarks.startup_phases",
        ]
        cmd += ["--worker", "--rounds", str(rounds), "--json", str(out)]
        env = dict(os.environ, TORCH_GLOO_LAZY_INIT="1" if lazy else "0", OMP_NUM_THREADS="1")
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"torchrun failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def table(results: dict[str, dict[str, list[float]]], nproc: int) -> str:
    """The markdown table: a row a phase, wall and CPU per gloo mode."""
    modes = list(results)
    head = (
        "| phase (median over ranks and rounds) | "
        + " | ".join(f"{m}: wall | {m}: CPU" for m in modes)
        + " |"
    )
    lines = [head, "|---" + "|---:" * (2 * len(modes)) + "|"]
    total = ("", "total", f"launch + process_groups(), {nproc} ranks")
    alone = ("", "torch_alone", "torch alone: the same groups, plain new_group (same job)")
    for _, name, label in [*PHASES, total, alone]:
        cells = " | ".join(
            f"{results[m][name][0] * 1e3:.1f} ms | {results[m][name][1] * 1e3:.2f} ms" for m in modes
        )
        lines.append(f"| {label} | {cells} |")
    ratios = " | ".join(
        " | ".join(f"{results[m]['total'][i] / results[m]['torch_alone'][i]:.2f}" for i in (0, 1))
        for m in modes
    )
    lines.append(f"| parallelctx ÷ torch alone | {ratios} |")
    # What a launch of this design cannot leave out, beside torch's own group making: the checks,
    # the one agreement round, the guard's notes of each group, the seeds (CPU; sums of medians)
    floor = {m: results[m]["torch_alone"][1] + sum(results[m][n][1] for n in FLOOR) for m in modes}
    cells = " | ".join(f"— | {floor[m] * 1e3:.2f} ms" for m in modes)
    lines.append(
        f"| floor: torch alone + checks, meeting, slots, hold, seeds (sum of the CPU medians) | {cells} |"
    )
    cells = " | ".join(f"— | {floor[m] / results[m]['torch_alone'][1]:.2f}" for m in modes)
    lines.append(f"| floor ÷ torch alone | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; run both jobs (or, with ``--worker``, be one rank); return 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default=None)
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.rounds, args.json)
        return 0
    results = {mode: run(args.nproc, args.rounds, mode == "lazy") for mode in ("lazy", "eager")}
    body = table(results, args.nproc)
    print(body)
    if args.write_results:
        sections.write_run(
            ROOT / "benchmarks" / "RESULTS.md",
            "startup_phases",
            "Where the start-up's time goes (issue 34)",
            f"python -m benchmarks.startup_phases {' '.join(argv or sys.argv[1:])}",
            "`launch_from_torch` + `parallelctx.megatron.process_groups()` on an existing default group, "
            "each phase timed on every rank (wall, and the calling thread's CPU). A rendezvous round's "
            "wall time is mostly waiting for the last of the ranks to be scheduled; its CPU is this "
            "rank's own requests.",
            body,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
