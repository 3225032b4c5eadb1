"""The pytest plugin (entry point ``pytest11: parallelctx``): ``@pytest.mark.parallel`` runs a
test on N ranks with ``gpc`` launched for a layout, on a pool of processes reused across tests.

Unmarked tests run as usual. A marked test runs none of its fixtures in the pytest process (the
controller): its node id goes to every rank of the pool for its world size, where a pytest
session like the controller's runs the whole item (fixtures, markers, the test) in a process
forked for this test alone (:mod:`parallelctx.testing.rank`). See docs/testing.md.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "LAYOUT_ARG",
    "MarkerError",
    "PoolSet",
    "layout_id",
    "resolve_marker",
    "simulated_ranks",
]

#: Name of the pseudo-argument that carries one entry of ``layouts=`` (one test id per layout).
LAYOUT_ARG = "parallel_layout"
PARALLEL_KEYS = ("tensor", "pipeline", "context", "expert", "expert_tensor", "order", "data", "modules")
MARKER_KEYS = ("world_size", *PARALLEL_KEYS, "config", "timeout", "layouts", "simulate", "ranks", "local")
#: Pool processes that play the ranks of a ``simulate=True`` test, a batch at a time.
SIMULATE_POOL_SIZE = 4
DEFAULT_TIMEOUT_S = 180.0
#: Seconds added to a parallel test's timeout for pytest-timeout, so that the plugin's own
#: report (with every rank's stack) comes first.
PYTEST_TIMEOUT_MARGIN_S = 60.0
_ABBREV = {
    "world_size": "w",
    "tensor": "tp",
    "pipeline": "pp",
    "context": "cp",
    "expert": "ep",
    "expert_tensor": "etp",
    "data": "dp",
}
_POOLS = pytest.StashKey["PoolSet"]()
_ON_RANK = pytest.StashKey[bool]()
_USER_TIMEOUT = pytest.StashKey["float | None"]()
_NEXT = pytest.StashKey[str]()


class MarkerError(ValueError):
    """A ``@pytest.mark.parallel`` marker with a bad argument; the message names it and the fix."""


def layout_id(layout: Mapping[str, Any]) -> str:
    """The test id part for one entry of ``layouts=``: ``w4-tp2-pp2``, ``tp2-order-tp-pp-dp``,
    ``tp2-dpr2-dps2`` (``data=dict(replicate=2, shard=2)``), ``modules-vision-language``.

    Returns:
        The id string.
    """
    parts = []
    for key, value in layout.items():
        if key == "order":
            parts.append(f"order-{value}")
        elif key == "data" and isinstance(value, Mapping):  # dict(replicate=2, shard=4): dpr2-dps4
            short = {"size": "dp", "replicate": "dpr", "shard": "dps"}
            parts.extend(f"{short.get(k, k)}{v}" for k, v in value.items())
        elif key == "modules" and isinstance(value, Mapping):  # modules-vision-language
            parts.append("modules-" + "-".join(map(str, value)))
        elif key in _ABBREV:
            parts.append(f"{_ABBREV[key]}{value}")
        else:
            parts.append(f"{key}{value}")
    return "-".join(parts) or "default"


def _read_config(config: Any, test_file: Path) -> dict[str, Any]:
    """The marker's ``config=`` as a plain dict (a file path is relative to the test file)."""
    from parallelctx.config import Config

    if config is None:
        return {}
    if isinstance(config, Config):
        return config.to_dict()
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_absolute() and (test_file.parent / path).exists():
            path = test_file.parent / path
        return Config.from_file(path).to_dict()
    raise MarkerError(f"config={config!r} must be a dict, a Config or a config file path")


def _suggest(unknown: list[Any]) -> str:
    """``did you mean 'tensor'? `` for the unknown marker arguments that misspell a valid one."""
    import difflib

    guesses = []
    for key in unknown:
        found = difflib.get_close_matches(str(key).lower(), MARKER_KEYS, n=1, cutoff=0.6)
        if found:
            guesses.append(f"{found[0]!r} for {key!r}" if len(unknown) > 1 else repr(found[0]))
    return f"did you mean {', '.join(guesses)}? " if guesses else ""


