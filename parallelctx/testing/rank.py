"""The rank side of a parallel test: a pytest session of its own in every rank's session process.

A pool rank's session process (forked by :mod:`parallelctx.testing.worker` from a zygote that
never ran user code) builds a pytest ``Config`` from the controller's command line, in the
controller's invocation folder, so the same rootdir, ini file, conftests and plugins load; it
collects the files that hold parallel tests once, then runs pytest's item protocol for test
after test (:func:`run_session`), with the next test of the pool as ``nextitem`` so that
session- and module-scoped fixtures live as long as pytest keeps them (autouse fixtures,
markers, ``filterwarnings``, ``monkeypatch``, ``capsys``, ``caplog``, ``request`` all act on
the rank). :class:`RankPlugin` launches ``gpc`` before a test's fixtures (or, when the previous
test had the same config, keeps it and seeds it anew) and records what happened in each phase;
the process state pytest does not restore is put back after each test (:class:`_State`).
A test runs with the controller's parameter values, sent with it where they pickle
(:func:`pack_params`, :func:`take_params`).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import pickle
import re
import sys
import time
import traceback
from collections.abc import Iterable
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from . import balance

__all__ = [
    "MAX_PARAM_BYTES",
    "PEER_LOSS_PATTERNS",
    "RANK_PLUGIN_NAME",
    "WAY_ROUND",
    "RankPlugin",
    "is_peer_loss",
    "pack_params",
    "params_of",
    "run_session",
    "start_session",
    "take_params",
]

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
#: The most bytes one parameter value of a test may take pickled to be sent to the ranks
#: (:func:`pack_params`); a larger one is compared by its text, as one that does not pickle.
MAX_PARAM_BYTES = 16 * 2**20
#: Object addresses in a repr, which differ from process to process.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _full_text(value: Any) -> str:
    """``repr(value)`` without object addresses (a repr that raises is still a value: the text
    says which exception)."""
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<repr raised {type(exc).__name__}>"
    return _ADDRESS.sub("", text)


def _param_text(value: Any) -> str:
    """:func:`_full_text` cut at 300 characters, to show in a message."""
    return _full_text(value)[:300]


def _text_key(value: Any) -> str:
    """A digest of the whole :func:`_full_text` of ``value``, to compare across processes."""
    return hashlib.sha256(_full_text(value).encode(errors="replace")).hexdigest()


def _hash_probe() -> int:
    """The hash of a fixed string: equal in two processes exactly when they hash ``str`` alike
    (the same hash seed), so that a set of strings (and what is built by iterating it) has the
    same order in both."""
    return hash("parallelctx: the order of a set of strings")


def params_of(item: pytest.Item) -> str:
    """A test's parameter values as text to compare across processes (``repr`` of each, object
    addresses dropped); empty for a test without parameters.

    Returns:
        The text.
    """
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return ""
    return ", ".join(f"{name}={_param_text(callspec.params[name])}" for name in sorted(callspec.params))


def _pickled(value: Any) -> tuple[bytes | None, str]:
    """``(pickle of value, "")``, or ``(None, why it cannot be sent)``."""
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError...
        return None, f"{type(exc).__name__}: {exc}"
    if len(data) > MAX_PARAM_BYTES:
        return None, f"{len(data)} bytes pickled, more than the {MAX_PARAM_BYTES} a parameter may send"
    return data, ""


def pack_params(item: pytest.Item) -> dict[str, Any]:
    """The controller's parameter values of ``item`` and their marks, to send to its ranks
    (:func:`take_params`): each value pickled where it can be, else its text (as
    :func:`params_of` shows it), a digest of its whole text and why it cannot be sent (a lambda,
    a generator, a value over :data:`MAX_PARAM_BYTES` pickled); the case's own marks
    (``pytest.param(..., marks=...)``, pickled where they can be, and their text); and how this
    process hashes strings (:func:`_hash_probe`).

    Returns:
        ``{"values": {name: pickled value}, "unsent": {name: (text, reason, digest)},
        "marks": (pickled marks or None, their text, reason), "hash_probe": int}``; values and
        unsent are empty for a test without parameters.
    """
    callspec = getattr(item, "callspec", None)
    sent: dict[str, bytes] = {}
    unsent: dict[str, tuple[str, str, str]] = {}
    for name, value in (callspec.params if callspec is not None else {}).items():
        data, reason = _pickled(value)
        if data is None:
            unsent[name] = (_param_text(value), reason, _text_key(value))
        else:
            sent[name] = data
    marks = list(callspec.marks) if callspec is not None else []
    marks_data, marks_reason = _pickled(marks)
    return {
        "values": sent,
        "unsent": unsent,
        "marks": (marks_data, _full_text(marks), marks_reason),
        "hash_probe": _hash_probe(),
    }


#: What to do when a parameter differs between the controller and a rank and cannot be sent.
WAY_ROUND = (
    "parametrize over values that are the same in every process: a sorted list "
    "(sorted({...})) rather than a set, PYTHONHASHSEED set for the pytest run, or a value that "
    "pickles (a module-level function rather than a lambda), which the ranks then take from the "
    "controller"
)


def _same(mine: Any, theirs: Any, depth: int = 0) -> bool:
    """Whether ``mine`` (a rank's own parameter value) holds what ``theirs`` (the controller's,
    unpickled here) holds: the same object, ``==`` that answers True, or, for containers and
    objects that compare by identity (no ``__eq__`` of their own), the same type with the same
    items or the same state (``__reduce_ex__``), compared alike. A value whose own ``==``
    answers anything else (False, an array) is not the same."""
    if mine is theirs:
        return True
    if type(mine) is not type(theirs) or depth > 40:
        return False
    try:
        equal = mine == theirs
    except Exception:
        equal = False
    if equal is True:
        return True
    if isinstance(mine, (list, tuple)):
        return len(mine) == len(theirs) and all(
            _same(a, b, depth + 1) for a, b in zip(mine, theirs, strict=True)
        )
    if isinstance(mine, dict):
        return list(mine) == list(theirs) and all(_same(mine[k], theirs[k], depth + 1) for k in mine)
    if type(mine).__eq__ is not object.__eq__:
        return False  # its own equality said no
    try:
        reduced = (mine.__reduce_ex__(pickle.HIGHEST_PROTOCOL), theirs.__reduce_ex__(pickle.HIGHEST_PROTOCOL))
    except Exception:
        return False
    if not all(isinstance(r, tuple) for r in reduced):
        return False  # a global (a function, a class): only itself is the same
    return _same(reduced[0], reduced[1], depth + 1)


def _twin(item: pytest.Item, name: str, items: Iterable[pytest.Item]) -> str:
    """The node id of another case of ``item``'s test function whose value of ``name`` has the
    same text as ``item``'s (another value: another index), or "" when the text tells the case
    apart from the test's other cases."""
    callspec = item.callspec  # type: ignore[attr-defined]
    key = _text_key(callspec.params[name])
    index = callspec.indices.get(name)
    for other in items:
        spec = getattr(other, "callspec", None)
        if (
            other is item
            or spec is None
            or other.parent is not item.parent
            or getattr(other, "originalname", None) != getattr(item, "originalname", None)
            or name not in spec.params
            or spec.indices.get(name) == index
        ):
            continue
        if _text_key(spec.params[name]) == key:
            return other.nodeid
    return ""


