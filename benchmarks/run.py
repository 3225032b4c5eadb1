"""The benchmark entry point: ``python -m benchmarks.run`` (``make bench`` runs it).

It checks that the peers are installed (installing ``megatron-core==0.16.1`` and matplotlib
beside the pinned torch when they are not), then for each world size and for gloo with eager
and with lazy connection set-up (``TORCH_GLOO_LAZY_INIT``) starts one torchrun job in which
parallelctx, Megatron-core and DeviceMesh build the same layout alternately, several rounds
each (:mod:`benchmarks.startup_worker`); then simulates one rank of huge worlds
(:mod:`benchmarks.simulate`). It prints the tables and writes ``RESULTS.md`` and
``startup.png`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import report, sections

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
PEER_PACKAGES = {"megatron.core": "megatron-core==0.16.1", "matplotlib": "matplotlib>=3.8"}


def ensure_peers() -> None:
    """Install the peers' packages that are missing, pinned by requirements/constraints.txt.

    Raises:
        RuntimeError: pip failed; the message has its command and output tail.
    """
    missing = [spec for module, spec in PEER_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "-c",
        str(ROOT / "requirements" / "constraints.txt"),
        *missing,
    ]
    print("installing the peers:", shlex.join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )


def run_command(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    """Run ``cmd`` in its own process group; return its output.

    Raises:
        RuntimeError: it failed, or ran past ``timeout`` seconds (then the whole process group,
            workers included, is killed); the message has the command and the output tail.
    """
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        raise RuntimeError(
            f"{shlex.join(cmd)} ran past {timeout:.0f} s and was killed:\n{out[-3000:]}"
        ) from None
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return out


def pipeline_for(world: int) -> int:
    """Pipeline size of the start-up layout: 2 up to 8 ranks, 4 beyond (tensor is 2)."""
    return 2 if world <= 8 else 4


def startup_run(world: int, lazy: bool, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One torchrun job of :mod:`benchmarks.startup_worker`; return its JSON."""
    out = tmp / f"startup_{world}_{'lazy' if lazy else 'eager'}.json"
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCH_GLOO_LAZY_INIT="1" if lazy else "0"
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "-m",
        "benchmarks.startup_worker",
        "--tensor",
        "2",
        "--pipeline",
        str(pipeline_for(world)),
        "--repeats",
        str(args.repeats),
        "--query-calls",
        str(args.query_calls),
        "--libs",
        args.libs,
        "--timeout",
        str(args.timeout),
        "--out",
        str(out),
    ]
    print(
        f"start-up: world {world}, {'lazy' if lazy else 'eager'} gloo, {args.repeats} rounds ...", flush=True
    )
    run_command(cmd, env, args.timeout)
    return json.loads(out.read_text())


