"""The rank side of a parallel test: a pytest session of its own in every rank process.

A pool's rank process (:mod:`parallelctx.testing.worker`) builds a pytest ``Config`` from the
controller's command line, in the controller's invocation folder, so the same rootdir, ini file,
conftests and plugins load; it collects the files that hold parallel tests once. For each test
it forks a child that runs pytest's item protocol for that node id (autouse fixtures, markers,
``filterwarnings``, ``monkeypatch``, ``capsys``, ``caplog``, ``request`` all act on the rank),
with :class:`RankPlugin` launching ``gpc`` before the test's fixtures and recording what
happened in each phase.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

__all__ = ["PEER_LOSS_PATTERNS", "RANK_PLUGIN_NAME", "RankPlugin", "is_peer_loss", "start_session"]

#: Name under which :class:`RankPlugin` is registered; the main plugin checks it to know it runs
#: on a rank (and must run tests, not send them to a pool).
RANK_PLUGIN_NAME = "parallelctx-rank"
#: Message parts of errors that only say a peer went away (it failed, skipped or died first).
PEER_LOSS_PATTERNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "econnreset",
    "epipe",
    "connection refused",
    "socket closed",
    "read error",
    "timed out in call to",
)
#: Options of the controller's command line that must not act on a rank session.
_RANK_OPTIONS: dict[str, Any] = {
    "keyword": "",
    "markexpr": "",
    "deselect": [],
    "lf": False,
    "failedfirst": False,
    "newfirst": False,
    "stepwise": False,
    "stepwise_skip": False,
    "usepdb": False,
    "trace": False,
    "xmlpath": None,
    "collectonly": False,
    "numprocesses": None,
    "maxprocesses": None,
    "dist": "no",
    "tx": [],
    "looponfail": False,
    "exitfirst": False,
    "maxfail": 0,
}


def is_peer_loss(message: str) -> bool:
    """Return True when ``message`` only says that a peer rank went away (its connection closed):
    a consequence of another rank's failure, skip or death, never a root cause by itself."""
    low = message.lower()
    return any(p in low for p in PEER_LOSS_PATTERNS)