def _take_marks(item: pytest.Item, packed: Any, replaced: bool, rank: int) -> str:
    """Give ``item`` the marks of the controller's case (:func:`pack_params`) in place of those
    of its own case under that id (``skip``, ``skipif``, ``xfail``, ``filterwarnings``...), where
    they differ. Marks that cannot be sent must have the same text as this rank's, and the
    rank's values must be its own or the text must name no object by address; a difference in
    ``usefixtures`` is refused (pytest chose the test's fixtures at collection).

    Returns:
        "" when the item has the controller's marks; otherwise the problem.
    """
    callspec = getattr(item, "callspec", None)
    if callspec is None or packed is None:
        return ""
    data, text, reason = packed
    own = list(callspec.marks)
    if data is None:
        if _full_text(own) == text and (not replaced or not _ADDRESS.search(repr(own))):
            return ""
        return (
            f"rank {rank} collected {item.nodeid} with other parameter values than the controller, and the "
            f"marks of the controller's case cannot be sent to the ranks ({reason}): its marks "
            f"{text[:300]}, the rank's {_param_text(own)}; give the marks of pytest.param(..., marks=...) "
            f"arguments that pickle, or {WAY_ROUND}"
        )
    if _pickled(own)[0] == data:
        return ""
    try:
        theirs: list[Any] = pickle.loads(data)
    except Exception as exc:
        return (
            f"rank {rank} could not read the marks of the controller's case of {item.nodeid} "
            f"({type(exc).__name__}: {exc}), and its own differ: {_param_text(own)}; {WAY_ROUND}"
        )
    try:
        if own == theirs:
            return ""
    except Exception:
        pass

    def fixtures(marks: list[Any]) -> list[Any]:
        return sorted(str(a) for m in marks if m.name == "usefixtures" for a in m.args)

    if fixtures(own) != fixtures(theirs):
        return (
            f"rank {rank} collected {item.nodeid} with marks {_param_text(own)}, the controller with "
            f"{_param_text(theirs)}: their usefixtures differ, and the fixtures of a test are chosen when "
            f"it is collected; {WAY_ROUND}"
        )
    names_left = {kept.name for kept in item.own_markers if not any(kept is o for o in own)}
    item.own_markers[:] = [m for m in item.own_markers if not any(m is o for o in own)] + list(theirs)
    callspec.marks[:] = theirs
    keywords: dict[str, Any] | None = getattr(item.keywords, "_markers", None)
    for name in {mark.name for mark in own} - names_left:
        if keywords is not None and any(keywords.get(name) is mark for mark in own):
            del keywords[name]  # a mark of the rank's own case alone
    item.keywords.update((mark.name, mark) for mark in theirs)
    return ""


