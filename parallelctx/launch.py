"""Launch entry points: thin adapters that end in the same :func:`launch`.

``launch`` does the work; ``launch_from_torch`` and ``launch_from_env`` read what the launcher
put in the environment (:mod:`parallelctx.env`); ``spawn`` starts local worker processes.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from . import env as _env
from .config import Config, to_timedelta
from .context import ParallelContext

__all__ = ["SpawnError", "launch", "launch_from_env", "launch_from_torch", "spawn"]

logger = logging.getLogger("parallelctx")

ConfigLike = Config | Mapping[str, Any] | str | Path | None


def _gpc() -> ParallelContext:
    from . import gpc

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
    return launch(
        config,
        rank=found.rank,
        world_size=found.world_size,
        host=kwargs.pop("host", None) or found.master_addr,
        port=kwargs.pop("port", None) or found.master_port,
        local_rank=found.local_rank,
        local_world_size=found.local_world_size,
        **kwargs,
    )


def launch_from_torch(
    config: ConfigLike = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: int | float | timedelta | None = None,
) -> ParallelContext:
    """Launch from torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

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


def launch_from_env(
    config: ConfigLike = None,
    backend: str | None = None,
    seed: int | None = None,
    timeout: int | float | timedelta | None = None,
    host: str | None = None,
    port: int | None = None,
) -> ParallelContext:
    """Detect the launcher (:func:`parallelctx.env.detect`) and launch from what it set.

    A plain ``python train.py`` becomes a world of one. ``host``/``port`` override the
    detected rendezvous address.

    Returns:
        ``gpc``.

    Raises:
        LaunchEnvError: the launcher's variables are incomplete or inconsistent.
        Anything :func:`launch` raises.
    """
    found = _env.detect()
    return _launch_env(found, config, backend=backend, seed=seed, timeout=timeout, host=host, port=port)


class SpawnError(RuntimeError):
    """A spawned worker failed; the message names its global rank and holds its traceback."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
) -> None:
    launch(
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
    try:
        main_func(*args)
    finally:
        _gpc().destroy()


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
    """Start ``nprocs_per_node`` workers on this node; each launches ``gpc`` and calls
    ``main_func(*args)``, then tears ``gpc`` down.

    ``dist_url="auto"`` rendezvouses on a free port of 127.0.0.1 (single node only); otherwise
    a ``tcp://host:port`` or ``file:///path`` URL shared by every node. With one process in all,
    ``main_func`` runs in this process. ``main_func`` must be picklable (a module-level function).
    ``timeout`` is the distributed timeout inside the workers; ``join_timeout`` (seconds, None
    for no limit) bounds how long the parent waits for them.

    Raises:
        ValueError: bad sizes, ``"auto"`` with several nodes, or an unsupported URL.
        SpawnError: a worker raised or died; the message names its global rank.
        TimeoutError: the workers did not finish within ``join_timeout`` (they are terminated).
    """
    import torch.multiprocessing as mp

    if nprocs_per_node < 1 or num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ValueError(
            f"nprocs_per_node={nprocs_per_node}, num_nodes={num_nodes}, node_rank={node_rank}: "
            "need nprocs_per_node >= 1 and 0 <= node_rank < num_nodes"
        )
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
        launch(config, rank=0, world_size=1, local_rank=0, backend=backend, seed=seed, timeout=timeout)
        try:
            main_func(*args)
        finally:
            _gpc().destroy()
        return

    worker_args = (main_func, nprocs_per_node, node_rank, world_size, init_method, config, backend, seed, timeout, tuple(args))
    context = mp.start_processes(_spawn_worker, args=worker_args, nprocs=nprocs_per_node, join=False, start_method="spawn")
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    try:
        while not context.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"spawned workers did not finish within join_timeout={join_timeout} s; terminated them"
                )
    except mp.ProcessRaisedException as exc:
        rank = node_rank * nprocs_per_node + exc.error_index
        raise SpawnError(f"rank {rank} (worker {exc.error_index} on node {node_rank}) failed:\n{exc.msg}") from None
    except mp.ProcessExitedException as exc:
        rank = node_rank * nprocs_per_node + exc.error_index
        raise SpawnError(f"rank {rank} (worker {exc.error_index} on node {node_rank}) exited with code {exc.exit_code}") from None
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in context.processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
