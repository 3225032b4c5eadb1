"""Launch entry points: thin adapters that end in :meth:`ParallelContext.launch`.

``launch`` takes explicit values; ``launch_from_env`` detects the launcher from the table in
:mod:`parallelctx.env`; ``launch_from_torch`` / ``launch_from_slurm`` / ``launch_from_openmpi``
and ``init_dist`` name one entry of that table. Single-node worker processes: :mod:`parallelctx.spawn`.
"""

from __future__ import annotations

import difflib
import functools
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

from . import env as _env
from .config import ConfigError, ConfigLike, to_timedelta
from .config.args import LaunchArgumentError
from .context import ParallelContext, gpc
from .engines import guard_engines
from .env import LaunchEnvError, free_port
from .planning.layout import LayoutError
from .runtime.rendezvous import RendezvousError

__all__ = [
    "free_port",
    "init_dist",
    "launch",
    "launch_from_env",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]

logger = logging.getLogger("parallelctx")

_P = ParamSpec("_P")
_R = TypeVar("_R")

USER_ERRORS = (ConfigError, LayoutError, LaunchArgumentError, LaunchEnvError, RendezvousError)
"""Errors whose message says all (a bad config, layout, argument or environment, ranks that did
not meet): raised from the launch functions without the library's own frames, so that each
rank of a job prints a short traceback that ends in the user's call."""