def _set_size(parallel: dict[str, Any], key: str, value: Any, field: str = "size") -> None:
    current = parallel.get(key)
    if isinstance(current, Mapping):
        parallel[key] = {**current, field: value}
    elif field == "size":
        parallel[key] = value
    else:
        parallel[key] = {"size": current if current is not None else 1, field: value}


def resolve_marker(
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    layout: Mapping[str, Any] | None,
    test_file: Path,
    default_timeout: float,
) -> tuple[int, dict[str, Any], float]:
    """Turn a marker's arguments (and one ``layouts=`` entry) into what the pool runs.

    Returns:
        ``(world_size, config dict, timeout seconds)``; the config is validated and its layout
        fits the world size.

    Raises:
        MarkerError: an unknown key, a missing or bad ``world_size`` or ``timeout``, a
            ``dist.init_method`` (the pool picks the rendezvous), or a layout that does not fit.
        ConfigError, pydantic.ValidationError: a bad ``config=``.
    """
    from parallelctx.config import Config
    from parallelctx.planning.layout import LayoutError

    merged = dict(kwargs)
    if args:
        if len(args) > 1 or "world_size" in merged:
            raise MarkerError(
                f"@pytest.mark.parallel takes world_size as its only positional argument, got {args}"
            )
        merged["world_size"] = args[0]
    unknown = sorted(set(merged) - set(MARKER_KEYS), key=str)
    if unknown:
        raise MarkerError(
            f"@pytest.mark.parallel got unknown argument{'s' if len(unknown) > 1 else ''} {unknown}; "
            f"{_suggest(unknown)}valid: {', '.join(MARKER_KEYS)}"
        )
    merged.pop("layouts", None)
    merged.pop("simulate", None)  # read by simulated_ranks
    merged.pop("ranks", None)
    merged.pop("local", None)  # read by pytest_pyfunc_call
    if layout:
        bad = sorted(set(layout) - {"world_size", *PARALLEL_KEYS})
        if bad:
            raise MarkerError(
                f"a layouts= entry has keys {bad}; {_suggest(bad)}each entry takes world_size and "
                f"{', '.join(PARALLEL_KEYS)}"
            )
        merged.update(layout)
    world_size = merged.get("world_size")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MarkerError(
            f"@pytest.mark.parallel needs world_size=<ranks>, a positive int; got {world_size!r}"
        )
    timeout = merged.get("timeout", default_timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise MarkerError(f"timeout={timeout!r} must be positive seconds, e.g. timeout=60")
    raw = _read_config(merged.get("config"), test_file)
    parallel = dict(raw.get("parallel") or {})
    for key in ("tensor", "pipeline", "context", "expert"):
        if key in merged:
            _set_size(parallel, key, merged[key])
    if "expert_tensor" in merged:
        _set_size(parallel, "expert", merged["expert_tensor"], field="tensor")
    for key in ("order", "data", "modules"):
        if key in merged:
            parallel[key] = merged[key]
    raw["parallel"] = parallel
    dist_section = dict(raw.get("dist") or {})
    if dist_section.get("init_method"):
        raise MarkerError(
            f"config dist.init_method={dist_section['init_method']!r}: the test pool picks the rendezvous; "
            "remove init_method from the config of a parallel test"
        )
    # collectives give up a minute after the test does, so a hang is reported with its stack first
    dist_section.setdefault("timeout", float(timeout) + 60.0)
    raw["dist"] = dist_section
    cfg = Config(raw)
    par = cfg.parallel
    try:
        par.layout_or_plan(world_size)
    except LayoutError as exc:
        raise MarkerError(f"@pytest.mark.parallel(world_size={world_size}, ...): {exc}") from None
    return world_size, raw, float(timeout)


def simulated_ranks(
    kwargs: Mapping[str, Any], world_size: int, config: Mapping[str, Any]
) -> list[int] | None:
    """The ranks a ``simulate=True`` marker runs the test as (dry runs on torch's fake
    backend): its ``ranks=``, else the layout's covering set
    (:func:`parallelctx.planning.covering.covering_ranks`: every coordinate of every axis held
    by some rank, rank 0 and the last rank, about as many ranks as the largest axis).

    Returns:
        The ranks, ascending; None for a marker without ``simulate=True``.

    Raises:
        MarkerError: ``ranks=`` without ``simulate=True``, or a rank outside the world.
    """
    from parallelctx.config import Config
    from parallelctx.planning.covering import covering_ranks
    from parallelctx.planning.layout import Layout

    if kwargs.get("simulate") and kwargs.get("local"):
        raise MarkerError(
            "@pytest.mark.parallel takes simulate=True (dry runs on the fake backend: the layout at any "
            "scale, no numbers) or local=True (every rank as a thread: the numbers), not both"
        )
    if not kwargs.get("simulate"):
        if "ranks" in kwargs:
            raise MarkerError(
                "@pytest.mark.parallel(ranks=...) needs simulate=True (dry runs of those ranks)"
            )
        return None
    ranks = kwargs.get("ranks")
    if ranks is None:
        layout = Config(dict(config)).parallel.layout_or_plan(world_size)
        if isinstance(layout, Layout):
            return covering_ranks(layout)
        return sorted({r for lay in layout.layouts.values() for r in covering_ranks(lay)})
    if not isinstance(ranks, (list, tuple, range)) or not ranks:
        raise MarkerError(f"ranks={ranks!r} must be a non-empty list of ranks, e.g. ranks=[0, 17, 4095]")
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size]
    if bad:
        raise MarkerError(f"ranks={list(ranks)}: {bad} lie outside [0, world_size={world_size})")
    return sorted(set(ranks))


class PoolSet:
    """The session's pools, one per world size, started on first use and replaced when broken."""

    def __init__(self, devices: str, start_timeout: float, session: dict[str, Any] | None = None) -> None:
        self.devices = devices
        self.start_timeout = start_timeout
        #: What every rank's pytest session is made from (see :class:`~.pool.Pool`).
        self.session: dict[str, Any] = session or {"args": [], "dir": os.getcwd(), "files": []}
        self.pools: dict[int, Any] = {}
        self.started = 0
        self.warned = False

    def get(self, world_size: int) -> Any:
        """Return a live pool of ``world_size`` ranks, starting one if needed.

        Raises:
            PoolError: a worker could not start.
        """
        from .pool import Pool, pick_devices

        pool = self.pools.get(world_size)
        if pool is not None and not pool.alive():
            pool.kill()
            pool = None
        if pool is None:
            pool = Pool(
                world_size,
                pick_devices(world_size, self.devices),
                self.start_timeout,
                {**self.session, "sys_path": list(sys.path)},
            )
            self.pools[world_size] = pool
            self.started += 1
        return pool

    def discard(self, world_size: int) -> None:
        """Kill the pool of ``world_size`` ranks (after a hang, a death or a bad teardown)."""
        pool = self.pools.pop(world_size, None)
        if pool is not None:
            pool.kill()

    def close(self) -> None:
        """Stop every pool."""
        for world_size in list(self.pools):
            self.pools.pop(world_size).close()


