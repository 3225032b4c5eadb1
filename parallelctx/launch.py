"""Launch entry points: thin adapters that end in the same :func:`launch`.

``launch`` does the work; ``launch_from_torch`` and ``launch_from_env`` read what the launcher
put in the environment (:mod:`parallelctx.env`); ``spawn`` starts local worker processes.
"""

from __future__ import annotations

import logging
import pickle
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import env as _env
from .config import Config, to_timedelta
from .context import ParallelContext, gpc

__all__ = [
    "SpawnError",
    "free_port",
    "init_dist",
    "launch",
    "launch_from_env",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "spawn",
]

logger = logging.getLogger("parallelctx")

ConfigLike = Config | Mapping[str, Any] | str | Path | None


def _gpc() -> ParallelContext:
    return gpc


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
) -> ParallelContext:
    """Set up ``gpc`` for this process: config, default group, parallel groups, processes per
    node, device and seeds. Logs one summary line on the rank :meth:`is_rank_for_log` picks.

    ``backend``, ``seed``, ``timeout`` and ``init_method`` default to the config's ``dist`` and
    ``seed`` values. ``local_world_size``, when the launcher gives it, is checked against the
    processes counted on this host, and a mismatch is logged as a warning.

    Returns:
        ``gpc``.

    Raises:
        RuntimeError: ``gpc`` is already launched (call ``gpc.destroy()`` first), or a peer does
            not arrive within the timeout.
        TypeError: ``timeout`` is neither seconds nor a timedelta.
        ValueError: a bad rank, port, backend, seed or config value (ConfigError, LayoutError and
            pydantic's ValidationError are ValueErrors).
    """
    gpc = _gpc()
    if gpc._global_rank >= 0:
        raise RuntimeError("parallelctx is already launched in this process; call gpc.destroy() first")
    cfg = gpc.load_config(config)
    wait = to_timedelta(timeout) if timeout is not None else cfg.dist.timeout
    try:
        if local_rank is not None:
            gpc._local_rank = local_rank
        gpc.init_global_dist(
            rank,
            world_size,
            backend=backend or cfg.dist.backend,
            host=host,
            port=port,
            timeout=wait,
            init_method=init_method or cfg.dist.init_method,
        )
        gpc.init_parallel_groups()
        on_node = gpc.detect_num_processes_on_current_node()
        gpc.set_device()
        gpc.set_seed(seed)
    except BaseException:
        gpc.destroy()
        raise
    if local_world_size is not None and local_world_size != on_node:
        logger.warning(
            "the launcher says %d processes run on this node, but %d ranks share host %r; "
            "check the launcher's host list and the per-node process count",
            local_world_size,
            on_node,
            socket.gethostname(),
        )
    if gpc.is_rank_for_log():
        logger.info(gpc.summary())
    return gpc


def _launch_env(found: _env.LaunchEnv, config: ConfigLike, **kwargs: Any) -> ParallelContext:
    """Launch from a detected environment; warn when the node count disagrees with the hosts."""
    gpc = launch(
        config,
        rank=found.rank,
        world_size=found.world_size,
        host=kwargs.pop("host", None) or found.master_addr,
        port=kwargs.pop("port", None) or found.master_port,
        local_rank=found.local_rank,
        local_world_size=found.local_world_size,
        **kwargs,
    )
    if found.num_nodes is not None and found.num_nodes != gpc.num_nodes:
        logger.warning(
            "%s says the job spans %d nodes, but its ranks run on %d distinct hosts (%s); "
            "check the launcher's node list and the per-node process count",
            found.launcher,
            found.num_nodes,
            gpc.num_nodes,
            ", ".join(sorted(set(gpc.hostnames))),
        )
    return gpc


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
    found = _env.from_torchrun(required=True)
    if found is None:  # required=True raises first; kept for type checkers
        raise _env.LaunchEnvError(_env.TORCHRUN_HINT)
    return _launch_env(found, config, backend=backend, seed=seed, timeout=timeout)


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
    ``backend``, ``seed`` and ``timeout`` default to the config's (``"auto"``, 1024, 30 min).

    Returns:
        ``gpc``.

    Raises:
        LaunchEnvError: not inside an srun step (a batch shell of a multi-task job is refused
            with a message that says to use srun), or inconsistent SLURM_* variables.
        Anything :func:`launch` raises.
    """
    found = _env.from_slurm(required=True)
    if found is None:  # required=True raises first; kept for type checkers
        raise _env.LaunchEnvError(_env.SLURM_HINT)
    return _launch_env(found, config, backend=backend, seed=seed, timeout=timeout, host=host, port=port)


def _mpi4py_master(found: _env.LaunchEnv) -> tuple[str, int] | None:
    """Rank 0's host name and a free port of it, broadcast with mpi4py; None without mpi4py."""
    try:
        from mpi4py import MPI  # optional dependency
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != found.world_size or comm.Get_rank() != found.rank:
        raise _env.LaunchEnvError(
            f"mpi4py sees rank {comm.Get_rank()} of {comm.Get_size()} but the launcher says rank "
            f"{found.rank} of {found.world_size}: mpi4py is built against another MPI than the one "
            "that started this job; export MASTER_ADDR and MASTER_PORT instead"
        )
    mine = (socket.gethostname(), free_port("")) if found.rank == 0 else None
    host, port = comm.bcast(mine, root=0)
    return str(host), int(port)


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
    found = _env.from_mpi(required=True)
    if found is None:  # required=True raises first; kept for type checkers
        raise _env.LaunchEnvError(_env.MPI_HINT)
    host = host or found.master_addr
    port = port or found.master_port
    if found.world_size > 1 and (host is None or port is None):
        broadcast = _mpi4py_master(found)
        if broadcast is None:
            missing = [n for n, v in (("MASTER_ADDR", host), ("MASTER_PORT", port)) if v is None]
            raise _env.LaunchEnvError(
                f"{found.launcher} gives no rendezvous address and {' and '.join(missing)} "
                f"{'are' if len(missing) > 1 else 'is'} not set: export "
                "MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free port> to every rank (mpirun -x "
                "MASTER_ADDR -x MASTER_PORT, mpiexec -genv MASTER_ADDR ...), pass host= and port=, "
                "or install mpi4py so that rank 0 can broadcast them"
            )
        host, port = host or broadcast[0], port or broadcast[1]
    return _launch_env(found, config, backend=backend, seed=seed, timeout=timeout, host=host, port=port)


