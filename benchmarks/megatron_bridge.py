"""Start-up of Megatron-core's ``parallel_state`` through parallelctx against Megatron's own.

    python -m benchmarks.megatron_bridge [--worlds 8 16] [--repeats 5] [--sim-world 16384]
    python -m benchmarks.megatron_bridge --route process_groups --worlds 16 --sim-world 16384 --gloo eager lazy

With ``--route process_groups`` the parallelctx side is ``launch + parallelctx.megatron.
process_groups()`` (the ``pg_collection`` route, ``parallel_state`` left alone) and the section
is written apart; run it with the megatron-core under test (``.venv-mcore019/bin/python`` for
0.19.2: ``make bench-megatron-next``).

Compares ``launch + parallelctx.megatron.install()`` (config, adopting the default group,
parallelctx's groups, host count, seeds, then the groups parallelctx lacks and every
``parallel_state`` global) with ``initialize_model_parallel(tp, pp)``, both ending with
``parallel_state`` ready for Megatron-core's layers:

* one torchrun job per world size and gloo mode (tensor 2, pipeline 2 up to 8 ranks and 4
  beyond; ``--gloo eager``: ``TORCH_GLOO_LAZY_INIT=0``, every group connects all its pairs when
  made; ``lazy``: ``=1`` for both libraries, pairs connect on first use, as NCCL does) with
  :mod:`benchmarks.startup_worker` alternating the two, ``--repeats`` rounds after a warm-up;
  the ratio is the median over rounds of the bridge's time over Megatron's;
* one process acting as the last rank of a ``--sim-world`` world with the fake backend
  (:mod:`benchmarks.simulate`): the per-rank cost when the world is large.

It prints a table and writes it as a labelled section of ``--results`` (default
benchmarks/RESULTS.md), replacing an earlier one; ``make bench`` keeps the section when it
rewrites the file. Timings never decide a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import sections
from .run import pipeline_for, sim_run, startup_run

HERE = Path(__file__).resolve().parent
START, END = sections.markers("megatron_bridge")


def _ratio(run: dict[str, Any], key: str, lib: str = "bridge") -> tuple[float, float, float]:
    """(median bridge seconds, median Megatron seconds, median of per-round ratios)."""
    ours, theirs, ratios = [], [], []
    for rnd in run["rounds"]:
        by = {rec["lib"]: rec for rec in rnd}
        ours.append(by[lib][key])
        theirs.append(by["megatron"][key])
        ratios.append(by[lib][key] / by["megatron"][key])
    return statistics.median(ours), statistics.median(theirs), statistics.median(ratios)


def table(runs: list[dict[str, Any]], sims: dict[str, dict[str, Any]], lib: str = "bridge") -> str:
    """The markdown section: start-up per world size, then the simulated rank."""
    ours_name = "launch + install()" if lib == "bridge" else "launch + process_groups()"
    lines = [
        (
            f"| world | layout | gloo | {ours_name} | initialize_model_parallel | ratio "
            "| to first collective: ratio | new_group calls / rank (bridge, Megatron) |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    floor = bool(runs) and all("floor" in run for run in runs)
    if floor:
        lines[0] += " torch alone, the same groups (own job) | its ratio | parallelctx ÷ torch alone |"
        lines[1] += " --- | --- | --- |"
    for run in runs:
        ours, theirs, ratio = _ratio(run, "create_s", lib)
        _, _, first = _ratio(run, "first_collective_s", lib)
        last = {rec["lib"]: rec for rec in run["rounds"][-1]}
        line = (
            f"| {run['world_size']} | tp {run['tensor']} pp {run['pipeline']} "
            f"| {'lazy' if run.get('lazy_init') else 'eager'} | {ours * 1e3:.1f} ms "
            f"| {theirs * 1e3:.1f} ms | {ratio:.2f} | {first:.2f} "
            f"| {last[lib]['calls_max']}, {last['megatron']['calls_max']} |"
        )
        if floor:
            alone, _, alone_ratio = _ratio(run["floor"], "create_s", "torch_groups")
            line += f" {alone * 1e3:.1f} ms | {alone_ratio:.2f} | {ratio / alone_ratio:.2f} |"
        lines.append(line)
    if sims:
        b, m = sims[lib], sims["megatron"]
        # no rendezvous with the fake backend: config, adopting the group, groups, seeds, bridge
        sim_name = "gpc groups + seeds + " + ("install()" if lib == "bridge" else "process_groups()")
        lines += [
            "",
            (
                f"Simulated last rank of {b['world_size']:,} ranks (fake backend; tensor {b['sizes']['tensor']}, "
                f"pipeline {b['sizes']['pipeline']}, context {b['sizes']['context']}, expert {b['sizes']['expert']}):"
            ),
            "",
            "| | start-up per rank | new_group calls | peak Python memory |",
            "| --- | --- | --- | --- |",
            (
                f"| {sim_name} | {b['startup_s'] * 1e3:.1f} ms | {b['group_creations']} "
                f"| {b['peak_bytes'] / 1024:.0f} KiB |"
            ),
            (
                f"| initialize_model_parallel | {m['startup_s'] * 1e3:.1f} ms | {m['group_creations']} "
                f"| {m['peak_bytes'] / 1024:.0f} KiB |"
            ),
            f"| ratio | {b['startup_s'] / m['startup_s']:.4f} | | |",
        ]
    return "\n".join(lines)


def write_section(results: Path, body: str, argv: list[str], lib: str = "bridge") -> None:
    """Put ``body`` between this command's markers in ``results`` (replacing, else appending)."""
    import megatron.core

    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    route = "install()" if lib == "bridge" else "process_groups()"
    version = str(megatron.core.__version__).split("+")[0]
    section = (
        f"## Megatron-core {version} on parallelctx: `launch + {route}` against `initialize_model_parallel`\n\n"
        f"Written by `python -m benchmarks.megatron_bridge {' '.join(argv)}` on {now} (load average "
        f"{load} after the run; {os.cpu_count()} CPU cores, gloo). Start-up from a common barrier to "
        "`parallel_state` ready (max over ranks, median of rounds; ratio = median of per-round "
        "ratios, below 1 means parallelctx is faster); Megatron-core runs with "
        "`create_gloo_process_groups=False`, the setting kindest to it. See the module docstring.\n\n"
        f"{body}\n"
    )
    sections.write_section(results, "megatron_bridge" if lib == "bridge" else "megatron_bridge_pgc", section)


