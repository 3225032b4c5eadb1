"""Per-mode seeds and RNG streams.

The seed of mode ``m`` on a rank is::

    seed(m) = base + k(m) * 2**32 + index(m)

``k(m)`` is the mode's position in :class:`ParallelMode` (GLOBAL = 0, so the default stream is
``base + pp``), and ``index(m)`` is a mixed-radix number, pipeline coordinate slowest, over the
coordinates the stream must differ along (:data:`STREAM_AXES`). Since ``base < 2**32`` and
``index < world_size <= 2**32``, two modes never share a seed on one rank.

A stream holds a CPU generator state (and one CUDA state when CUDA is present).
``with streams.fork(mode):`` swaps the default generators to that stream and back, and the
stream continues where it stopped the next time it is entered.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

from .layout import Layout, ParallelMode

__all__ = ["STREAM_AXES", "RNGStreams", "mode_seed", "seed_everything"]

# The coordinates each stream varies along, slowest first. A stream is shared by ranks that
# agree on all of these; "pp" everywhere gives each pipeline stage its own streams.
STREAM_AXES: dict[ParallelMode, tuple[str, ...]] = {
    ParallelMode.GLOBAL: ("pp",),
    ParallelMode.TENSOR: ("pp", "tp"),
    ParallelMode.PIPELINE: ("pp",),
    ParallelMode.DATA: ("pp",),
    ParallelMode.CONTEXT: ("pp", "cp"),
    ParallelMode.MODEL: ("pp", "tp"),
    ParallelMode.DATA_CONTEXT: ("pp",),
    ParallelMode.EMBEDDING: ("pp",),
    ParallelMode.EXPERT: ("pp", "ep", "etp"),
    ParallelMode.EXPERT_TENSOR: ("pp", "etp"),
    ParallelMode.EXPERT_DATA: ("pp",),
    ParallelMode.EXPERT_TENSOR_AND_EXPERT: ("pp", "ep", "etp"),
    ParallelMode.EXPERT_MODEL: ("pp", "ep", "etp"),
}

_MODE_SLOT = {mode: i for i, mode in enumerate(ParallelMode)}


def _axis_size(layout: Layout, axis: str) -> int:
    return {
        "tp": layout.tensor,
        "cp": layout.context,
        "dp": layout.data,
        "pp": layout.pipeline,
        "etp": layout.expert_tensor,
        "ep": layout.expert,
        "edp": layout.expert_data,
    }[axis]


def mode_seed(layout: Layout, rank: int, mode: ParallelMode | str, base: int) -> int:
    """Return the seed of ``mode``'s stream on ``rank`` (formula in the module docstring).

    Raises:
        LayoutError: an unknown mode or a rank outside the world.
    """
    mode = ParallelMode.parse(mode)
    coords = layout.coords(rank)
    index = 0
    for axis in STREAM_AXES[mode]:
        index = index * _axis_size(layout, axis) + coords[axis]
    return base + _MODE_SLOT[mode] * 2**32 + index


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class RNGStreams:
    """One RNG stream per mode, entered with :meth:`fork`.

    The stream of GLOBAL is the default generators' own state: outside any ``fork`` the process
    runs on it.
    """

    def __init__(self, seeds: dict[ParallelMode, int], cuda: bool) -> None:
        """Create a stream per entry of ``seeds``; the GLOBAL seed seeds the default generators.

        Raises:
            KeyError: ``seeds`` has no GLOBAL entry.
        """
        self.seeds = dict(seeds)
        self._cuda = cuda
        self._states: dict[ParallelMode, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._active = ParallelMode.GLOBAL
        seed_everything(self.seeds[ParallelMode.GLOBAL])
        saved = self._capture()
        for mode, seed in self.seeds.items():
            torch.manual_seed(seed)
            self._states[mode] = self._capture()
        self._restore(saved)

    def _capture(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.get_rng_state(), (torch.cuda.get_rng_state() if self._cuda else None)

    def _restore(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    @contextlib.contextmanager
    def fork(self, mode: ParallelMode) -> Iterator[None]:
        """Run the body on ``mode``'s stream (CPU and CUDA), then switch back.

        The generators always hold the active stream; the others wait in ``_states``.

        Raises:
            KeyError: ``mode`` has no stream.
        """
        outer = self._active
        if mode is outer:
            yield
            return
        inner = self._states[mode]
        self._states[outer] = self._capture()
        self._restore(inner)
        self._active = mode
        try:
            yield
        finally:
            self._states[mode] = self._capture()
            self._restore(self._states[outer])
            self._active = outer