def launch_from_env(
    config: ConfigLike = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: int | float | timedelta | None = None,
    host: str | None = None,
    port: int | None = None,
) -> ParallelContext:
    """Detect the launcher (:func:`parallelctx.env.detect`: torchrun, then MPI, then a Slurm
    step, else a world of one) and launch from what it set. ``host``/``port`` override the
    detected rendezvous address.

    Returns:
        ``gpc``.

    Raises:
        LaunchEnvError: the launcher's variables are incomplete or inconsistent, or this is a
            Slurm batch shell of a multi-task job (start the script with srun).
        Anything :func:`launch` raises.
    """
    found = _env.detect()
    if found.launcher in ("openmpi", "mpich", "mvapich"):
        return launch_from_openmpi(config, host=host, port=port, backend=backend, seed=seed, timeout=timeout)
    return _launch_env(found, config, backend=backend, seed=seed, timeout=timeout, host=host, port=port)


LAUNCHERS = ("pytorch", "slurm", "mpi")


def init_dist(launcher: str, backend: str | None = None, **kwargs: Any) -> ParallelContext:
    """Launch by launcher name: ``"pytorch"`` (torchrun, :func:`launch_from_torch`), ``"slurm"``
    (:func:`launch_from_slurm`) or ``"mpi"`` (:func:`launch_from_openmpi`).

    ``backend`` None takes the config's ``dist.backend`` (default ``"auto"``: nccl with CUDA,
    else gloo), as every launch function does.

    ``kwargs`` go to that function: ``config``, ``seed``, ``timeout`` (seconds as an int or
    float, or a :class:`datetime.timedelta`), and ``host``/``port`` for slurm and mpi.

    Returns:
        ``gpc``.

    Raises:
        ValueError: an unknown launcher; the message lists the valid names.
        TypeError: ``timeout`` is neither seconds nor a timedelta (the message shows both forms),
            or an argument the launcher's function does not take.
        Anything the launcher's function raises.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r} is not one of {', '.join(repr(n) for n in LAUNCHERS)}")
    if kwargs.get("timeout") is not None:
        to_timedelta(kwargs["timeout"])  # TypeError with the right forms before anything starts
    if launcher == "pytorch":
        return launch_from_torch(backend=backend, **kwargs)
    if launcher == "slurm":
        return launch_from_slurm(backend=backend, **kwargs)
    return launch_from_openmpi(backend=backend, **kwargs)


class SpawnError(RuntimeError):
    """A spawned worker failed in a way that cannot be re-raised as its own exception (it died,
    or its exception does not pickle); the message names its global rank. ``rank`` holds it."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _run_launched(main_func: Callable[..., Any], args: tuple[Any, ...], config: ConfigLike, **kwargs: Any) -> None:
    """Launch ``gpc`` with ``kwargs``, call ``main_func(*args)``, and tear ``gpc`` down after."""
    launch(config, **kwargs)
    try:
        main_func(*args)
    finally:
        _gpc().destroy()


def _spawn_worker(
    index: int,
    main_func: Callable[..., Any],
    nprocs_per_node: int,
    node_rank: int,
    world_size: int,
    init_method: str,
    config: ConfigLike,
    backend: str | None,
    seed: int | None,
    timeout: int | float | timedelta | None,
    args: tuple[Any, ...],
    error_dir: str,
) -> None:
    """Body of one spawned worker: launch, run ``main_func``, tear down; on an exception, leave
    it pickled in ``error_dir`` for the parent and re-raise it."""
    try:
        _run_launched(
            main_func,
            args,
            config,
            rank=node_rank * nprocs_per_node + index,
            world_size=world_size,
            init_method=init_method,
            local_rank=index,
            local_world_size=nprocs_per_node,
            backend=backend,
            seed=seed,
            timeout=timeout,
        )
    except BaseException as exc:
        try:
            data = pickle.dumps(exc)
            pickle.loads(data)  # only keep what the parent can rebuild
            (Path(error_dir) / f"{index}.pickle").write_bytes(data)
        except Exception:
            pass
        raise