def _short_traceback(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Wrap a launch function so that :data:`USER_ERRORS` leave it with the caller's frames only."""

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return func(*args, **kwargs)
        except USER_ERRORS as exc:
            raise exc.with_traceback(None) from exc.__cause__  # the same error, its own cause kept

    return wrapper


@_short_traceback
def launch(
    config: ConfigLike = None,
    rank: int = 0,
    world_size: int = 1,
    host: str | None = "127.0.0.1",
    port: int | None = None,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int | None = None,
    timeout: int | float | timedelta | None = None,
    init_method: str | None = None,
    local_world_size: int | None = None,
    simulate: Mapping[str, int] | None = None,
) -> ParallelContext:
    """Set up ``gpc`` for this process: config, default group, parallel groups, processes per
    node, device and seeds (:meth:`ParallelContext.launch`). Logs one summary line on the rank
    :meth:`~ParallelContext.is_rank_for_log` picks.

    ``simulate=dict(world_size=W, rank=R)``: a dry run of rank R of a W-rank job on torch's
    ``fake`` backend, in this process alone (:mod:`parallelctx.dryrun`, docs/dry_run.md).

    ``backend``, ``seed``, ``timeout`` and ``init_method`` default to the config's ``dist`` and
    ``seed`` values. ``local_world_size``, when the launcher gives it, is checked against the
    processes counted on this host, and a mismatch is logged as a warning. Calling it again
    after ``gpc.destroy()``, with the same host and port, works.

    Returns:
        ``gpc``.

    Raises:
        RuntimeError: ``gpc`` is already launched (call ``gpc.destroy()`` first), or a peer does
            not arrive within the timeout.
        LaunchArgumentError: a bad argument (both a ValueError and a TypeError; the message
            names it, e.g. ``port=2.5``).
        ValueError: a bad config value (ConfigError, LayoutError and pydantic's ValidationError
            are ValueErrors).
    """
    return _guarded(
        gpc.launch(
            config,
            rank=rank,
            world_size=world_size,
            host=host,
            port=port,
            backend=backend,
            local_rank=local_rank,
            seed=seed,
            timeout=timeout,
            init_method=init_method,
            local_world_size=local_world_size,
            simulate=simulate,
        )
    )


def _guarded(ctx: ParallelContext) -> ParallelContext:
    """Guard the engines imported now for ``ctx`` (:func:`parallelctx.engines.guard_engines`);
    returns ``ctx``."""
    guard_engines(ctx)
    return ctx


def _launch_found(
    found: _env.LaunchEnv,
    config: ConfigLike,
    host: str | None,
    port: int | None,
    **kwargs: Any,
) -> ParallelContext:
    """Launch from a detected environment. ``host``/``port`` override the launcher's; where
    neither gives them, the launcher's rendezvous hook (e.g. the mpi4py broadcast) may."""
    host = host or found.master_addr
    port = port or found.master_port
    if found.world_size > 1 and (host is None or port is None):
        entry = _env.launcher_named(found.launcher)
        hooked = entry.rendezvous(found) if entry.rendezvous is not None else None
        if hooked is None:
            missing = [n for n, v in (("MASTER_ADDR", host), ("MASTER_PORT", port)) if v is None]
            raise _env.LaunchEnvError(
                f"{found.launcher} gives no rendezvous address and {' and '.join(missing)} "
                f"{'are' if len(missing) > 1 else 'is'} not set: export MASTER_ADDR=<host of rank 0> "
                "and MASTER_PORT=<free port> to every rank (mpirun -x MASTER_ADDR -x MASTER_PORT, "
                "mpiexec -genv MASTER_ADDR ...), pass host= and port=, or install mpi4py so that "
                "rank 0 can broadcast them"
            )
        host, port = host or hooked[0], port or hooked[1]
    ctx = gpc.launch(
        config,
        rank=found.rank,
        world_size=found.world_size,
        host=host,
        port=port,
        local_rank=found.local_rank,
        local_world_size=found.local_world_size,
        **kwargs,
    )
    _guarded(ctx)
    if found.num_nodes is not None and found.num_nodes != ctx.num_nodes:
        logger.warning(
            "%s says the job spans %d nodes, but its ranks run on %d distinct hosts (%s); "
            "check the launcher's node list and the per-node process count",
            found.launcher,
            found.num_nodes,
            ctx.num_nodes,
            ", ".join(sorted(set(ctx.hostnames))),
        )
    return ctx


def _launch_named(
    name: str,
    config: ConfigLike,
    host: str | None,
    port: int | None,
    backend: str | None,
    seed: int | None,
    timeout: int | float | timedelta | None,
) -> ParallelContext:
    """Launch from the variables of the launcher ``name`` of :data:`parallelctx.env.LAUNCHERS`
    (under ``parallelctx dry-run``: the armed dry run, which needs no launcher variables)."""
    if _dry_run_armed():
        return _guarded(gpc.launch(config, backend=backend, seed=seed, timeout=timeout))
    entry = _env.launcher_named(name)
    found = entry.detect(None, True)
    if found is None:  # a detector called with required=True raises first; kept for type checkers
        raise _env.LaunchEnvError(entry.hint)
    return _launch_found(found, config, host, port, backend=backend, seed=seed, timeout=timeout)


@_short_traceback
def launch_from_torch(
    config: ConfigLike = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: int | float | timedelta | None = None,
) -> ParallelContext:
    """Launch from torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
    (and LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, which are checked against the hosts counted).

    Returns:
        ``gpc``.

    Raises:
        LaunchEnvError: a variable is missing; the message names it and says to use torchrun.
        Anything :func:`launch` raises.
    """
    return _launch_named("torchrun", config, None, None, backend, seed, timeout)


@_short_traceback
def launch_from_slurm(
    config: ConfigLike = None,
    host: str | None = None,
    port: int | None = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: int | float | timedelta | None = None,
) -> ParallelContext:
    """Launch a task started by ``srun``: rank SLURM_PROCID, world SLURM_NTASKS, local rank
    SLURM_LOCALID, node SLURM_NODEID (details in :func:`parallelctx.env.from_slurm`).

    ``host`` defaults to MASTER_ADDR, else the first host of the step's node list; ``port`` to
    MASTER_PORT, else a port derived from the job id (:func:`parallelctx.env.slurm_port`).
    ``backend``, ``seed`` and ``timeout`` default to the config's.

    Returns:
        ``gpc``.

    Raises:
        LaunchEnvError: not inside an srun step (a batch shell of a multi-task job is refused
            with a message that says to use srun), or inconsistent SLURM_* variables.
        Anything :func:`launch` raises.
    """
    return _launch_named("slurm", config, host, port, backend, seed, timeout)


@_short_traceback
def launch_from_openmpi(
    config: ConfigLike = None,
    host: str | None = None,
    port: int | None = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: int | float | timedelta | None = None,
) -> ParallelContext:
    """Launch a rank started by an MPI launcher: Open MPI (OMPI_COMM_WORLD_*), MPICH / Intel MPI
    (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID) or MVAPICH (MV2_COMM_WORLD_*).

    MPI gives no rendezvous address: ``host``/``port`` default to MASTER_ADDR/MASTER_PORT; when
    those are not set either and mpi4py is installed, rank 0 broadcasts its host name and a free
    port.

    Returns:
        ``gpc``.

    Raises:
        LaunchEnvError: no or inconsistent MPI variables, or no host/port from any source (the
            message says to pass them or export MASTER_ADDR and MASTER_PORT).
        Anything :func:`launch` raises.
    """
    return _launch_named("mpi", config, host, port, backend, seed, timeout)


@_short_traceback
def launch_from_env(
    config: ConfigLike = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: int | float | timedelta | None = None,
    host: str | None = None,
    port: int | None = None,
) -> ParallelContext:
    """Detect the launcher (:func:`parallelctx.env.detect`: torchrun, then MPI, then a Slurm
    step, then plain ``env://`` variables, else a world of one) and launch from what it set.
    ``host``/``port`` override the detected rendezvous address.

    Returns:
        ``gpc``.

    Raises:
        LaunchEnvError: the launcher's variables are incomplete or inconsistent, this is a Slurm
            batch shell of a multi-task job (start the script with srun), or WORLD_SIZE > 1 with
            no launcher that set this process's rank.
        Anything :func:`launch` raises.
    """
    if _dry_run_armed():
        return _guarded(gpc.launch(config, backend=backend, seed=seed, timeout=timeout))
    return _launch_found(_env.detect(), config, host, port, backend=backend, seed=seed, timeout=timeout)


def _dry_run_armed() -> bool:
    """True under ``parallelctx dry-run``: every launch of the process is its dry run, whatever
    launcher the script names (the simulated rank comes from the dry run, not the environment)."""
    return bool(getattr(gpc.dry_run, "armed", False))


@_short_traceback
def init_dist(launcher: str, backend: str | None = None, **kwargs: Any) -> ParallelContext:
    """Launch by launcher name, any name or alias of :data:`parallelctx.env.LAUNCHERS`:
    ``"pytorch"`` / ``"torchrun"`` (:func:`launch_from_torch`), ``"slurm"``
    (:func:`launch_from_slurm`), ``"mpi"`` (:func:`launch_from_openmpi`), ``"env"``.

    ``backend`` None takes the config's ``dist.backend`` (default ``"auto"``: nccl with CUDA,
    else gloo), as every launch function does. ``kwargs``: ``config``, ``seed``, ``timeout``
    (seconds as an int or float, or a :class:`datetime.timedelta`), ``host``, ``port``.

    Returns:
        ``gpc``.

    Raises:
        ValueError: an unknown launcher; the message lists the valid names.
        TypeError: an argument no launch function takes.
        Anything the launch raises.
    """
    _env.launcher_named(launcher)  # ValueError with the valid names before anything starts
    if kwargs.get("timeout") is not None:
        to_timedelta(kwargs["timeout"], "timeout")  # TypeError with the right forms, before detection
    takes = ("config", "seed", "timeout", "host", "port")
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        close = difflib.get_close_matches(unknown[0].lower(), (*takes, "backend"), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"init_dist() got unexpected arguments {unknown}{hint}; it takes backend, config, seed, "
            "timeout, host and port"
        )
    return _launch_named(
        launcher,
        kwargs.get("config"),
        kwargs.get("host"),
        kwargs.get("port"),
        backend,
        kwargs.get("seed"),
        kwargs.get("timeout"),
    )