class RankPlugin:
    """Registered in every rank session: launches ``gpc`` before a test's fixtures, points
    ``tmp_path`` at the test's folder shared by all ranks, and records each phase's outcome."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.spec: dict[str, Any] = {}
        self.port = 0
        self.phases: list[dict[str, Any]] = []
        self.sections: list[tuple[str, str]] = []
        self.collect_errors: list[str] = []

    def begin(self, spec: dict[str, Any], port: int) -> None:
        """Set the test this (forked) process runs, and rank 0's store port."""
        self.spec = spec
        self.port = port
        self.phases = []
        self.sections = []

    @pytest.fixture
    def tmp_path(self) -> Path:
        """The test's folder, made by the controller and the same on every rank."""
        return Path(self.spec["tmp_path"])

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        """Keep collection errors, to explain a node id this rank could not find."""
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}: {report.longreprtext}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Launch ``gpc`` for the test's layout, before any fixture runs (a ``gpc`` that the
        session's conftest launched, e.g. a world of one, is destroyed first)."""
        from ..context import ParallelMode, gpc
        from ..launch import launch

        if gpc.is_initialized(ParallelMode.GLOBAL):
            gpc.destroy()
        simulate = self.spec.get("simulate")
        if simulate:  # a dry run of one rank of a big world (parallelctx.dryrun)
            sim = {"world_size": simulate["world_size"], "rank": simulate["ranks"][self.rank]}
            launch(self.spec["config"], simulate=sim)
            return

        # The default group connects on its first collective too (as the subgroups do with the
        # config's dist.gloo_lazy_init): a test pays only for the connections it uses.
        lazy = self.spec.get("lazy_default_group", False) and "TORCH_GLOO_LAZY_INIT" not in os.environ
        if lazy:
            os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        try:
            launch(
                self.spec["config"],
                rank=self.rank,
                world_size=self.world_size,
                host="127.0.0.1",
                port=self.port,
                local_rank=self.rank,
                local_world_size=self.world_size,
            )
        finally:
            if lazy:
                os.environ.pop("TORCH_GLOO_LAZY_INIT", None)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        """Record the phase's own outcome (before xfail markers reinterpret it: the controller
        applies those) with the time it ended."""
        report = yield
        entry: dict[str, Any] = {"when": call.when, "outcome": "passed", "time": call.stop}
        excinfo = call.excinfo
        if excinfo is not None:
            exc = excinfo.value
            if isinstance(exc, pytest.skip.Exception):
                entry.update(outcome="skipped", message=exc.msg or "skipped")
            elif isinstance(exc, pytest.xfail.Exception):
                entry.update(outcome="xfailed", message=exc.msg or "xfail")
            else:
                cls = type(exc)
                message = f"{cls.__name__}: {exc}"
                entry.update(
                    outcome="failed",
                    message=message,
                    exc_type=(cls.__module__, cls.__qualname__),
                    longrepr=report.longreprtext if report.longrepr is not None else message,
                    peer_loss=is_peer_loss(message),
                )
        self.phases.append(entry)
        self.sections = list(report.sections)
        return report

    def result(self) -> dict[str, Any]:
        """The rank's verdict on the test that ran.

        Returns:
            A dict: ``rank``, ``outcome`` (passed, failed, skipped, xfailed), ``phase`` (setup,
            call, teardown), ``message``, ``longrepr``, ``exc_type``, ``time`` (``time.time()``
            when the deciding phase ended), ``peer_loss`` and ``sections`` (pytest's captured
            output, ``[(title, text)]``).
        """
        out: dict[str, Any] = {
            "rank": self.rank,
            "outcome": "passed",
            "phase": "call",
            "message": "",
            "longrepr": "",
            "exc_type": None,
            "time": time.time(),
            "peer_loss": False,
            "sections": self.sections,
        }
        decided = next((p for p in self.phases if p["outcome"] != "passed"), None)
        failure = next((p for p in self.phases if p["outcome"] == "failed"), None)
        if decided is not None and decided["outcome"] != "failed" and failure is not None:
            decided = failure  # a teardown that fails after a skip is a failure
        if decided is not None:
            out.update({k: v for k, v in decided.items() if k != "when"}, phase=decided["when"])
        elif not self.phases:
            out.update(outcome="failed", phase="setup", message="the test did not run on this rank")
        if self.spec.get("simulate"):
            self._add_dry_run(out)
        return out

    def _add_dry_run(self, out: dict[str, Any]) -> None:
        """A dry run's result: its report, and messages that name the simulated rank."""
        from ..context import gpc

        simulate = self.spec["simulate"]
        played = simulate["ranks"][self.rank]
        if gpc.dry_run is not None:
            out["dry_run"] = gpc.dry_run.report()
        if out["message"]:
            prefix = f"(dry run of rank {played} of {simulate['world_size']}) "
            out["message"] = prefix + out["message"]
            out["longrepr"] = prefix + out["longrepr"]


def start_session(args: list[str], invocation_dir: str, basetemp: str, plugin: RankPlugin) -> Any:
    """Make and start a pytest session like the controller's (same command line, from the same
    folder), with ``plugin`` registered and the options that select or report tests neutralised.

    Returns:
        The started ``pytest.Session``.

    Raises:
        pytest.UsageError: the command line does not parse here.
    """
    from _pytest.config import _prepareconfig
    from _pytest.main import Session
    from _pytest.terminal import TerminalWriter

    os.chdir(invocation_dir)
    config = _prepareconfig(list(args))
    config.pluginmanager.register(plugin, RANK_PLUGIN_NAME)
    for name, value in _RANK_OPTIONS.items():
        if hasattr(config.option, name):
            setattr(config.option, name, value)
    config.option.basetemp = basetemp
    config._do_configure()
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # the controller reports; a rank's own terminal output goes nowhere
        reporter._tw = TerminalWriter(open(os.devnull, "w"))  # noqa: SIM115 - for the process's life
    session = Session.from_config(config)
    config.hook.pytest_sessionstart(session=session)
    return session


def collect(session: Any, files: list[str], plugin: RankPlugin) -> dict[str, Any]:
    """Collect ``files`` (absolute paths) in ``session``.

    Returns:
        The collected items by node id (errors are kept in ``plugin.collect_errors``).
    """
    try:
        items = session.perform_collect(files)
    except BaseException as exc:  # a UsageError for a missing file, an interrupted import
        plugin.collect_errors.append(f"{type(exc).__name__}: {exc}")
        items = session.items
    return {item.nodeid: item for item in items}


def serve_store(world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store on a port the OS picks (so pools never collide); ``launch`` on
    the same port then shares it (torch's multi-tenant stores).

    Returns:
        The ``torch.distributed.TCPStore``; its ``port`` is the port to give every rank.
    """
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )
