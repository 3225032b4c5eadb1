"""A rank's whole RNG state (Python, numpy, torch's default generators, every gpc stream) as
one picklable value, and the checks before it is restored."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from .seed import RNGSnapshot, RNGStreams

__all__ = ["RNGState", "capture", "restore"]


@dataclass(frozen=True)
class RNGState:
    """Every RNG stream of one rank, from :meth:`ParallelContext.get_rng_state`; picklable.

    ``rank``, ``world_size`` and ``layout`` (the layout's description) say where it was taken;
    :meth:`ParallelContext.set_rng_state` refuses it anywhere else.
    """

    rank: int
    world_size: int
    layout: str
    seed: int
    python: Any
    numpy: Any
    streams: RNGSnapshot


def capture(streams: RNGStreams, rank: int, world_size: int, layout: str, seed: int) -> RNGState:
    """Return the RNG state of this process: Python's ``random``, numpy's global generator and
    ``streams`` (the default torch generators and every stream), labelled with where it was
    taken."""
    return RNGState(
        rank=rank,
        world_size=world_size,
        layout=layout,
        seed=seed,
        python=random.getstate(),
        numpy=np.random.get_state(),
        streams=streams.snapshot(),
    )


def restore(state: RNGState, streams: RNGStreams, rank: int, world_size: int, layout: str) -> None:
    """Restore ``state`` into ``streams``, Python's ``random`` and numpy's global generator.

    Raises:
        TypeError: ``state`` is not an :class:`RNGState`.
        ValueError: ``state`` was taken on another rank, world size or layout, or with CUDA
            state where ``streams`` has none (or the reverse); the message says which.
    """
    if not isinstance(state, RNGState):
        raise TypeError(f"set_rng_state takes what gpc.get_rng_state() returned, not {type(state).__name__}")
    where = [
        (name, theirs, mine)
        for name, theirs, mine in (
            ("rank", state.rank, rank),
            ("world_size", state.world_size, world_size),
            ("layout", state.layout, layout),
        )
        if theirs != mine
    ]
    if where:
        diffs = "; ".join(f"{name} {theirs!r} there, {mine!r} here" for name, theirs, mine in where)
        raise ValueError(
            f"this RNG state was taken elsewhere ({diffs}); restore each rank's own state "
            "(save one per global rank) under the same layout"
        )
    has_cuda = next(iter(state.streams.states.values()))[1] is not None
    if has_cuda != streams.cuda:
        raise ValueError(
            f"this RNG state {'has' if has_cuda else 'has no'} CUDA generator states but this "
            f"rank {'uses' if streams.cuda else 'does not use'} CUDA; restore it on the same kind of device"
        )
    streams.restore(state.streams)
    random.setstate(state.python)
    np.random.set_state(state.numpy)
