"""The ``dry-run`` command: run a script as one rank (or many ranks) of a big job, on one machine.

    parallelctx dry-run --world-size 16384 --rank 12345 [--nproc-per-node 8] [--config CFG]
                        [--json OUT] script.py [args...]
    parallelctx dry-run --world-size 1024 --ranks all|cover|0,17,9000|sample:N [--jobs J] script.py

One rank: this process gets the variables torchrun would give that rank, ``gpc`` is armed with
the simulation (:mod:`parallelctx.dryrun`), and the script runs as ``__main__``; its
``launch_from_torch`` (or any launch) then makes every group on torch's ``fake`` backend. The
rank's report is printed at exit (or written to ``--json``). Exit code: the script's.

Many ranks: torch and parallelctx are imported once, then each rank runs in a process forked
for it (``--jobs`` at a time), with its output in a log file; the reports are then checked
across ranks (:mod:`parallelctx.cli.sweep`). Exit code 1 when a rank failed or a check found a
mismatch; every message names the ranks.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import runpy
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from ..guard.recorder import DryRun
from ..planning.simulation import Simulation, parse_simulate, torchrun_environment
from .stderr import say

__all__ = ["add_arguments", "run", "run_one", "run_sweep"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``parallelctx dry-run`` to ``parser``; returns None."""
    parser.add_argument("--world-size", type=int, required=True, help="ranks in the simulated job")
    parser.add_argument("--rank", type=int, default=0, help="the rank to play (default 0)")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="G",
        help="ranks per node (LOCAL_RANK = rank %% G); default 8 where 8 divides the world, else 1",
    )
    parser.add_argument(
        "--config", default=None, help="config file used when the script's launch passes no config"
    )
    parser.add_argument(
        "--json", default=None, metavar="OUT", help="write the report (sweep: all reports) here"
    )
    parser.add_argument(
        "--ranks",
        default=None,
        help="sweep: all | cover (every coordinate of every axis) | 0,17,9000 | sample:N, then check across ranks",
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="sweep: ranks run at a time (default: the CPU count)"
    )
    parser.add_argument(
        "--rank-timeout", type=float, default=300.0, help="seconds one rank may take (default 300)"
    )
    parser.add_argument(
        "--no-record-calls",
        dest="record_calls",
        action="store_false",
        help="do not record each collective and point-to-point call (nor check them across ranks)",
    )
    parser.add_argument("--quiet", action="store_true", help="only the summary line")
    parser.add_argument("script", help="the training script (what torchrun would run)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def _simulation(args: argparse.Namespace, rank: int) -> Simulation:
    sim = {"world_size": args.world_size, "rank": rank}
    if args.nproc_per_node is not None:
        sim["nproc_per_node"] = args.nproc_per_node
    return parse_simulate(sim)


def run_one(args: argparse.Namespace, rank: int) -> tuple[int, dict[str, Any]]:
    """Run the script as ``rank`` in this process (armed dry run, torchrun's variables,
    ``sys.argv`` = script and its arguments).

    Returns:
        ``(exit code of the script, the rank's report)``; the report has ``exit_code`` and, when
        the script raised, ``error`` (the traceback's last line) and ``traceback``.

    Raises:
        ValueError: a bad world size, rank or per-node count (the message names it).
    """
    from ..context import gpc

    sim = _simulation(args, rank)
    dry = DryRun(sim, args.config, armed=True, record_calls=getattr(args, "record_calls", True))
    os.environ.update(torchrun_environment(sim))
    gpc.arm_dry_run(dry)
    dry.start_recording()
    script = str(Path(args.script))
    saved_argv = sys.argv
    sys.argv = [script, *args.args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    code = 0
    error = ""
    trace = ""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:  # sys.exit("message"): Python prints it
            error = f"SystemExit: {exc.code}"
            sys.stderr.write(f"{exc.code}\n")
    except BaseException as exc:  # the script's failure is part of the report
        code = 1
        error = f"{type(exc).__name__}: {exc}"
        trace = traceback.format_exc()
        sys.stderr.write(trace)
    finally:
        sys.argv = saved_argv
        dry.stop_recording()
    report = dry.report()
    report["exit_code"] = code
    if error:
        report.update(error=error, traceback=trace)
    if not dry.launches and not error:
        report["error"] = "the script never launched gpc (no launch_from_torch / launch call ran)"
        code = code or 1
        report["exit_code"] = code
    return code, report


def _summary(report: dict[str, Any]) -> str:
    coords = report.get("coords", {})
    where = " ".join(f"{k}={coords[k]}" for k in ("tensor", "pipeline", "data", "context") if k in coords)
    if report.get("modules"):  # parallel.modules: the rank's place in each of its modules
        where = ", ".join(
            f"{name}: "
            + " ".join(f"{k}={entry['coords'][k]}" for k in ("tensor", "pipeline", "data", "context"))
            for name, entry in report["modules"].items()
        )
    launch = report.get("launch_s")
    took = f"launch {launch:.3f} s" if isinstance(launch, float) else "not launched"
    state = (
        "ok"
        if report.get("exit_code", 0) == 0
        else f"FAILED ({report.get('error') or 'exit ' + str(report.get('exit_code'))})"
    )
    return (
        f"dry-run rank {report['rank']} of {report['world_size']}: {where} | "
        f"{report.get('new_group_calls', 0)} new_group calls, {took} | {state}"
    )


def _run_single(args: argparse.Namespace) -> int:
    done = threading.Event()
    threading.Thread(
        target=_watchdog, args=(args, done), name="parallelctx-dry-run-watchdog", daemon=True
    ).start()
    code, report = run_one(args, args.rank)
    done.set()
    _emit(args, report)
    return code


def _watchdog(args: argparse.Namespace, done: threading.Event) -> None:
    """Stop a single-rank dry run still running after ``--rank-timeout``: show where every
    thread is, write the report so far (``error`` says why) and exit 1."""
    if done.wait(args.rank_timeout):
        return
    from ..context import gpc

    why = f"did not finish within --rank-timeout {args.rank_timeout:g} s (stopped)"
    sys.stdout.flush()
    sys.stderr.write(f"parallelctx dry-run: rank {args.rank} {why}; where it was:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    dry = gpc.dry_run
    report = dry.report() if dry is not None else {"rank": args.rank, "world_size": args.world_size}
    report.update(exit_code=1, error=why)
    try:
        _emit(args, report)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _emit(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Print a single rank's report (or write it to ``--json``) and its summary line."""
    sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(_summary(report))
    elif args.quiet:
        print(_summary(report))
    else:
        shown = {k: v for k, v in report.items() if k not in ("new_groups", "traceback")}
        print(json.dumps(shown, indent=1))
        print(_summary(report))


def _child(args: argparse.Namespace, rank: int, folder: Path) -> int:
    """In a forked child: output to the rank's log, run the rank, write its report. The child
    stops itself when the sweep that forked it is gone or ``--rank-timeout`` (plus a few seconds)
    has passed, so a killed sweep leaves no rank behind."""
    threading.Thread(
        target=_stop_when_orphaned,
        args=(os.getppid(), args.rank_timeout + 5),
        name="parallelctx-dry-run-rank",
        daemon=True,
    ).start()
    log = os.open(folder / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    # where the rank is, in its log, shortly before the sweep kills it at --rank-timeout
    faulthandler.dump_traceback_later(max(args.rank_timeout - 1.0, args.rank_timeout * 0.9), file=2)
    try:
        code, report = run_one(args, rank)
    except BaseException as exc:
        code, report = 1, {"rank": rank, "world_size": args.world_size, "exit_code": 1, "error": repr(exc)}
    (folder / f"rank{rank}.json").write_text(json.dumps(report))
    return code


def _stop_when_orphaned(parent: int, seconds: float) -> None:
    """Exit this forked rank (code 1) once ``parent`` is no longer its parent or ``seconds`` have
    passed; checked every half second."""
    deadline = time.monotonic() + seconds
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.5)
    sys.stdout.flush()
    sys.stderr.write("parallelctx dry-run: the sweep is gone or --rank-timeout passed; this rank stops\n")
    sys.stderr.flush()
    os._exit(1)


def run_sweep(args: argparse.Namespace, ranks: list[int]) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Run ``ranks`` in forked processes, ``args.jobs`` at a time, each bounded by
    ``args.rank_timeout``.

    Returns:
        ``(reports by rank, failures)``: a failure names the rank, how it ended and the end of
        its log.
    """
    import torch.distributed  # noqa: F401 - imported once, before the forks

    from .. import context  # noqa: F401

    folder = Path(tempfile.mkdtemp(prefix="parallelctx-dry-run-"))
    pending = list(reversed(ranks))
    running: dict[int, tuple[int, int, float]] = {}  # pidfd -> (pid, rank, deadline)
    ends: dict[int, str] = {}
    try:
        _wait_for_ranks(args, folder, pending, running, ends)
    except BaseException:  # Ctrl-C or an error here: no rank outlives the sweep
        for fd, (pid, _, _) in running.items():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(fd)
        raise
    return _collect(ranks, folder, ends)


def _wait_for_ranks(
    args: argparse.Namespace,
    folder: Path,
    pending: list[int],
    running: dict[int, tuple[int, int, float]],
    ends: dict[int, str],
) -> None:
    """Fork the pending ranks, ``args.jobs`` at a time, until every one has ended or was killed
    at its deadline (``ends`` says how each ended)."""
    jobs = max(1, args.jobs or os.cpu_count() or 1)
    while pending or running:
        while pending and len(running) < jobs:
            rank = pending.pop()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(args, rank, folder)
                finally:
                    os._exit(code)
            running[os.pidfd_open(pid)] = (pid, rank, time.monotonic() + args.rank_timeout)
        wait = max(0.0, min(d for _, _, d in running.values()) - time.monotonic())
        ready, _, _ = select.select(list(running), [], [], wait)
        now = time.monotonic()
        for fd in list(running):
            pid, rank, deadline = running[fd]
            if fd not in ready and now < deadline:
                continue
            if fd not in ready:
                os.kill(pid, signal.SIGKILL)
                ends[rank] = f"did not finish within --rank-timeout {args.rank_timeout:g} s (killed)"
            status = os.waitpid(pid, 0)[1]
            if rank not in ends:
                ends[rank] = f"exit code {os.waitstatus_to_exitcode(status)}"
            os.close(fd)
            del running[fd]


def _collect(
    ranks: list[int], folder: Path, ends: dict[int, str]
) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """Read the ranks' reports and logs from ``folder``. Ranks that failed with the same error
    make one failure, which names them all and shows the first one's output."""
    reports: dict[int, dict[str, Any]] = {}
    alike: dict[str, list[int]] = {}
    shared: dict[tuple[int, ...], list[int]] = {}
    for rank in ranks:
        path = folder / f"rank{rank}.json"
        if path.exists():
            reports[rank] = _share_groups(json.loads(path.read_text()), shared)
        if _failed(reports.get(rank)):
            why = reports.get(rank, {}).get("error") or ends.get(rank, "no report")
            alike.setdefault(why, []).append(rank)
    failures: list[str] = []
    for why, failed in alike.items():
        log = folder / f"rank{failed[0]}.log"
        tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
        who = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {_ranges(failed)} ({len(failed)} ranks)"
        whose = "its" if len(failed) == 1 else f"rank {failed[0]}'s"
        failures.append(f"{who} failed: {why}\n  {whose} output ends:\n    " + tail.replace("\n", "\n    "))
    return reports, failures


def _share_groups(report: dict[str, Any], shared: dict[tuple[int, ...], list[int]]) -> dict[str, Any]:
    """``report`` with each member list of its groups (the modules' too) and ``new_group``
    calls replaced by one list per distinct value, kept in ``shared``: thousands of swept
    members of one data group then hold one list of its members, not one each."""

    def one(members: Any) -> Any:
        if not isinstance(members, list):
            return members
        key = tuple(members)
        return shared.setdefault(key, members)

    tables = [report.get("groups")]
    tables += [
        entry.get("groups") for entry in (report.get("modules") or {}).values() if isinstance(entry, dict)
    ]
    for table in tables:
        if isinstance(table, dict):
            for mode, members in table.items():
                table[mode] = one(members)
    for call in report.get("new_groups") or []:
        if isinstance(call, dict) and "ranks" in call:
            call["ranks"] = one(call["ranks"])
    return report


def _failed(report: dict[str, Any] | None) -> bool:
    return report is None or report.get("exit_code", 0) != 0 or "error" in report


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2, 5, 7-8`` (ascending input)."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)


def _covered_sweep(args: argparse.Namespace) -> tuple[list[int], dict[int, dict[str, Any]], list[str]]:
    """``--ranks cover``: run rank 0, read the layout its launch made from its report, then run
    the rest of that layout's covering set (with ``parallel.modules``: every module's).

    Returns:
        ``(ranks, reports by rank, failures)``; only rank 0 when it failed before its launch
        (the layout is unknown then; a failure says so).
    """
    from .sweep import parse_ranks, plan_of

    reports, failures = run_sweep(args, [0])
    first = reports.get(0, {})
    if "parallel" not in first:
        failures.append(
            "--ranks cover: no launch of gpc finished on rank 0, so the layout whose axes the ranks "
            "must cover is unknown; fix rank 0 (above) or name the ranks (--ranks all, 0,17,9000, sample:N)"
        )
        return [0], reports, failures
    layout = plan_of(first["parallel"], first["world_size"])  # with modules: every module's axes
    ranks = parse_ranks("cover", args.world_size, layout=layout)
    more, more_failures = run_sweep(args, ranks[1:])
    return ranks, {**reports, **more}, failures + more_failures


def _run_many(args: argparse.Namespace) -> int:
    from .sweep import check_all, parse_ranks

    cover = args.ranks.strip() == "cover"
    try:
        ranks = [] if cover else parse_ranks(args.ranks, args.world_size)
    except ValueError as exc:
        say(f"parallelctx dry-run: {exc}")
        return 2
    begin = time.perf_counter()
    if cover:
        ranks, reports, failures = _covered_sweep(args)
    else:
        reports, failures = run_sweep(args, ranks)
    mismatches = check_all(reports)
    took = time.perf_counter() - begin
    for line in failures + mismatches:
        print(line)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "reports": {str(r): v for r, v in reports.items()},
                    "failures": failures,
                    "mismatches": mismatches,
                }
            )
            + "\n"
        )
    verdict = "all checks passed" if not (failures or mismatches) else (
        f"{sum(_failed(reports.get(r)) for r in ranks)} ranks failed, {len(mismatches)} cross-rank mismatches"
    )  # fmt: skip
    print(
        f"dry-run sweep: {len(ranks)} of {args.world_size} ranks in {took:.1f} s "
        f"({max(1, args.jobs or os.cpu_count() or 1)} at a time): {verdict}"
    )
    return 1 if failures or mismatches else 0


def _check_options(args: argparse.Namespace) -> None:
    """Check the options before any script runs; ``args.json`` becomes absolute (the script may
    change directory).

    Raises:
        ValueError: a bad ``--jobs``, ``--rank-timeout`` or ``--json`` (the message names it).
    """
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: run at least 1 rank at a time (default: the CPU count)")
    if not args.rank_timeout > 0:
        raise ValueError(f"--rank-timeout {args.rank_timeout:g}: give each rank a positive number of seconds")
    if args.json:
        out = Path(args.json).resolve()
        if not out.parent.is_dir():
            raise ValueError(f"--json {args.json}: no directory {out.parent}; create it or write elsewhere")
        if out.is_dir():
            raise ValueError(f"--json {args.json} is a directory; name a file, e.g. {out / 'report.json'}")
        args.json = str(out)


def run(args: argparse.Namespace) -> int:
    """Run the ``dry-run`` command.

    Returns:
        The exit code: the script's for one rank; for a sweep 0 when every rank passed and every
        cross-rank check agreed, 1 otherwise; 2 for bad options.
    """
    if not Path(args.script).is_file():
        say(f"parallelctx dry-run: no script {args.script!r}")
        return 2
    try:
        _simulation(args, args.rank)
        _check_options(args)
    except ValueError as exc:
        say(f"parallelctx dry-run: {exc}")
        return 2
    if args.ranks is not None:
        return _run_many(args)
    return _run_single(args)
