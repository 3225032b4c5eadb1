"""``parallelctx check``: launch under any launcher, prove and time every group, report on rank 0.

    torchrun --nproc-per-node 8 -m parallelctx check --config F [--sizes 4KiB,1MiB,16MiB] [--json]
    srun ... python -m parallelctx check --config F
    mpirun ... python -m parallelctx check --config F

Every rank launches from the environment (:func:`parallelctx.launch_from_env`), probes its
groups with collectives (:mod:`parallelctx.cli.verify`), times an all-reduce in every group
(:mod:`parallelctx.cli.timing`) and draws from its seed streams; rank 0 gathers it all, compares it
with the pure layout and prints one table (or one JSON object). The exit code is 1 on every
rank when any membership or seed check fails; times never fail a check.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..context import ParallelContext
from ..planning.layout import Layout, ParallelMode
from ..runtime.seed import STREAMS
from .placement import span_of_groups
from .stderr import say
from .timing import (
    DEFAULT_SIZES,
    ModeTiming,
    format_size,
    parse_sizes,
    summarise,
    time_allreduce,
    timed_modes,
)
from .verify import ModeCheck, probe_groups, probe_seeds, verify, verify_seeds

__all__ = [
    "CheckReport",
    "ModeReport",
    "ModulesCheckReport",
    "modules_json",
    "modules_table",
    "report_json",
    "report_table",
    "run",
    "run_checks",
    "run_module_checks",
]


@dataclass
class ModeReport:
    """One mode's results: the membership check, the most hosts one group spans, and the
    all-reduce times (None for modes whose groups hold one rank)."""

    check: ModeCheck
    max_hosts: int
    timing: ModeTiming | None


@dataclass
class CheckReport:
    """Everything ``parallelctx check`` found; :attr:`ok` when no membership or seed check failed."""

    layout: str
    world_size: int
    hosts: int
    backend: str
    sizes: list[int]
    iters: int
    seconds: float
    modes: list[ModeReport] = field(default_factory=list)
    seed_problems: list[str] = field(default_factory=list)
    #: The module checked (``parallel.modules``; its ranks: ``gpc.module(name)``), None for a job's one layout.
    module: str | None = None

    @property
    def ok(self) -> bool:
        """True when every mode's membership and the seed properties hold."""
        return not self.seed_problems and all(m.check.ok for m in self.modes)


def _gather(ctx: ParallelContext, value: Any) -> list[Any]:
    world = ctx.get_world_size(ParallelMode.GLOBAL)
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=ctx.get_cpu_group(ParallelMode.GLOBAL))
    return out


def run_checks(
    ctx: ParallelContext,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    iters: int = 5,
    warmup: int = 1,
    slow_factor: float = 2.0,
    progress: Callable[[str], None] | None = None,
    expected: Layout | None = None,
) -> CheckReport:
    """Prove and time every group of the launched ``ctx``. Collective: every rank calls it.

    Membership and seeds are compared with ``expected`` (default: the pure layout of ``ctx``'s
    sizes, ``ctx.layout``). ``progress`` receives a line per step (pass it on one rank only).
    ``ctx`` may be a module's context (``gpc.module(name)``): its ranks call it, and the report
    covers that module's groups.

    Returns:
        The :class:`CheckReport`, complete on every rank.

    Raises:
        NotLaunchedError: ``ctx`` is not launched.
        ValueError: ``iters`` below 1 or ``warmup`` below 0.
    """
    say = progress or (lambda line: None)
    begin = time.perf_counter()
    layout = expected or ctx.layout
    ranks = ctx.get_ranks_in_group(ParallelMode.GLOBAL)  # a module's context: the module's ranks
    say("probing every group (all-reduce of one-hot rank vectors, all-gather of ranks)")
    probed = dict(zip(ranks, _gather(ctx, probe_groups(ctx))))
    checks = verify(layout, probed)
    say(f"timing all-reduce at {', '.join(format_size(s) for s in sizes)} ({iters} times each)")
    timings = dict(zip(ranks, _gather(ctx, time_allreduce(ctx, sizes, iters, warmup, progress))))
    say("drawing from every seed stream")
    seed_problems = verify_seeds(layout, probe_seeds(ctx))
    hosts = np.unique(np.asarray(ctx.hostnames), return_inverse=True)[1]
    same = dict(timed_modes(layout))
    report = CheckReport(
        layout.describe(),
        layout.world_size,
        len(set(ctx.hostnames)),
        ctx.backend,
        list(sizes),
        iters,
        0.0,
        seed_problems=seed_problems,
    )
    for check in checks:
        mode = ParallelMode(check.mode)
        timing = None
        if mode in same:
            twin = same[mode]
            timing = summarise(layout, twin or mode, timings, sizes, slow_factor)
            timing.mode = mode.value
            timing.same_as = None if twin is None else twin.value
        _, widest, _ = span_of_groups(layout.group_array(mode), hosts)
        report.modes.append(ModeReport(check, widest, timing))
    report.seconds = time.perf_counter() - begin
    return report