def main(argv: list[str] | None = None) -> int:
    """Run the start-up jobs and the simulation, print the table, write the section; return 0."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sim-world", type=int, default=16384, help="0 skips the simulation")
    parser.add_argument("--sim-repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--route", choices=("install", "process_groups"), default="install")
    parser.add_argument("--gloo", choices=("eager", "lazy"), nargs="+", default=["eager"])
    args = parser.parse_args(argv)
    lib = "bridge" if args.route == "install" else "bridge_pgc"
    args.query_calls = 2000
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            print(f"layout: tensor 2, pipeline {pipeline_for(world)}", flush=True)
            for mode in args.gloo:
                args.libs = f"{lib},megatron"
                run = startup_run(world, mode == "lazy", args, Path(tmp))
                if lib == "bridge_pgc":  # torch alone making the same groups: the floor, own job
                    args.libs = "megatron,torch_groups"
                    (Path(tmp) / "floor").mkdir(exist_ok=True)
                    run["floor"] = startup_run(world, mode == "lazy", args, Path(tmp) / "floor")
                runs.append(run)
    sims = {name: sim_run(name, args.sim_world, args) for name in (lib, "megatron")} if args.sim_world else {}
    body = table(runs, sims, lib)
    print(body)
    write_section(args.results, body, argv, lib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
