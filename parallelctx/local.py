"""Run gpc model code as every rank of a layout in one process, with the real job's numbers.

``run_local(fn, world_size=64, tensor=8, pipeline=4)`` starts one thread per rank
(:mod:`parallelctx.runtime.local`), launches ``gpc`` in each for its rank (the InternLM steps
on the in-process ``"local"`` backend: config, default group, groups, processes per node,
seeds) and calls ``fn()`` there; ``gpc``, ``torch.distributed`` and the default generators
answer per rank. One rank runs at a time, so the cost is the sum of the ranks' work, and memory
the sum of the ranks' tensors. docs/testing.md compares it with real ranks and the dry run.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .config import Config, load_config
from .context import ParallelContext, gpc
from .planning.layout import ParallelMode
from .runtime.local import (
    LocalAbandoned,
    LocalDeadlock,
    LocalWorld,
    RankThread,
    keep_per_rank,
    put_environ,
)
from .runtime.local_group import BACKEND, register_backend

__all__ = ["LocalRankError", "keep_per_rank", "run_local"]

DEFAULT_TIMEOUT_S = 600.0
SHOWN = 8  # ranks named with their error; the others by number
STOP_S = 5.0  # how long ranks still running after a timeout get to end


class LocalRankError(AssertionError):
    """Simulated ranks raised: the message names each (its place in the layout) and its error;
    the first rank's exception is the cause (``__cause__``)."""


def _with_sizes(config: Config | Mapping[str, Any] | str | Path | None, sizes: Mapping[str, Any]) -> Config:
    cfg = load_config(config)
    if not sizes:
        return cfg
    data = cfg.to_dict()
    data.setdefault("parallel", {}).update(sizes)
    return Config(data)


class _PerThread(ParallelContext):
    """gpc's class while a local world runs (only then: the hot path pays nothing): in a rank's
    thread every attribute is that rank's context's, elsewhere gpc's own."""

    def __getattribute__(self, name: str) -> Any:
        ctx = getattr(threading.current_thread(), "context", None)
        return object.__getattribute__(self, name) if ctx is None else getattr(ctx, name)


@contextlib.contextmanager
def _per_thread() -> Iterator[None]:
    """``gpc`` answers from each rank thread's own context while the body runs.

    Raises:
        RuntimeError: gpc is launched in this process, or a local world already runs.
    """
    if type(gpc) is not ParallelContext or gpc.is_initialized(ParallelMode.GLOBAL):
        raise RuntimeError(
            "a local world needs gpc unlaunched and no other local world in this process: call "
            "gpc.destroy() first, and do not start a local world from inside one"
        )
    gpc.__class__ = _PerThread
    try:
        yield
    finally:
        gpc.__class__ = ParallelContext


@contextlib.contextmanager
def _thread_worlds() -> Iterator[None]:
    """torch.distributed's state per thread while the body runs (torch's ``ThreadLocalWorld``
    and its thread-isolated group registry, as torch's threaded tests use them)."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    register_backend()
    saved, hook = c10d._world, sys.excepthook  # each rank's init_process_group wraps the hook
    c10d._world = ThreadLocalWorld()  # type: ignore[assignment]  # as torch's own threaded tests
    isolate: Any = torch._C._distributed_c10d._set_thread_isolation_mode  # type: ignore[attr-defined]
    isolate(True)
    try:
        with torch.autograd.set_multithreading_enabled(False):
            yield
    finally:
        isolate(False)
        c10d._world, sys.excepthook = saved, hook


@contextlib.contextmanager
def _process_state() -> Iterator[None]:
    """What each rank has alone (the default generators, the default dtype, the environment)
    is the process's own again after the body: the ranks swap theirs in and out. Inside, torch
    computes on ``OMP_NUM_THREADS`` threads (1 unless set), as torchrun's ranks do."""
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    env = dict(os.environ)
    # torchrun runs each rank on OMP_NUM_THREADS threads, 1 unless set: a sum split over another
    # number of threads adds in another order
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        yield
    finally:
        torch.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        put_environ(env)