def _worker_failure(error_dir: str, index: int, node_rank: int, rank: int, what: str) -> BaseException:
    """The exception to raise in the parent for a failed worker (its own, when it pickled)."""
    where = f"rank {rank} (worker {index} on node {node_rank})"
    path = Path(error_dir) / f"{index}.pickle"
    if path.is_file():
        try:
            exc = pickle.loads(path.read_bytes())
        except Exception:
            exc = None
        if isinstance(exc, BaseException) and hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"raised in spawned {where}; the worker's traceback:\n{what}")
            return exc
    return SpawnError(f"{where} failed:\n{what}", rank)


def spawn(
    main_func: Callable[..., Any],
    nprocs_per_node: int,
    num_nodes: int = 1,
    node_rank: int = 0,
    dist_url: str = "auto",
    args: tuple[Any, ...] = (),
    config: ConfigLike = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: int | float | timedelta | None = None,
    join_timeout: float | None = None,
) -> None:
    """Start ``nprocs_per_node`` workers on this node (torch.multiprocessing, 'spawn' start
    method); each launches ``gpc`` (rank ``node_rank * nprocs_per_node + i``, local rank ``i``),
    calls ``main_func(*args)`` and tears ``gpc`` down.

    ``dist_url="auto"`` rendezvouses on a free port of 127.0.0.1 (single node only); otherwise
    a ``tcp://host:port`` or ``file:///path`` URL shared by every node (``file://`` with several
    nodes logs a warning: the file system must be shared). With one process in all,
    ``main_func`` runs in this process. ``main_func`` must be importable (a module-level
    function). ``timeout`` is the distributed timeout inside the workers; ``join_timeout``
    (seconds, None for no limit) bounds how long the parent waits for them.

    Raises:
        ValueError: bad sizes, ``"auto"`` with several nodes, or an unsupported URL.
        The first failing worker's own exception, re-raised here with a note naming its global
            rank and holding its traceback (when it pickles); otherwise SpawnError naming the
            rank (a worker that died or exited with a non-zero code).
        TimeoutError: the workers did not finish within ``join_timeout`` (they are terminated).
    """
    import torch.multiprocessing as mp

    if nprocs_per_node < 1 or num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ValueError(
            f"nprocs_per_node={nprocs_per_node}, num_nodes={num_nodes}, node_rank={node_rank}: "
            "need nprocs_per_node >= 1 and 0 <= node_rank < num_nodes"
        )
    if join_timeout is not None and join_timeout <= 0:
        raise ValueError(f"join_timeout={join_timeout} must be positive seconds, or None for no limit")
    world_size = nprocs_per_node * num_nodes
    if dist_url == "auto":
        if num_nodes > 1:
            raise ValueError(
                f"dist_url='auto' picks a port on this host and cannot serve num_nodes={num_nodes}; "
                "pass dist_url='tcp://<node-0 address>:<port>'"
            )
        init_method = f"tcp://127.0.0.1:{free_port()}"
    elif dist_url.startswith(("tcp://", "file://")):
        init_method = dist_url
        if dist_url.startswith("file://") and num_nodes > 1:
            logger.warning(
                "dist_url=%r with num_nodes=%d: a file:// rendezvous needs a file system that "
                "every node shares; prefer tcp://",
                dist_url,
                num_nodes,
            )
    else:
        raise ValueError(f"dist_url={dist_url!r} must be 'auto', 'tcp://host:port' or 'file:///path'")

    if world_size == 1:
        _run_launched(main_func, args, config, rank=0, world_size=1, local_rank=0, backend=backend, seed=seed, timeout=timeout)
        return

    with tempfile.TemporaryDirectory(prefix="parallelctx-spawn-") as error_dir:
        worker_args = (main_func, nprocs_per_node, node_rank, world_size, init_method, config, backend,
                       seed, timeout, tuple(args), error_dir)
        context = mp.start_processes(
            _spawn_worker, args=worker_args, nprocs=nprocs_per_node, join=False, start_method="spawn"
        )
        deadline = None if join_timeout is None else time.monotonic() + join_timeout
        try:
            while not context.join(timeout=1.0):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"spawned workers did not finish within join_timeout={join_timeout} s; "
                        "terminated them"
                    )
        except mp.ProcessRaisedException as exc:
            rank = node_rank * nprocs_per_node + exc.error_index
            raise _worker_failure(error_dir, exc.error_index, node_rank, rank, exc.msg) from None
        except mp.ProcessExitedException as exc:
            rank = node_rank * nprocs_per_node + exc.error_index
            how = f"exited with code {exc.exit_code}" if exc.signal_name is None else f"was killed by {exc.signal_name}"
            raise SpawnError(f"rank {rank} (worker {exc.error_index} on node {node_rank}) {how}", rank) from None
        finally:
            for proc in context.processes:
                if proc.is_alive():
                    proc.terminate()
            for proc in context.processes:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=10)
