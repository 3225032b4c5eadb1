"""Activation checkpointing that recomputes the same random numbers on every gpc stream.

``torch.utils.checkpoint.checkpoint`` saves and restores only the default generators for the
recomputation. Code inside the region that draws on a mode's stream (``with
gpc.seed(ParallelMode.TENSOR):`` around dropout) would draw *different* numbers when recomputed,
because that stream advanced during the forward: wrong gradients, silently.

* :func:`checkpoint` is a drop-in for ``torch.utils.checkpoint.checkpoint`` (same arguments)
  that also saves every gpc stream, and which one is active, when the region first runs, and
  replays from there for each recomputation: the region runs again on the stream it was entered
  under (``with gpc.seed(X): checkpoint(...)``, backward outside the block or under another
  stream), then every stream and the active one are put back as they were.
* :func:`rng_context_fn` does the same for users who call torch's checkpoint themselves (the
  non-reentrant form): ``checkpoint(fn, x, use_reentrant=False, context_fn=rng_context_fn)``.

Before launch (no streams) both behave exactly as torch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as _tc

from .context import NotLaunchedError, gpc
from .runtime.seed import RNGSnapshot, RNGStreams

__all__ = ["checkpoint", "rng_context_fn"]


def _streams() -> RNGStreams | None:
    try:
        return gpc.rng_streams
    except NotLaunchedError:
        return None  # before launch: torch's checkpoint alone


class _Replay:
    """Remembers the streams when the region first runs; later runs replay from there."""

    def __init__(self) -> None:
        self.saved: RNGSnapshot | None = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        streams = _streams()
        if streams is not None:
            self.saved = streams.snapshot()
        yield

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        streams = _streams()
        if streams is None or self.saved is None:
            yield
            return
        with streams.replay(self.saved):
            yield


def rng_context_fn() -> tuple[
    contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]
]:
    """The ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
    that saves every gpc RNG stream at the forward and restores it for the recomputation.

    Example: ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
    context_fn=parallelctx.rng_context_fn)``.

    Returns:
        ``(forward context, recompute context)``, as torch expects.
    """
    replay = _Replay()
    return replay.forward(), replay.recompute()


def checkpoint(
    function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None, **kwargs: Any
) -> Any:
    """Run ``function(*args)`` under ``torch.utils.checkpoint.checkpoint`` with every gpc RNG
    stream (each mode's CPU and CUDA generator) saved at the forward and restored for the
    recomputation, so outputs and gradients equal the run without checkpointing bit for bit.

    Takes exactly torch's arguments (``use_reentrant``, ``context_fn``, ``preserve_rng_state``,
    ``determinism_check``, ``debug``, ``early_stop`` and the function's keyword arguments) and
    works with ``use_reentrant=True`` and ``False`` and nested regions. After backward every
    stream is where the run without checkpointing leaves it.

    Returns:
        What ``function`` returns.

    Raises:
        Whatever ``torch.utils.checkpoint.checkpoint`` or ``function`` raises.
    """
    replay = _Replay()
    first = True

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        nonlocal first
        if first:
            first = False
            with replay.forward():
                return function(*inner_args, **inner_kwargs)
        with replay.recompute():
            return function(*inner_args, **inner_kwargs)

    return _tc.checkpoint(run, *args, use_reentrant=use_reentrant, **kwargs)