def _stop(threads: list[RankThread]) -> list[int]:
    """Raise :class:`LocalAbandoned` inside each of ``threads`` still running (at its next Python
    instruction) and give them a moment to end; return the ranks still running after that."""
    for t in threads:
        if t.is_alive() and t.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(t.ident), ctypes.py_object(LocalAbandoned)
            )
    deadline = time.monotonic() + STOP_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.rank for t in threads if t.is_alive()]


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    config: Config | Mapping[str, Any] | str | Path | None = None,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
    **sizes: Any,
) -> list[Any]:
    """Run ``fn(*args)`` as every rank of a ``world_size``-rank job in this process, ``gpc``
    launched on each for ``config`` with the parallel ``sizes`` over it (``tensor=8``,
    ``pipeline=4``, ``order="tp-dp-pp"``, ...: each replaces that key of the ``parallel`` section;
    sub-keys such as the expert tensor size go in ``config``).

    Returns:
        Each rank's return value, by rank.

    Raises:
        LocalRankError: ranks raised (named with their place, e.g. "rank 5 (pipeline stage 1,
            tensor rank 1)"), waited where the real job would hang (named with what each waited
            for, on which group), or did not finish within ``timeout`` seconds.
        RuntimeError: gpc is launched in this process, or a local world already runs.
        ValueError: a bad config or sizes (ConfigError, LayoutError, ValidationError).
    """
    cfg = _with_sizes(config, sizes)
    layout = cfg.parallel.layout_or_plan(world_size)  # LayoutError before any thread
    world = LocalWorld(world_size)
    results: list[Any] = [None] * world_size
    errors: dict[int, tuple[BaseException, str]] = {}

    def rank_body(rank: int) -> None:
        ctx = threading.current_thread().context = ParallelContext()  # type: ignore[attr-defined]
        failed: BaseException | None = None
        try:
            world.enter(rank)
            dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=world.store)
            ctx.load_config(cfg)
            ctx.init_global_dist(rank, world_size)
            ctx.init_parallel_groups()
            ctx.detect_num_processes_on_current_node()
            ctx.set_seed()
            mine = copy.deepcopy(args)  # each real rank unpickles its own (spawn's args=)
            world.begin(rank)
            results[rank] = fn(*mine)
        except BaseException as exc:
            failed = exc
            errors[rank] = (exc, traceback.format_exc())
        finally:
            if not world.abandoned:  # else torch's world is the process's again: touch nothing
                with contextlib.suppress(BaseException):
                    ctx.destroy()
                with contextlib.suppress(BaseException):
                    if dist.is_initialized():
                        dist.destroy_process_group()
            world.leave(rank, failed)

    begin = time.monotonic()
    late: list[int] = []
    with _process_state(), _per_thread(), _thread_worlds():
        threads = [RankThread(world, r, functools.partial(rank_body, r)) for r in range(world_size)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(0.0, timeout - (time.monotonic() - begin)))
            late = [t.rank for t in threads if t.is_alive()]
        finally:  # a timeout, or an interrupt of this thread: no rank goes on on its own
            if any(t.is_alive() for t in threads):
                seen = world.running()
                world.abandon(f"the local world was given up after {time.monotonic() - begin:.0f} s")
                stuck = _stop(threads)
            world.restore_kept()
    if late:
        raise LocalRankError(
            f"the local world did not finish within {timeout:g} s ({len(late)} ranks left): {seen}; "
            "a rank that never reaches a collective keeps the others waiting"
            + (
                f". Ranks {stuck} could not be stopped (blocked outside Python) and still run"
                if stuck
                else ""
            )
        )
    if errors:
        raise _failure(errors, layout)
    return results


def _failure(errors: dict[int, tuple[BaseException, str]], layout: Any) -> LocalRankError:
    """One error naming every rank that raised, the ranks that raised first before the ranks
    left waiting for them."""
    first = {r: e for r, e in errors.items() if not isinstance(e[0], LocalDeadlock)}
    order = sorted(first) + sorted(set(errors) - set(first))
    lines = []
    for r in order[:SHOWN]:
        exc, _ = errors[r]
        where = layout.where(r)
        lines.append(f"rank {r}{f' ({where})' if where else ''}: {type(exc).__name__}: {_first_line(exc)}")
    if len(order) > SHOWN:
        lines.append(f"... and ranks {order[SHOWN:]}")
    lead = order[0]
    text = f"{len(errors)} of {layout.world_size} simulated ranks failed:\n" + "\n".join(lines)
    text += f"\n--- rank {lead}'s traceback ---\n{errors[lead][1]}"
    err = LocalRankError(text)
    err.__cause__ = errors[lead][0]
    return err


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""