# ----------------------------------------------------------------------------- hooks


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ini options ``parallel_timeout``, ``parallel_devices``, ``parallel_start_timeout``."""
    parser.addini(
        "parallel_timeout",
        "seconds a @pytest.mark.parallel test may run before its ranks' "
        f"stacks are dumped and it fails (default {DEFAULT_TIMEOUT_S:g})",
        default=str(DEFAULT_TIMEOUT_S),
    )
    parser.addini(
        "parallel_devices",
        "'auto': nccl with one GPU per rank where every rank has one, else gloo "
        "on CPU; 'cpu': always gloo on CPU",
        default="auto",
    )
    parser.addini(
        "parallel_start_timeout",
        "seconds a pool of worker processes may take to start (default 120)",
        default="120",
    )


def _ini_float(config: pytest.Config, name: str) -> float:
    value = config.getini(name)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise pytest.UsageError(f"ini option {name}={value!r} must be a number of seconds") from None
    if number <= 0:
        raise pytest.UsageError(f"ini option {name}={value!r} must be positive")
    return number


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``parallel`` marker and make the session's (empty) pool set."""
    config.addinivalue_line(
        "markers",
        "parallel(world_size, tensor=, pipeline=, context=, expert=, expert_tensor=, order=, config=, "
        "timeout=, "
        "layouts=, simulate=, ranks=, local=): run the test on world_size ranks with parallelctx's gpc launched "
        "(simulate=True: as the given ranks of world_size in dry runs; local=True: every rank as a "
        "thread of this process, with real numbers; docs/testing.md)",
    )
    from .rank import RANK_PLUGIN_NAME

    config.stash[_ON_RANK] = config.pluginmanager.has_plugin(RANK_PLUGIN_NAME)
    devices = str(config.getini("parallel_devices")).strip()
    if devices not in ("auto", "cpu"):
        raise pytest.UsageError(f"ini option parallel_devices={devices!r} must be 'auto' or 'cpu'")
    session = {
        "args": [str(a) for a in config.invocation_params.args],
        "dir": str(config.invocation_params.dir),
        "files": [],
        "coverage": None,
    }
    config.stash[_POOLS] = PoolSet(devices, _ini_float(config, "parallel_start_timeout"), session)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Note how pytest-cov measures (when it does), for the ranks to measure alike."""
    pools = session.config.stash.get(_POOLS, None)
    if pools is not None and not session.config.stash.get(_ON_RANK, False):
        pools.session["coverage"] = _coverage_settings(session.config)


def _coverage_settings(config: pytest.Config) -> dict[str, Any] | None:
    """pytest-cov's settings in this process (its source, branch, config file and the data file
    it combines), or None when it does not measure."""
    plugin = config.pluginmanager.get_plugin("_cov")
    controller: Any = getattr(plugin, "cov_controller", None)
    cov = getattr(controller, "cov", None)
    if cov is None or getattr(plugin, "_disabled", False):
        return None
    topdir = getattr(controller, "topdir", None) or str(config.invocation_params.dir)
    return {
        "data_file": os.path.join(topdir, cov.config.data_file),
        "source": controller.cov_source,
        "branch": controller.cov_branch,
        "config_file": controller.cov_config,
    }


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop the session's pools."""
    pools = config.stash.get(_POOLS, None)
    if pools is not None:
        pools.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test id per entry of the marker's ``layouts=``; a marker named like a misspelt
    ``parallel`` (``paralel``, ``Parallel``) is a collection error, not a test run unlaunched."""
    from parallelctx.config import near_miss_section

    for mark in metafunc.definition.iter_markers():
        if mark.name != "parallel" and near_miss_section(mark.name) == "parallel":
            raise MarkerError(
                f"{metafunc.definition.nodeid}: @pytest.mark.{mark.name} is not parallelctx's marker; "
                "did you mean @pytest.mark.parallel? (the test would run in this one process, unlaunched)"
            )
    marker = metafunc.definition.get_closest_marker("parallel")
    if marker is None or "layouts" not in marker.kwargs:
        return
    layouts = marker.kwargs["layouts"]
    if (
        not isinstance(layouts, (list, tuple))
        or not layouts
        or not all(isinstance(x, Mapping) for x in layouts)
    ):
        raise MarkerError(
            f"{metafunc.definition.nodeid}: layouts={layouts!r} must be a non-empty list of dicts, "
            "e.g. layouts=[dict(tensor=2), dict(tensor=2, pipeline=2)]"
        )
    if LAYOUT_ARG not in metafunc.fixturenames:
        metafunc.fixturenames.append(LAYOUT_ARG)
    metafunc.parametrize(LAYOUT_ARG, [dict(x) for x in layouts], ids=[layout_id(x) for x in layouts])


def _pytest_timeout_of(item: pytest.Item) -> float | None:
    """The limit pytest-timeout gives ``item``: its ``@pytest.mark.timeout`` or the
    ``--timeout`` option (None when neither is set or pytest-timeout is not installed)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        value = (
            item.config.getoption("timeout", None) if item.config.pluginmanager.hasplugin("timeout") else None
        )
    try:
        number = float(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None
    return number if number is not None and number > 0 else None


def _default_timeout(item: pytest.Item) -> float:
    """A parallel test's timeout when its marker has no ``timeout=``: pytest-timeout's (marker,
    then ``--timeout``), else the ini ``parallel_timeout``."""
    # noted before the plugin gave pytest-timeout its own marker (see modifyitems)
    found = item.stash[_USER_TIMEOUT] if _USER_TIMEOUT in item.stash else _pytest_timeout_of(item)
    return found if found is not None else _ini_float(item.config, "parallel_timeout")


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("parallel")
    default = _default_timeout(item)
    if marker is None:
        return default
    timeout = marker.kwargs.get("timeout", default)
    return float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else default


def _is_local(item: pytest.Item) -> bool:
    """Whether a test is marked ``local=True`` (run here, as threads)."""
    marker = item.get_closest_marker("parallel")
    return marker is not None and bool(marker.kwargs.get("local"))


def _world_size_of(item: pytest.Item) -> int | None:
    """The world size a marked test runs on (None when its marker is bad: the test reports that)."""
    marker = item.get_closest_marker("parallel")
    if marker is None:
        return None
    found = item.callspec.params.get(LAYOUT_ARG) if hasattr(item, "callspec") else None
    layout = found if isinstance(found, Mapping) else {}
    size = layout.get("world_size", marker.kwargs.get("world_size", marker.args[0] if marker.args else None))
    return size if isinstance(size, int) and not isinstance(size, bool) else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's limit of a marked test (its marker or ``--timeout``) becomes the
    plugin's timeout, and pytest-timeout gets that plus a margin, so the plugin's report (with
    every rank's stack) comes first. In the controller, a marked test runs no fixture (its
    ranks run them all), the files of marked tests are noted for the ranks' sessions to
    collect, and each pool's test order is noted (each test's next on the same pool decides
    which fixtures the ranks keep)."""
    marked = [item for item in items if item.get_closest_marker("parallel") is not None]
    if config.pluginmanager.hasplugin("timeout"):
        for item in marked:
            item.stash[_USER_TIMEOUT] = _pytest_timeout_of(item)
            item.add_marker(pytest.mark.timeout(_timeout_of(item) + PYTEST_TIMEOUT_MARGIN_S), append=False)
    if config.stash.get(_ON_RANK, False):
        return
    # a local=True test runs here, fixtures and all, as threads: it needs no pool
    marked = [item for item in marked if not _is_local(item)]
    for item in marked:
        if isinstance(item, pytest.Function):
            item.fixturenames = []
    pools = config.stash.get(_POOLS, None)
    if pools is not None:
        files = set(pools.session["files"]) | {str(item.path) for item in marked}
        pools.session["files"] = sorted(files)
        previous: dict[int, pytest.Item] = {}
        for item in marked:
            size = _world_size_of(item)
            if size is None:
                continue
            if size in previous:
                previous[size].stash[_NEXT] = item.nodeid
            previous[size] = item


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtestloop(session: pytest.Session) -> Any:
    """End the pools when the tests are done, inside pytest-cov's own wrapper, so the ranks'
    coverage data is saved before pytest-cov combines it."""
    try:
        return (yield)
    finally:
        pools = session.config.stash.get(_POOLS, None)
        if pools is not None:
            pools.close()


def _test_folder(item: pytest.Function) -> Path:
    """A new folder for this test, shared by all its ranks (their ``tmp_path``), made the way
    pytest's own ``tmp_path`` is."""
    name = re.sub(r"[\W]", "_", item.name)[:30]
    factory: pytest.TempPathFactory = item.config._tmp_path_factory  # type: ignore[attr-defined]
    return factory.mktemp(name, numbered=True)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a marked test on its pool instead of in this process (a ``local=True`` one here, as
    threads); leave other tests alone (and on a rank, run it here)."""
    marker = pyfuncitem.get_closest_marker("parallel")
    if marker is None or pyfuncitem.config.stash.get(_ON_RANK, False):
        return None
    from .rank import WAY_ROUND, pack_params
    from .report import raise_for

    found = pyfuncitem.callspec.params.get(LAYOUT_ARG) if hasattr(pyfuncitem, "callspec") else None
    layout: Mapping[str, Any] | None = found if isinstance(found, Mapping) else None
    try:
        world_size, config, timeout = resolve_marker(
            marker.args,
            marker.kwargs,
            layout,
            Path(str(pyfuncitem.path)),
            _default_timeout(pyfuncitem),
        )
    except ValueError as exc:  # MarkerError, ConfigError and pydantic's ValidationError
        problem = str(exc)
    else:
        problem = ""
    if problem:
        pytest.fail(problem, pytrace=False)
    try:
        simulated = simulated_ranks(marker.kwargs, world_size, config)
    except MarkerError as exc:
        pytest.fail(str(exc), pytrace=False)
    if simulated is not None:
        _run_simulated(pyfuncitem, world_size, simulated, config, timeout, layout)
        return True
    if _is_local(pyfuncitem):
        _run_local(pyfuncitem, world_size, config, timeout)
        return True
    pools: PoolSet = pyfuncitem.config.stash[_POOLS]
    from .pool import PoolError

    try:
        pool = pools.get(world_size)
    except PoolError as exc:
        pools.discard(world_size)
        problem = f"could not start a pool of {world_size} ranks: {exc}"
    if problem:
        pytest.fail(problem, pytrace=False)
    packed = pack_params(pyfuncitem)
    unsent = packed["unsent"]
    # the ranks take the values sent: only those that could not be sent must agree across ranks
    problem = pool.collection_problem(pyfuncitem.nodeid, compare_params=bool(unsent))
    if problem and unsent:
        reasons = "; ".join(f"{name}: {reason}" for name, (_, reason, _) in sorted(unsent.items()))
        problem += (
            f". The controller's values of {sorted(unsent)} cannot be sent to the ranks ({reasons}): "
            f"{WAY_ROUND}"
        )
    if problem:  # this test's parameters depend on the process: it fails, the others run
        pytest.fail(problem, pytrace=False)
    spec = {
        "nodeid": pyfuncitem.nodeid,
        "config": config,
        "timeout": timeout,
        "sys_path": list(sys.path),
        "cwd": str(Path.cwd()),
        "env": pool.environment(os.environ),
        "tmp_path": str(_test_folder(pyfuncitem)),
        "lazy_default_group": bool((config.get("dist") or {}).get("gloo_lazy_init", True)),
        "next": pyfuncitem.stash.get(_NEXT, None),
        "params": packed,
    }
    try:
        outcome = pool.run(spec, timeout)
    except PoolError:  # a rank process died between tests: once more on a fresh pool
        pools.discard(world_size)
        pool = pools.get(world_size)
        outcome = pool.run(spec, timeout)
    except BaseException:  # interrupted (Ctrl-C, pytest-timeout): the pool's state is unknown
        pools.discard(world_size)
        raise
    if not outcome.reusable:
        pools.discard(world_size)
    if pool.warning and not pools.warned:
        pools.warned = True
        import warnings

        warnings.warn(pool.warning, RuntimeWarning, stacklevel=1)
    _add_output(pyfuncitem, outcome)
    raise_for(outcome, timeout, layout_id(layout) if layout else None)
    return True


def _run_local(item: pytest.Function, world_size: int, config: dict[str, Any], timeout: float) -> None:
    """Run a ``local=True`` test as every rank of ``world_size``, threads of this process
    (:func:`parallelctx.local.run_local`), with the fixtures' values this process made."""
    from parallelctx.local import LocalRankError, run_local

    names = [name for name in item._fixtureinfo.argnames if name != LAYOUT_ARG]
    # run_local gives each rank its own deep copy of these (as each real rank makes its own
    # values), except pytest's own objects (monkeypatch, capsys, request, tmp_path_factory) and
    # values that cannot be copied, which the ranks share
    own = tuple(_rank_copy(item.funcargs[name]) for name in names)

    def body(*values: Any) -> Any:
        return item.obj(**{name: v.value if isinstance(v, _Shared) else v for name, v in zip(names, values)})

    failure = None
    try:
        run_local(body, world_size, config, args=own, timeout=timeout)
    except LocalRankError as exc:  # it names the ranks and holds the first one's traceback
        failure = str(exc)
    if failure is not None:
        pytest.fail(failure, pytrace=False)


