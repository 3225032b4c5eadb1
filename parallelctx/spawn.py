"""``spawn``: start single-node worker processes that each launch ``gpc``, run a function and
tear down; the parent re-raises the first worker failure with its rank.

This module imports :mod:`parallelctx.launch`'s building blocks but never the reverse.
"""

from __future__ import annotations

import logging
import pickle
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from .config import ConfigLike
from .context import gpc
from .env import free_port

__all__ = ["SpawnError", "WorkerSpec", "run_launched", "spawn"]

logger = logging.getLogger("parallelctx")


class SpawnError(RuntimeError):
    """A spawned worker failed in a way that cannot be re-raised as its own exception (it died,
    or its exception does not pickle); the message names its global rank. ``rank`` holds it."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def run_launched(main_func: Callable[..., Any], args: tuple[Any, ...], config: ConfigLike, **kwargs: Any) -> None:
    """Launch ``gpc`` with ``kwargs`` (:meth:`ParallelContext.launch`), call ``main_func(*args)``,
    and tear ``gpc`` down after, also when it raises.

    Raises:
        Whatever the launch or ``main_func`` raises.
    """
    gpc.launch(config, **kwargs)
    try:
        main_func(*args)
    finally:
        gpc.destroy()


@dataclass(frozen=True)
class WorkerSpec:
    """What every spawned worker of one :func:`spawn` call needs; the worker adds its index."""

    main_func: Callable[..., Any]
    args: tuple[Any, ...]
    nprocs_per_node: int
    node_rank: int
    world_size: int
    init_method: str
    config: ConfigLike
    backend: str | None
    seed: int | None
    timeout: int | float | timedelta | None
    error_dir: str


def _spawn_worker(index: int, spec: WorkerSpec) -> None:
    """Body of one spawned worker: launch, run ``main_func``, tear down; on an exception, leave
    it pickled in ``spec.error_dir`` for the parent and re-raise it."""
    try:
        run_launched(
            spec.main_func,
            spec.args,
            spec.config,
            rank=spec.node_rank * spec.nprocs_per_node + index,
            world_size=spec.world_size,
            init_method=spec.init_method,
            local_rank=index,
            local_world_size=spec.nprocs_per_node,
            backend=spec.backend,
            seed=spec.seed,
            timeout=spec.timeout,
        )
    except BaseException as exc:
        try:
            data = pickle.dumps(exc)
            pickle.loads(data)  # only keep what the parent can rebuild
            (Path(spec.error_dir) / f"{index}.pickle").write_bytes(data)
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
        run_launched(main_func, args, config, rank=0, world_size=1, local_rank=0, backend=backend, seed=seed, timeout=timeout)
        return

    with tempfile.TemporaryDirectory(prefix="parallelctx-spawn-") as error_dir:
        spec = WorkerSpec(
            main_func=main_func,
            args=tuple(args),
            nprocs_per_node=nprocs_per_node,
            node_rank=node_rank,
            world_size=world_size,
            init_method=init_method,
            config=config,
            backend=backend,
            seed=seed,
            timeout=timeout,
            error_dir=error_dir,
        )
        context = mp.start_processes(
            _spawn_worker, args=(spec,), nprocs=nprocs_per_node, join=False, start_method="spawn"
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