def sim_run(lib: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One process of :mod:`benchmarks.simulate`; return its JSON.

    The peers get at most 2 repeats: their start-up grows with the world (seconds at 131,072).
    """
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    repeats = args.sim_repeats if lib == report.PCTX else min(args.sim_repeats, 2)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.simulate",
        "--world",
        str(world),
        "--repeats",
        str(repeats),
        "--lib",
        lib,
    ]
    print(f"simulated start-up: {lib}, world {world:,} ...", flush=True)
    out = run_command(cmd, env, args.timeout)
    return json.loads(out.strip().splitlines()[-1])


def write_results(
    runs: list[dict[str, Any]],
    sims: list[dict[str, Any]],
    tables: str,
    lines: list[str],
    argv: list[str],
    out_dir: Path,
    load: tuple[tuple[float, ...], tuple[float, ...]],
) -> None:
    """Write RESULTS.md and startup.png into ``out_dir``; ``load`` is the load average
    (1, 5, 15 min) before and after the run, since other work on the machine skews timings."""
    import torch

    try:
        from importlib.metadata import version

        megatron = version("megatron-core")
    except Exception:
        megatron = "not installed"
    png = out_dir / "startup.png"
    report.plot(runs, sims, png)
    command = shlex.join(["python", "-m", "benchmarks.run", *argv])
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""# Benchmark results

Written by `benchmarks/run.py`; do not edit by hand. Produced by

    {command}

on {now}: Python {platform.python_version()}, torch {torch.__version__}, megatron-core {megatron},
{os.cpu_count()} CPU cores, no GPU; load average (1/5/15 min) {" / ".join(f"{x:.1f}" for x in load[0])} before
the run and {" / ".join(f"{x:.1f}" for x in load[1])} after (other work on the machine makes every timing
slower and noisier). How the numbers are made and what they mean:
[docs/performance.md](../docs/performance.md).

## Verdicts against the targets of issue 5

{chr(10).join("- " + line for line in lines)}

{tables}
![start-up against world size]({png.name})

## How to read this

- **Start-up** is the time from a common barrier on the ready default group to "all of this
  library's groups exist" (`create`), and to "a first `all_reduce` done in every group this
  rank joined" (`to first collective`), the max over ranks, in one torchrun job per world size
  and gloo mode. The three libraries take turns in every round (the order rotates; one warm-up
  round is dropped). Ratios are the median over rounds of parallelctx's time divided by the
  peer's in the same round. parallelctx's time includes `load_config`, adopting the default
  group and `plan`. Megatron-core runs `initialize_model_parallel(tp, pp,
  create_gloo_process_groups=False)` (its extra gloo groups would duplicate the gloo main
  groups; leaving them out is the setting kindest to it); DeviceMesh runs
  `init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))`. No CUDA shim
  was needed: Megatron-core 0.16.1 ran on gloo/CPU unpatched.
- **eager / lazy**: with `TORCH_GLOO_LAZY_INIT=0` gloo connects every pair of a group when the
  group is created; with `=1` on the group's first collective (as NCCL does).
- **new_group calls / rank** counts every group-creation call torch saw on a rank
  (`new_group`, `new_subgroups*`, DeviceMesh's, `split_group`); **groups joined** the distinct
  groups, other than the default one, that the rank is a member of.
- Between rounds every library's groups are destroyed. parallelctx then keeps one singleton
  group per rank alive, so that its next round gets fresh group names (see the naming limit in
  docs/performance.md).
- **Queries** are timed on rank 0 with `timeit` after each build: the best of 5 repeats, minus
  the same loop with an empty statement. The mode is bound to a local name (`f(m)`), as
  Megatron's getter takes no argument; `get_local_rank(ParallelMode.TENSOR)` shows the cost with
  the enum attribute lookup included (in Python 3.11 `ParallelMode.TENSOR` alone costs about
  100 ns, through `EnumType.__getattr__`), and `get_local_rank('tensor')` the plain string.
- **Simulated** start-up: one process acts as the last rank of each world with torch's `fake`
  backend and `FakeStore` (no connections: this isolates the per-rank bookkeeping that grows
  with the world); for parallelctx start-up is config, adopting the default group, plan and
  creating this rank's groups; for Megatron-core `initialize_model_parallel(tp, pp, cp, ep,
  create_gloo_process_groups=False)`; for DeviceMesh `init_device_mesh("cpu", (pp, dp, cp,
  tp))` (it has no expert axis). Median of the repeats after one warm-up (peers: 2 repeats,
  their start-up takes seconds at the largest sizes); peak memory is tracemalloc's
  peak during one start-up (Python allocations, numpy's included). The layout column times
  `plan` plus `group_array` of every mode for the whole world; converting every group to Python
  lists is timed apart.
"""
    path = out_dir / "RESULTS.md"
    kept = sections.kept_sections(path.read_text() if path.is_file() else "")
    path.write_text(text + "".join("\n" + section + "\n" for section in kept))


def main(argv: list[str] | None = None) -> int:
    """Run every benchmark, print the tables, write RESULTS.md and the plot; return 0."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16], help="torchrun world sizes")
    parser.add_argument("--repeats", type=int, default=7, help="measured rounds per torchrun job")
    parser.add_argument("--gloo", choices=("both", "eager", "lazy"), default="both")
    parser.add_argument("--libs", default=",".join(report.LIBS))
    parser.add_argument("--query-calls", type=int, default=200_000)
    parser.add_argument("--sim-worlds", type=int, nargs="*", default=[64, 1024, 16384, 131072])
    parser.add_argument("--sim-repeats", type=int, default=7)
    parser.add_argument(
        "--sim-peer-max",
        type=int,
        default=16384,
        help="largest simulated world for the peers (Megatron-core needs ~30 s per start-up at 131,072)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per subprocess")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for RESULTS.md and startup.png")
    parser.add_argument("--no-install", action="store_true", help="do not pip-install missing peers")
    args = parser.parse_args(argv)
    for world in args.worlds:
        if world < 4 or world % (2 * pipeline_for(world)):
            parser.error(
                f"--worlds {world}: needs a multiple of {2 * pipeline_for(world)} (tensor 2 x pipeline {pipeline_for(world)}), at least 4"
            )
    if not args.no_install:
        ensure_peers()
    args.out.mkdir(parents=True, exist_ok=True)
    modes = {"both": (False, True), "eager": (False,), "lazy": (True,)}[args.gloo]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="parallelctx-bench-") as tmp:
        runs = [startup_run(w, lazy, args, Path(tmp)) for w in args.worlds for lazy in modes]
    sim_libs = [lib for lib in args.libs.split(",") if lib]
    sims = [
        sim_run(lib, w, args)
        for lib in sim_libs
        for w in args.sim_worlds
        if lib == report.PCTX or w <= args.sim_peer_max
    ]
    tables = (
        "## Start-up, torchrun on this machine\n\n"
        + report.startup_table(runs)
        + "\n## Queries (ns per call, rank 0)\n\n"
        + report.query_table(runs)
        + ("\n## Simulated start-up of one rank (fake backend)\n\n" + report.sim_table(sims) if sims else "")
    )
    lines = report.verdicts(runs, sims)
    print()
    print(tables)
    print("\n".join(lines))
    load = (load_before, os.getloadavg())
    write_results(runs, sims, tables, lines, argv, args.out, load)
    print(f"\nwrote {args.out / 'RESULTS.md'} and {args.out / 'startup.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