class _Shared:
    """A fixture value every rank of a local test shares (deep-copying it keeps the one object)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


def _rank_copy(value: Any) -> Any:
    """The value as each rank of a local test gets it: deep-copied per rank (run_local copies
    its args), or shared (:class:`_Shared`) for pytest's own objects and values that cannot be
    copied."""
    import copy
    import types

    if type(value).__module__.startswith(("_pytest", "pytest")) or isinstance(
        value, (types.ModuleType, types.FunctionType, type)
    ):
        return _Shared(value)
    try:
        copy.deepcopy(value)
    except Exception:  # a lock, a socket, a process handle: one per process anyway
        return _Shared(value)
    return value


def _run_simulated(
    item: pytest.Function,
    world_size: int,
    ranks: list[int],
    config: dict[str, Any],
    timeout: float,
    layout: Mapping[str, Any] | None,
) -> None:
    """Run a ``simulate=True`` test as each of ``ranks`` of ``world_size`` (dry runs on torch's
    fake backend, :mod:`parallelctx.dryrun`): a batch of :data:`SIMULATE_POOL_SIZE` ranks at a
    time on the pooled workers, pool rank i playing the batch's i-th rank; then the ranks'
    reports are checked across ranks (:func:`parallelctx.cli.sweep.check_all`)."""
    from ..cli.sweep import check_all
    from .pool import PoolError
    from .rank import pack_params
    from .report import raise_for

    pools: PoolSet = item.config.stash[_POOLS]
    packed = pack_params(item)
    size = min(len(ranks), SIMULATE_POOL_SIZE)
    reports: dict[int, Any] = {}
    for start in range(0, len(ranks), size):
        batch = ranks[start : start + size]
        batch += [batch[-1]] * (size - len(batch))  # a short last batch: the last rank again
        spec = {
            "nodeid": item.nodeid,
            "config": config,
            "timeout": timeout,
            "sys_path": list(sys.path),
            "cwd": str(Path.cwd()),
            "tmp_path": str(_test_folder(item)),
            "simulate": {"world_size": world_size, "ranks": batch},
            "params": packed,
        }
        try:
            pool = pools.get(size)
            spec["env"] = pool.environment(os.environ)
            outcome = pool.run(spec, timeout)
        except PoolError as exc:
            pools.discard(size)
            pytest.fail(f"could not run simulated ranks {batch} on a pool of {size}: {exc}", pytrace=False)
        except BaseException:
            pools.discard(size)
            raise
        if not outcome.reusable:
            pools.discard(size)
        _add_output(item, outcome)
        raise_for(outcome, timeout, layout_id(layout) if layout else None)
        for result in outcome.results.values():
            if result.get("dry_run"):
                reports[result["dry_run"]["rank"]] = result["dry_run"]
    missing = sorted(set(ranks) - set(reports))
    problems = [f"simulated ranks {missing} sent no dry-run report"] if missing else []
    problems += check_all(reports)
    if problems:
        pytest.fail(
            f"dry runs of ranks {ranks} of {world_size}: cross-rank checks failed:\n" + "\n".join(problems),
            pytrace=False,
        )


def _add_output(item: pytest.Function, outcome: Any) -> None:
    """Each rank's output as report sections (shown for failures), lines prefixed by the rank:
    what pytest captured on the rank (stdout, stderr, log, per phase), then what the rank wrote
    outside pytest's capture (with ``-s`` it is printed after each test instead)."""
    merged: dict[str, list[str]] = {}
    for rank in sorted(outcome.results):
        for title, text in outcome.results[rank].get("sections", []):
            merged.setdefault(title, []).extend(f"[rank {rank}] {line}" for line in text.splitlines())
    for title, lines in merged.items():
        parts = title.split(" ")  # "Captured stdout call"
        if len(parts) == 3 and parts[0] == "Captured":
            item.add_report_section(parts[2], parts[1], "\n".join(lines) + "\n")
    for stream in ("stdout", "stderr"):
        texts = getattr(outcome, stream)
        lines = [f"[rank {rank}] {line}" for rank in sorted(texts) for line in texts[rank].splitlines()]
        if not lines:
            continue
        text = "\n".join(lines) + "\n"
        if item.config.getoption("capture", "fd") == "no":
            getattr(sys, stream).write(text)
        else:
            item.add_report_section("call", stream, text)
