"""Megatron's RNG tracker on gpc's per-mode streams."""

from __future__ import annotations

import operator
from contextlib import AbstractContextManager
from typing import Any

import torch
from megatron.core.tensor_parallel import random as _mrandom

from ..context import NotLaunchedError, gpc
from ..planning.layout import ParallelMode

__all__ = ["RNG_STREAMS", "GpcRNGTracker"]

# Megatron's tracker stream names -> gpc streams (docs/migration.md explains the choice).
RNG_STREAMS: dict[str, ParallelMode] = {
    "model-parallel-rng": ParallelMode.TENSOR,
    "expert-parallel-rng": ParallelMode.EXPERT,
    "data-parallel-rng": ParallelMode.DATA,
    # megatron-core 0.19 (added by model_parallel_cuda_manual_seed when the GTP size is > 1)
    "gtp-remat-rng": ParallelMode.GTP_REMAT,
    "egtp-remat-rng": ParallelMode.EXPERT_GTP_REMAT,
}
"""Megatron's RNG tracker names and the gpc stream each one runs on."""

_STATES_KEY = "parallelctx"


class GpcRNGTracker(_mrandom.CudaRNGStatesTracker):
    """Megatron's RNG tracker interface on gpc's per-mode streams (CPU and CUDA generators).

    ``fork(name)`` is ``gpc.seed(mode)`` for the stream :data:`RNG_STREAMS` maps ``name`` to
    (default ``"model-parallel-rng"``, the TENSOR stream): one stream, whichever way it is
    entered. ``add(name, seed)`` restarts that stream from ``seed``, so Megatron's
    ``model_parallel_cuda_manual_seed(seed)`` gives the three streams Megatron's seeds.
    ``get_states`` / ``set_states`` save and restore every gpc stream (what
    ``tensor_parallel.checkpoint`` and checkpoint code use). All state lives in gpc, so every
    instance is the same tracker: while installed, Megatron's ``initialize_rng_tracker(
    force_reset=True)`` makes a new one of this class (see :func:`install`).
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        """Take Megatron's tracker arguments (the base class's state lives in gpc here).

        Raises:
            ValueError: ``use_cudagraphable_rng=True`` (CUDA-graph-safe generator states are not
                supported on gpc's streams).
        """
        if use_cudagraphable_rng:
            raise ValueError(
                "use_cudagraphable_rng=True is not supported by parallelctx.megatron: gpc's RNG streams "
                "swap ordinary generator states, which CUDA graphs cannot capture; drop the option "
                "(or parallelctx.megatron.uninstall() to use Megatron's own tracker)"
            )
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker

    @staticmethod
    def _mode(name: str) -> ParallelMode:
        try:
            return RNG_STREAMS[name]
        except KeyError:
            raise ValueError(
                f"RNG tracker stream {name!r} is unknown to parallelctx.megatron; use one of "
                f"{sorted(RNG_STREAMS)}, or gpc.seed(mode) for another gpc stream"
            ) from None

    def is_initialized(self) -> bool:
        """Return True once gpc has its streams (after launch)."""
        try:
            return gpc.rng_streams is not None
        except NotLaunchedError:
            return False

    def reset(self) -> None:
        """Nothing to forget: the streams belong to gpc (:meth:`add` restarts one)."""

    @property
    def states_(self) -> dict[str, Any]:  # read by megatron's get_all_rng_states()
        """The same dict as :meth:`get_states`."""
        return self.get_states()

    def get_states(self) -> dict[str, Any]:
        """Return ``{"parallelctx": snapshot of every gpc stream}``; give it to :meth:`set_states`.

        Raises:
            NotLaunchedError: gpc has no streams (not launched).
        """
        return {_STATES_KEY: gpc.rng_streams.snapshot()}

    def set_states(self, states: dict[str, Any]) -> None:
        """Put every gpc stream back to what :meth:`get_states` returned.

        Raises:
            ValueError: ``states`` did not come from :meth:`get_states` (e.g. Megatron's own
                tracker); the message says what it holds.
            NotLaunchedError: gpc has no streams.
        """
        self.check_states(states)
        gpc.rng_streams.restore(states[_STATES_KEY])

    @staticmethod
    def check_states(states: Any) -> None:
        """Return None when ``states`` came from :meth:`get_states`.

        Raises:
            ValueError: it did not (e.g. Megatron's own tracker's); the message says what it holds.
        """
        if not isinstance(states, dict) or _STATES_KEY not in states:
            keys = sorted(states) if isinstance(states, dict) else type(states).__name__
            raise ValueError(
                f"RNG tracker states {keys} did not come from parallelctx's tracker; restore what "
                "get_cuda_rng_tracker().get_states() returned while parallelctx.megatron was installed"
            )

    def add(self, name: str, seed: int) -> None:
        """Restart the gpc stream ``name`` maps to from ``seed``: it then draws what a
        ``torch.Generator`` seeded with ``seed`` draws (CPU, and CUDA where gpc uses CUDA), and
        ``gpc.get_seed(mode)`` answers ``seed``. The other streams keep their state.

        Raises:
            ValueError: ``name`` is not in :data:`RNG_STREAMS`, or ``seed`` is not an integer in
                ``[0, 2**64)``.
            NotLaunchedError: gpc has no streams.
        """
        mode = self._mode(name)
        try:
            value = operator.index(seed)  # Python and numpy integers
        except TypeError:
            value = -1
        if isinstance(seed, bool) or not 0 <= value < 2**64:
            raise ValueError(f"RNG tracker seed {seed!r} for {name!r} must be an integer in [0, 2**64)")
        gpc.rng_streams.reseed(mode, value)

    def fork(self, name: str = "model-parallel-rng") -> AbstractContextManager[None]:
        """Return ``gpc.seed(mode)`` for the stream ``name`` maps to (CPU and CUDA generators).

        Raises:
            ValueError: ``name`` is not in :data:`RNG_STREAMS`.
        """
        return gpc.seed(self._mode(name))


def _get_all_rng_states() -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
    """The default generators' states and every gpc stream (CUDA state only where gpc uses it)."""
    streams = gpc.rng_streams
    cuda = torch.cuda.get_rng_state() if streams.cuda else None
    return torch.get_rng_state(), cuda, {_STATES_KEY: streams.snapshot()}


def _set_all_rng_states(cpu: torch.Tensor, cuda: torch.Tensor | None, tracker: dict[str, Any]) -> None:
    """Undo :func:`_get_all_rng_states`: every gpc stream, and the stream that was active then
    active again (a recomputation runs on the stream its forward ran on, whatever is active at
    backward), then the generators as they were."""
    _TRACKER.check_states(tracker)
    gpc.rng_streams.restore(tracker[_STATES_KEY], activate=True)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


_TRACKER = GpcRNGTracker()

# What install() swaps in megatron.core.tensor_parallel.random, and with what.
SWAPPED = (
    "CudaRNGStatesTracker",
    "_CUDA_RNG_STATE_TRACKER",
    "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
    "_get_all_rng_states",
    "_set_all_rng_states",
)


def swap_in() -> dict[str, Any]:
    """Put Megatron's RNG tracker on gpc's streams; return what was there, for :func:`swap_back`."""
    before = {name: getattr(_mrandom, name) for name in SWAPPED}
    # Megatron's initialize_rng_tracker(force_reset=True) (also through
    # model_parallel_cuda_manual_seed(..., force_reset_rng=True)) builds a new tracker of the
    # class it finds here: make that a tracker on gpc's streams too, which gpc's checkpoint and
    # get_rng_state keep restoring.
    _mrandom.CudaRNGStatesTracker = GpcRNGTracker
    _mrandom._CUDA_RNG_STATE_TRACKER = _TRACKER
    _mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _mrandom._get_all_rng_states = _get_all_rng_states
    _mrandom._set_all_rng_states = _set_all_rng_states
    return before


def swap_back(before: dict[str, Any]) -> None:
    """Undo :func:`swap_in` with what it returned."""
    for name, value in before.items():
        setattr(_mrandom, name, value)