def take_params(
    item: pytest.Item, packed: dict[str, Any], rank: int, items: Iterable[pytest.Item] = ()
) -> str:
    """Give ``item`` (this rank's collection of the test) the controller's parameter values and
    the marks of its case (:func:`pack_params`), so that the test runs with the values of the
    test id the controller reports even where collecting them again gives others (a set's order
    under another hash seed, a random value).

    A sent value replaces this rank's in ``item.callspec.params`` (so the test's arguments,
    ``request.param`` of indirect and fixture parameters and ``request.node.callspec`` all have
    it) unless this rank's holds the same (it pickles to the same bytes, or :func:`_same`: equal
    by ``==``, or of the same type with the same state), which is then kept (the same object as
    the module's, for tests that compare by identity). A value that could not be sent must have
    the same text as this rank's, and the text must tell this case apart from the test's other
    cases (``items``: this rank's collection; not the default ``<mod.Case object>`` of every
    case) unless this rank hashes strings as the controller did (the same hash seed: both
    collected in the same order). Where a value is replaced, the case's own marks are the
    controller's too (:func:`_take_marks`).

    Returns:
        "" when the values are the controller's; otherwise the problem: the parameter, both
        values, why it was not sent (or could not be read here) and the way round.
    """
    callspec = getattr(item, "callspec", None)
    params: dict[str, Any] = callspec.params if callspec is not None else {}
    sent: dict[str, bytes] = packed.get("values") or {}
    unsent: dict[str, tuple[str, str, str]] = packed.get("unsent") or {}
    if set(params) != set(sent) | set(unsent):
        return (
            f"rank {rank} collected {item.nodeid} with parameters {sorted(params)}, the controller with "
            f"{sorted(set(sent) | set(unsent))}: the ranks collect the test files themselves; "
            f"{WAY_ROUND}"
        )
    seed = os.environ.get("PYTHONHASHSEED", "")
    same_order = packed.get("hash_probe") == _hash_probe()
    for name, (text, reason, key) in unsent.items():
        mine = _param_text(params[name])
        if _text_key(params[name]) != key:
            return (
                f"rank {rank} collected {item.nodeid} with {name}={mine}, the controller with {name}={text}, "
                f"and the controller's value cannot be sent to the ranks ({reason}; the ranks run with "
                f"PYTHONHASHSEED={seed!r}); {WAY_ROUND}"
            )
        twin = "" if same_order else _twin(item, name, items)
        if twin:
            return (
                f"rank {rank} cannot tell whether its {name}={mine} of {item.nodeid} is the controller's: "
                f"the controller's value cannot be sent to the ranks ({reason}), its text is also that of "
                f"{twin}, and the controller hashes strings otherwise than the ranks (they run with "
                f"PYTHONHASHSEED={seed!r}), so the cases may be in another order; give the value a repr "
                f"that tells the cases apart, or {WAY_ROUND}"
            )
    replaced: dict[str, Any] = {}
    for name, data in sent.items():
        if _pickled(params[name])[0] == data:
            continue
        try:
            theirs = pickle.loads(data)
        except Exception as exc:
            return (
                f"rank {rank} could not read the controller's value of parameter {name!r} of {item.nodeid} "
                f"({type(exc).__name__}: {exc}), and its own differs: {name}={_param_text(params[name])}; "
                f"{WAY_ROUND}"
            )
        if not _same(params[name], theirs):
            replaced[name] = theirs
    problem = _take_marks(item, packed.get("marks"), bool(replaced), rank)
    if problem:
        return problem
    params.update(replaced)
    return ""


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
        #: The (config, lazy) that ``gpc`` was last launched with by this plugin.
        self.launched: tuple[dict[str, Any], bool] | None = None
        #: What that launch made: ``gpc``'s layout object and its config as a dict, to tell
        #: whether a test relaunched, destroyed or changed ``gpc`` (then it is not kept).
        self.made: tuple[Any, dict[str, Any], tuple[Any, ...]] | None = None
        #: The test's calls per process group (:func:`parallelctx.testing.balance.close_window`).
        self.calls: list[dict[str, Any]] | None = None

    def begin(self, spec: dict[str, Any], port: int) -> None:
        """Set the test this process runs next, and rank 0's store port."""
        self.spec = spec
        self.port = port
        self.phases = []
        self.sections = []
        self.calls = None

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
        """Launch ``gpc`` for the test's layout, before any fixture runs. When the previous test
        on this process launched the same config and ``gpc`` is still up, it is kept (its
        groups may live in a session fixture) and only seeded anew, so every test starts from
        the seeds of a fresh launch; any other ``gpc`` (the previous test's, one a conftest
        launched) is destroyed first. Then the test's calls on process groups start being
        counted (:mod:`parallelctx.testing.balance`; not for a dry run)."""
        from ..context import ParallelMode, gpc
        from ..launch import launch

        lazy = bool(self.spec.get("lazy_default_group", False)) and "TORCH_GLOO_LAZY_INIT" not in os.environ
        key = (self.spec["config"], lazy)
        simulate = self.spec.get("simulate")
        if gpc.is_initialized(ParallelMode.GLOBAL):
            if not simulate and self.launched == key and not self.spec.get("relaunch"):
                gpc.set_seed()
                balance.open_window()
                return
            gpc.destroy()
        self.launched = None
        self.made = None
        if simulate:  # a dry run of one rank of a big world (parallelctx.dryrun)
            sim = {"world_size": simulate["world_size"], "rank": simulate["ranks"][self.rank]}
            launch(self.spec["config"], simulate=sim)
            return
        # The default group connects on its first collective too (as the subgroups do with the
        # config's dist.gloo_lazy_init): a test pays only for the connections it uses.
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
        self.launched = key
        self.made = (gpc.layout, copy.deepcopy(gpc.config.to_dict()), gpc.destroy_hooks)
        balance.open_window()  # the test's calls count from here: the launch's own do not

    def keepable(self) -> bool:
        """Whether ``gpc`` is still what this plugin launched for the test, unchanged: the
        same launch (the test did not destroy it or launch another layout) with the same
        config (the test did not set ``gpc.config.seed`` or another key) and the same destroy
        hooks (the test installed nothing that lives until ``gpc.destroy()``, as
        ``parallelctx.megatron.install()`` does). The controller relaunches on every rank when
        one rank's answer is no."""
        from ..context import ParallelMode, gpc

        if self.made is None or not gpc.is_initialized(ParallelMode.GLOBAL):
            return False
        layout, config, hooks = self.made
        try:
            return gpc.layout is layout and gpc.destroy_hooks == hooks and gpc.config.to_dict() == config
        except Exception:  # a config that cannot be read back or compared is not kept
            return False

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
            output, ``[(title, text)]``), ``keep`` (:meth:`keepable`) and ``calls`` (the
            test's calls per process group, None when they were not counted).
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
            "keep": self.keepable(),
            "calls": self.calls,
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
    args = list(args)
    if any(str(a).startswith("--cov") for a in args):
        # pytest-cov here would erase the controller's data; run_session measures the rank itself
        args.append("--no-cov")
    config = _prepareconfig(args)
    config.pluginmanager.register(plugin, RANK_PLUGIN_NAME)
    for name, value in _RANK_OPTIONS.items():
        if hasattr(config.option, name):
            setattr(config.option, name, value)
    config.option.basetemp = basetemp
    config._do_configure()
    timeout_plugin = config.pluginmanager.get_plugin("timeout")
    if timeout_plugin is not None:  # pytest-timeout's limit is the controller's test timeout here
        config.pluginmanager.unregister(timeout_plugin)
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


class _State:
    """The process state a test may change that pytest itself does not put back, taken before
    a test and restored after it: the default dtype, grad mode, deterministic mode, the root
    logger's handlers and level, every logger's level, and the working folder (the environment
    is set anew before each test)."""

    def __init__(self) -> None:
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        root = logging.getLogger()
        self.handlers = list(root.handlers)
        self.levels = {
            name: lg.level
            for name, lg in logging.Logger.manager.loggerDict.items()
            if isinstance(lg, logging.Logger)
        }
        self.root_level = root.level
        self.cwd = os.getcwd()

    def restore(self) -> None:
        """Put the state back as it was taken."""
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        if (
            torch.are_deterministic_algorithms_enabled() != self.deterministic
            or torch.is_deterministic_algorithms_warn_only_enabled() != self.warn_only
        ):
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)
        root = logging.getLogger()
        root.handlers[:] = self.handlers
        if root.level != self.root_level:
            root.setLevel(self.root_level)
        for name, lg in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger) and lg.level != self.levels.get(name, logging.NOTSET):
                lg.setLevel(self.levels.get(name, logging.NOTSET))
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)


def _apply_environment(spec: dict[str, Any]) -> None:
    """This process's environment becomes the controller's at the test's call (plus the pool's
    own settings); its import path gets the controller's entries and its folder the controller's."""
    if os.environ != spec["env"]:
        os.environ.clear()
        os.environ.update(spec["env"])
    for entry in reversed(spec["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if os.getcwd() != spec["cwd"]:
        os.chdir(spec["cwd"])


def _start_coverage(settings: dict[str, Any] | None) -> Any:
    """Start measuring coverage as the controller's pytest-cov does (same source, branch and
    config file), into a data file of its own beside the controller's, which pytest-cov
    combines at the end of the run.

    Returns:
        The started ``coverage.Coverage``, or None when the controller measures nothing.
    """
    if not settings:
        return None
    import coverage

    cov = coverage.Coverage(
        data_file=settings["data_file"],
        data_suffix=True,
        source=settings["source"],
        branch=settings["branch"],
        config_file=settings["config_file"],
    )
    cov.start()
    return cov


def _failed(rank: int, message: str, longrepr: str = "") -> dict[str, Any]:
    return {
        "rank": rank,
        "outcome": "failed",
        "phase": "setup",
        "message": message,
        "longrepr": longrepr or message,
        "exc_type": None,
        "time": time.time(),
        "peer_loss": False,
        "sections": [],
    }


def _run_one(
    session: Any, items: dict[str, Any], plugin: RankPlugin, spec: dict[str, Any], port: int
) -> dict[str, Any]:
    """Run one test's pytest protocol here, with the pool's next test as ``nextitem``.

    Returns:
        The rank's result (see :meth:`RankPlugin.result`).
    """
    rank = plugin.rank
    _apply_environment(spec)
    item = items.get(spec["nodeid"])
    if item is None:
        errors = "\n".join(plugin.collect_errors) or (
            "no collection error was reported: the test's id may hold a value that differs from process "
            "to process (a random value, the order of a set; the ranks run with "
            f"PYTHONHASHSEED={os.environ.get('PYTHONHASHSEED', '')!r}); give parametrize ids= that do not "
            "depend on the process"
        )
        return _failed(
            rank,
            f"rank {rank} could not collect {spec['nodeid']}",
            f"rank {rank} could not collect {spec['nodeid']}:\n{errors}",
        )
    problem = take_params(item, spec.get("params") or {}, rank, items.values())
    if problem:
        return _failed(rank, problem)
    state = _State()
    plugin.begin(spec, port)
    capman = session.config.pluginmanager.get_plugin("capturemanager")
    if capman is not None and capman.is_globally_capturing():
        capman.resume_global_capture()
        capman.read_global_capture()  # drop what was written between tests
        capman.suspend_global_capture(in_=False)
    nextitem = items.get(spec["next"]) if spec.get("next") else None
    try:  # fixtures the previous test kept for a next test the controller did not send (skipped)
        session._setupstate.teardown_exact(item)
    except BaseException:
        traceback.print_exc()
    try:
        item.ihook.pytest_runtest_protocol(item=item, nextitem=nextitem)
    finally:
        plugin.calls = balance.close_window()  # opened once gpc was launched for the test
        state.restore()
    return plugin.result()


def _abort_gpc() -> None:
    """Abort ``gpc``'s groups (:meth:`~parallelctx.context.ParallelContext.abort`), so that a
    call the last test left pending ends at once here and on the peers instead of holding up
    the teardown until its timeout."""
    from ..context import ParallelMode, gpc

    if gpc.is_initialized(ParallelMode.GLOBAL):
        gpc.abort()


def _forget_gpc() -> None:
    """A conftest may launch ``gpc`` when the session starts (a world of one, say): destroy it,
    so that the first test launches its own."""
    from ..context import ParallelMode, gpc

    if gpc.is_initialized(ParallelMode.GLOBAL):
        gpc.destroy()


def _drop_gpc(plugin: RankPlugin) -> None:
    """Destroy ``gpc`` after a test that did not pass here; the next test launches anew."""
    from ..context import ParallelMode, gpc

    plugin.launched = None
    try:
        if gpc.is_initialized(ParallelMode.GLOBAL):
            gpc.destroy()
    except BaseException:
        traceback.print_exc()


def _end(session: Any, cov: Any) -> None:
    """Tear down the fixtures still set up (session-, module-scoped), destroy ``gpc`` and save
    coverage."""
    from ..context import ParallelMode, gpc

    try:
        if session is not None:
            session._setupstate.teardown_exact(None)
    except BaseException:
        traceback.print_exc()
    try:
        if gpc.is_initialized(ParallelMode.GLOBAL):
            gpc.destroy()
    except BaseException:
        traceback.print_exc()
    if cov is not None:
        cov.stop()
        cov.save()


def run_session(
    conn: Connection, rank: int, world_size: int, setup: dict[str, Any], controller: int, warning: str
) -> None:
    """The rank's session process: start coverage and a pytest session like the controller's,
    collect, say ``ready`` (with the collected node ids and parameters, for the controller to
    compare across ranks), then run each ``("run", spec)`` until ``("end",)`` or the controller
    going away (``("end", {"abort": True})``, after a test that left a group unbalanced: abort
    ``gpc``'s groups first). After a test that did not pass here, ``gpc`` is destroyed at once
    (its connections close, so peers waiting for this rank in a collective end too). Every
    test's calls on process groups are counted (:mod:`parallelctx.testing.balance`). Returns
    None; the caller exits the process."""
    cov = _start_coverage(setup.get("coverage"))
    plugin = RankPlugin(rank, world_size)
    session = None
    store = None
    zygote = os.getppid()
    try:
        for entry in reversed(setup["sys_path"]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        balance.install()
        session = start_session(setup["args"], setup["dir"], setup["basetemp"], plugin)
        items = collect(session, setup["files"], plugin)
        _forget_gpc()
        store = serve_store(world_size, float(setup.get("store_timeout", 600.0))) if rank == 0 else None
    except BaseException:
        conn.send(("ready", {"error": traceback.format_exc()}))
        _end(session, cov)
        return
    conn.send(
        (
            "ready",
            {
                "error": "",
                "pid": os.getpid(),
                "port": int(store.port) if store is not None else 0,
                "items": [(nodeid, params_of(item)) for nodeid, item in items.items()],
                "warning": warning,
            },
        )
    )
    while True:
        while not conn.poll(1.0):
            if os.getppid() != zygote:
                _end(session, cov)
                return
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] != "run":  # "end"
            if len(message) > 1 and isinstance(message[1], dict) and message[1].get("abort"):
                _abort_gpc()
            break
        spec = message[1]
        try:
            result = _run_one(session, items, plugin, spec, int(spec["port"]))
        except BaseException:
            result = _failed(rank, f"rank {rank}: the pool failed to run the test", traceback.format_exc())
        if result["outcome"] != "passed":
            _drop_gpc(plugin)  # closes its connections: peers waiting in a collective end too
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(("result", result))
    del store
    _end(session, cov)
