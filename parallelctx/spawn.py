"""``spawn``: start single-node worker processes that each launch ``gpc``, run a function and
tear down; the parent re-raises the first worker failure in time (the root cause) with its rank,
and lists the failures that followed it.

This module imports :mod:`parallelctx.launch`'s building blocks but never the reverse.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import tempfile
import time
import traceback
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


def run_launched(
    main_func: Callable[..., Any], args: tuple[Any, ...], config: ConfigLike, **kwargs: Any
) -> None:
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


def _record_failure(error_dir: str, index: int, exc: BaseException) -> None:
    """Leave ``exc`` for the parent as ``<index>.pickle``: when it happened (``time.monotonic()``,
    one clock for every process of the host), its traceback text and the exception itself when
    it pickles. Written at the moment of failure, before the teardown lets the peers fail too."""
    path = Path(error_dir) / f"{index}.pickle"
    if path.exists():
        return
    record: dict[str, Any] = {
        "time": time.monotonic(),
        "traceback": "".join(traceback.format_exception(exc)),
        "exception": None,
    }
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)  # only keep what the parent can rebuild
        record["exception"] = data
    except Exception:
        pass
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(record))
        tmp.replace(path)


def _spawn_worker(index: int, spec: WorkerSpec) -> None:
    """Body of one spawned worker: launch, run ``main_func``, tear down; on an exception, record
    it in ``spec.error_dir`` for the parent (before the teardown) and re-raise it."""
    try:
        gpc.launch(
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
        try:
            spec.main_func(*spec.args)
        except BaseException as exc:
            _record_failure(spec.error_dir, index, exc)
            raise
        finally:
            gpc.destroy()
    except BaseException as exc:
        _record_failure(spec.error_dir, index, exc)
        raise


def _read_failures(error_dir: str) -> dict[int, dict[str, Any]]:
    """The failure records the workers left, by worker index."""
    out: dict[int, dict[str, Any]] = {}
    for path in Path(error_dir).glob("*.pickle"):
        with contextlib.suppress(Exception):
            record = pickle.loads(path.read_bytes())
            if isinstance(record, dict) and "time" in record:
                out[int(path.stem)] = record
    return out


def _first_failure(
    error_dir: str, node_rank: int, nprocs: int, reported: int, exited: str | None, reported_text: str
) -> BaseException:
    """The exception to raise in the parent: the earliest failure (its own exception when it
    pickled, else a SpawnError), with notes naming its rank and traceback and listing the ranks
    that failed after it. ``reported`` is the worker torch saw fail first; ``exited`` says how it
    ended when it died without raising."""
    records = _read_failures(error_dir)
    if exited is not None and reported not in records:
        first = reported  # died without a word (killed, os._exit): nothing was earlier on record
    elif records:
        first = min(records, key=lambda i: records[i]["time"])
    else:
        first = reported

    def rank_of(index: int) -> int:
        return node_rank * nprocs + index

    where = f"rank {rank_of(first)} (worker {first} on node {node_rank})"
    record = records.get(first)
    exc: BaseException | None = None
    if record is not None and record["exception"] is not None:
        with contextlib.suppress(Exception):
            exc = pickle.loads(record["exception"])
    text = record["traceback"] if record is not None else reported_text
    if not isinstance(exc, BaseException):
        how = exited if (exited is not None and first == reported) else "failed"
        exc = SpawnError(f"{where} {how}" + (f":\n{text}" if text else ""), rank_of(first))
    else:
        exc.add_note(f"raised in spawned {where}, the first worker to fail; its traceback:\n{text}")
    later = sorted((i for i in records if i != first), key=lambda i: records[i]["time"])
    if later:
        lines = []
        for i in later:
            last = records[i]["traceback"].strip().splitlines()[-1:] or ["?"]
            delay = records[i]["time"] - records[first]["time"] if record is not None else 0.0
            lines.append(f"  rank {rank_of(i)} (+{delay:.2f} s): {last[0]}")
        exc.add_note("ranks that failed after it (most likely as a consequence):\n" + "\n".join(lines))
    return exc


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
        run_launched(
            main_func,
            args,
            config,
            rank=0,
            world_size=1,
            local_rank=0,
            backend=backend,
            seed=seed,
            timeout=timeout,
        )
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
                    hung = [i for i, proc in enumerate(context.processes) if proc.is_alive()]
                    done = [i for i in range(nprocs_per_node) if i not in hung]
                    ranks = ", ".join(str(node_rank * nprocs_per_node + i) for i in hung)
                    finished = ", ".join(str(node_rank * nprocs_per_node + i) for i in done) or "none"
                    raise TimeoutError(
                        f"spawned workers did not finish within join_timeout={join_timeout} s: rank"
                        f"{'s' if len(hung) > 1 else ''} {ranks} still running (finished: {finished}); "
                        "terminated them. A rank that waits in a collective its peers never enter hangs "
                        "like this: check that every rank makes the same collective calls"
                    )
        except mp.ProcessRaisedException as exc:
            raise _first_failure(
                error_dir, node_rank, nprocs_per_node, exc.error_index, None, exc.msg
            ) from None
        except mp.ProcessExitedException as exc:
            how = (
                f"exited with code {exc.exit_code}"
                if exc.signal_name is None
                else f"was killed by {exc.signal_name}"
            )
            raise _first_failure(error_dir, node_rank, nprocs_per_node, exc.error_index, how, "") from None
        finally:
            for proc in context.processes:
                if proc.is_alive():
                    proc.terminate()
            for proc in context.processes:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=10)
            for name in getattr(context, "error_files", []) or []:  # torch's, left by failed workers
                if name:
                    with contextlib.suppress(OSError):
                        os.unlink(name)