def _cell(timing: ModeTiming | None, index: int) -> str:
    if timing is None or timing.slowest is None:
        return "-"
    seconds, gbs = timing.slowest.latency_s[index], timing.slowest.busbw_gbs[index]
    latency = f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"
    bandwidth = f"{gbs:.3g} GB/s" if gbs >= 1 else f"{gbs * 1e3:.3g} MB/s"
    return f"{latency}, {bandwidth}"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 8:
        return "[" + ",".join(map(str, ranks[:4])) + ",...," + str(ranks[-1]) + "]"
    return "[" + ",".join(map(str, ranks)) + "]"


def report_table(report: CheckReport) -> str:
    """Return the report as one plain-text table (slowest group's latency and bus bandwidth per
    message size), followed by the seed verdict and any problems."""
    from rich.console import Console
    from rich.table import Table

    verdict = "all checks passed" if report.ok else "checks FAILED"
    whose = f"module {report.module}: " if report.module is not None else ""
    table = Table(
        title=f"parallelctx check: {whose}{report.layout} on {report.hosts} host(s), {report.backend}: {verdict}"
    )
    for name in ("mode", "groups", "hosts", "membership"):
        table.add_column(name, justify="right" if name in ("groups", "hosts") else "left")
    for size in report.sizes:
        table.add_column(f"{format_size(size)} (slowest)", justify="right")
    table.add_column("slowest group")
    table.add_column("much slower groups")
    for mode in report.modes:
        timing = mode.timing
        cells = [_cell(timing, i) for i in range(len(report.sizes))]
        slowest = "-" if timing is None or timing.slowest is None else _ranks(timing.slowest.ranks)
        slow = "-" if timing is None else " ".join(_ranks(g) for g in timing.slow_groups[:3]) or "none"
        if timing is not None and timing.same_as:
            slowest += f" (= {timing.same_as})"
        table.add_row(
            mode.check.mode,
            f"{mode.check.groups} x {mode.check.group_size}",
            str(mode.max_hosts),
            "ok" if mode.check.ok else "FAILED",
            *cells,
            slowest,
            slow,
        )
    console = Console(width=200, record=True, color_system=None, file=io.StringIO())
    console.print(table)
    lines = [console.export_text().rstrip("\n")]
    lines.append("seeds: " + ("ok" if not report.seed_problems else "FAILED"))
    for mode in report.modes:
        for problem in mode.check.problems[:5]:
            lines.append(f"  {problem}")
        if len(mode.check.problems) > 5:
            lines.append(f"  ... {len(mode.check.problems) - 5} more {mode.check.mode} problems")
    lines += [f"  {p}" for p in report.seed_problems[:10]]
    lines.append(f"check took {report.seconds:.1f} s; {report.iters} all-reduces per size and group")
    return "\n".join(lines) + "\n"


def report_json(report: CheckReport) -> dict[str, Any]:
    """Return the report as a JSON-ready dict: ``ok``, the layout, and per mode its ``ok``,
    ``problems``, ``max_hosts`` and ``timing`` (every group's latency and bus bandwidth)."""
    modes = {}
    for mode in report.modes:
        modes[mode.check.mode] = {
            "ok": mode.check.ok,
            "group_size": mode.check.group_size,
            "groups": mode.check.groups,
            "problems": mode.check.problems,
            "max_hosts": mode.max_hosts,
            "timing": None if mode.timing is None else asdict(mode.timing),
        }
    out = {
        "ok": report.ok,
        "layout": report.layout,
        "world_size": report.world_size,
        "hosts": report.hosts,
        "backend": report.backend,
        "sizes": report.sizes,
        "iters": report.iters,
        "seconds": report.seconds,
        "modes": modes,
        "seeds": {"ok": not report.seed_problems, "problems": report.seed_problems},
    }
    if report.module is not None:
        out["module"] = report.module
    return out


def _progress(rank: int, quiet: bool, module: str | None = None) -> Callable[[str], None] | None:
    if rank != 0 or quiet:
        return None
    whose = f"module {module}: " if module is not None else ""

    def progress(line: str) -> None:
        say(f"parallelctx check: {whose}{line}")

    return progress


@dataclass
class ModulesCheckReport:
    """``parallelctx check`` of a job with ``parallel.modules``: one :class:`CheckReport` per
    module (in the config's order) and the problems of seeds shared across a rank's modules;
    :attr:`ok` when none failed."""

    world_size: int
    reports: dict[str, CheckReport]
    seed_problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every module's checks passed and no rank's modules share a seed."""
        return not self.seed_problems and all(r.ok for r in self.reports.values())


def _module_seed_problems(ctx: ParallelContext) -> list[str]:
    """This rank's seeds across its modules: two streams of two modules that start from the
    same seed (two colocated modules would draw the same dropout masks)."""
    seen: dict[int, str] = {}
    out: list[str] = []
    rank = ctx.get_global_rank()
    for name in ctx.modules:
        module = ctx.module(name)
        for key in STREAMS:
            seed = module.get_seed(key)
            here = f"{name} {key}"
            if seed in seen:
                out.append(f"rank {rank}: {here} and {seen[seed]} start from the same seed {seed}")
            seen.setdefault(seed, here)
    return out


def run_module_checks(
    ctx: ParallelContext,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    iters: int = 5,
    warmup: int = 1,
    slow_factor: float = 2.0,
    quiet: bool = True,
) -> ModulesCheckReport:
    """Prove and time every group of every module of a launched job with ``parallel.modules``:
    each rank runs :func:`run_checks` for each of its modules in the config's order (the module's
    ranks together), checks that its modules' seeds differ, and the reports are gathered over
    the job's world. Collective: every rank calls it. ``quiet=False`` prints progress on rank 0.

    Returns:
        The :class:`ModulesCheckReport`, complete on every rank.

    Raises:
        NotLaunchedError: ``ctx`` is not launched.
        ValueError: ``iters`` below 1 or ``warmup`` below 0; a job without modules (use
            :func:`run_checks`).
    """
    if not ctx.modules:
        raise ValueError("run_module_checks: this job has no parallel.modules; use run_checks(ctx)")
    rank = ctx.get_global_rank()
    mine: dict[str, CheckReport] = {}
    for name in ctx.modules:
        module = ctx.module(name)
        report = run_checks(module, sizes, iters, warmup, slow_factor, _progress(rank, quiet, name))
        report.module = name
        if rank == module.get_ranks_in_group(ParallelMode.GLOBAL)[0]:  # one copy per module
            mine[name] = report
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, _module_seed_problems(ctx)))
    plan = ctx.launched.plan
    order = list(plan.names) if plan is not None else list(ctx.modules)
    reports: dict[str, CheckReport] = {}
    problems: list[str] = []
    for theirs, seeds in gathered:
        reports.update(theirs)
        problems += seeds
    return ModulesCheckReport(dist.get_world_size(), {n: reports[n] for n in order if n in reports}, problems)


def modules_table(report: ModulesCheckReport) -> str:
    """Return :func:`report_table` of each module (its title names the module), then the
    verdict on the seeds across modules."""
    parts = [report_table(rep) for rep in report.reports.values()]  # each titled with its module
    seeds = "ok" if not report.seed_problems else "FAILED"
    lines = [f"seeds across modules: {seeds}", *(f"  {p}" for p in report.seed_problems[:10])]
    return "\n".join(parts) + "\n".join(lines) + "\n"


def modules_json(report: ModulesCheckReport) -> dict[str, Any]:
    """Return the report as a JSON-ready dict: ``ok``, ``world_size``, ``modules`` (each
    module's :func:`report_json`) and ``module_seeds`` (``ok``, ``problems``)."""
    return {
        "ok": report.ok,
        "world_size": report.world_size,
        "modules": {name: report_json(rep) for name, rep in report.reports.items()},
        "module_seeds": {"ok": not report.seed_problems, "problems": report.seed_problems},
    }


def run(args: argparse.Namespace, prepare: Callable[[ParallelContext], None] | None = None) -> int:
    """Run the check in this process (one rank of the job) and return its exit code: 0 when
    every check passed, 1 on every rank when any failed, 2 for bad options or a launch that
    failed (a bad config or layout, on this rank or another; ranks that never came): the
    message on stderr, no traceback, as ``plan`` does.

    ``prepare`` is called with ``gpc`` after launch and before the checks (the tests use it to
    tamper with a group and see the check fail).

    Raises:
        What :func:`parallelctx.launch_from_env` raises besides ValueError and RendezvousError
        (e.g. LaunchEnvError for a batch shell without srun).
    """
    try:
        sizes = parse_sizes(args.sizes)
        if args.iters < 1 or args.warmup < 0:
            raise ValueError(f"--iters={args.iters} must be >= 1 and --warmup={args.warmup} >= 0")
    except ValueError as exc:
        say(f"parallelctx check: {exc}")
        return 2
    from ..context import gpc
    from ..launch import launch_from_env
    from ..runtime.rendezvous import RendezvousError

    try:
        launch_from_env(args.config)
    except (ValueError, RendezvousError) as exc:  # a bad config or layout, here or on another rank
        say(f"parallelctx check: {exc}")
        return 2
    try:
        if prepare is not None:
            prepare(gpc)
        rank = gpc.get_global_rank()
        if gpc.modules:  # parallel.modules: every module's groups, module by module
            modules = run_module_checks(gpc, sizes, args.iters, args.warmup, args.slow_factor, args.quiet)
            if rank == 0:
                text = json.dumps(modules_json(modules)) + "\n" if args.json else modules_table(modules)
                print(text, end="", flush=True)
            return 0 if modules.ok else 1  # every rank holds every module's report
        report = run_checks(
            gpc, sizes, args.iters, args.warmup, args.slow_factor, _progress(rank, args.quiet)
        )
        if rank == 0:
            if args.json:
                print(json.dumps(report_json(report)), flush=True)
            else:
                print(report_table(report), end="", flush=True)
        verdict = torch.tensor([0 if report.ok else 1])
        if gpc.get_world_size(ParallelMode.GLOBAL) > 1:  # every rank exits with rank 0's verdict
            dist.broadcast(verdict, src=0, group=gpc.get_cpu_group(ParallelMode.GLOBAL))
    finally:
        gpc.destroy()
    return int(verdict.item())
