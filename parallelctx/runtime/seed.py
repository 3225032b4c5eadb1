"""Per-mode seeds and RNG streams.

The seed of stream ``s`` on a rank is::

    seed(s) = (base + SLOT[s] * 2**24 + index(s)) mod 2**32

``SLOT[s]`` is a fixed number per stream (:data:`STREAM_SLOTS`, below 256; GLOBAL = 0, so the
default stream is ``base + pp``). Slots are pinned, never derived from the enum's order, so adding
a mode never changes an existing seed and bit-exact resumes keep working. ``index(s)`` is a
mixed-radix number, pipeline coordinate slowest, over the coordinates the stream must differ along
(:data:`STREAM_AXES`).

Every seed lies in ``[0, 2**32)``, so each generator keeps all of it: torch's CPU generator
(mt19937) uses only the low 32 bits of a seed, CUDA's Philox 64. Since ``index < world_size <=
2**24`` and ``SLOT < 2**8``, the map ``(SLOT, index) -> seed`` is one-to-one for a given base: no
two streams of a rank start from the same seed, so no two draw the same numbers, and two ranks
share a stream's seed exactly when they agree on its axes. (The first formula used
``SLOT * 2**32``: the CPU generator dropped those bits, and every stream of a rank drew the same
numbers.)

With ``parallel.modules`` each module's streams follow the same formula on the module's own
layout, with slots of their own for every module after the first (:func:`stream_slot`), so two
colocated modules draw distinct streams.

Besides one stream per :class:`ParallelMode` there is :data:`REPLICA`, a stream that differs
across data-parallel replicas (and pipeline stages) and agrees inside a replica (across its
tensor and context ranks): per-replica noise such as data augmentation.

A stream holds a CPU generator state (and one CUDA state when CUDA is present).
``with streams.fork(mode):`` swaps the default generators to that stream and back, and the
stream continues where it stopped the next time it is entered.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..planning.layout import Layout, ParallelMode
from ..planning.limits import MAX_WORLD_SIZE
from ..planning.modules import MAX_MODULES

__all__ = [
    "REPLICA",
    "STREAM_AXES",
    "STREAM_SLOTS",
    "RNGSnapshot",
    "RNGStreams",
    "Stream",
    "mode_seed",
    "seed_at",
    "seed_everything",
    "stream_slot",
]

REPLICA = "replica"
"""Name of the stream that differs across data-parallel replicas: ``with gpc.seed("replica"):``
(or ``gpc.replica_seed()``)."""

Stream = ParallelMode | str
"""A stream key: a :class:`ParallelMode`, or :data:`REPLICA`."""

# Pinned slot of each stream: part of the seed formula, so never renumber or reuse one.
STREAM_SLOTS: dict[Any, int] = {
    ParallelMode.GLOBAL: 0,
    ParallelMode.TENSOR: 1,
    ParallelMode.PIPELINE: 2,
    ParallelMode.DATA: 3,
    ParallelMode.CONTEXT: 4,
    ParallelMode.MODEL: 5,
    ParallelMode.DATA_CONTEXT: 6,
    ParallelMode.EMBEDDING: 7,
    ParallelMode.EXPERT: 8,
    ParallelMode.EXPERT_TENSOR: 9,
    ParallelMode.EXPERT_DATA: 10,
    ParallelMode.EXPERT_TENSOR_AND_EXPERT: 11,
    ParallelMode.EXPERT_MODEL: 12,
    ParallelMode.DATA_SHARD: 13,
    ParallelMode.DATA_REPLICATE: 14,
    ParallelMode.DATA_SHARD_CONTEXT: 15,
    ParallelMode.EXPERT_DATA_SHARD: 16,
    ParallelMode.EXPERT_DATA_REPLICATE: 17,
    ParallelMode.GTP_REMAT: 18,
    ParallelMode.EXPERT_GTP_REMAT: 19,
    REPLICA: 64,
}

# The coordinates each stream varies along, slowest first. A stream is shared by ranks that
# agree on all of these; "pp" everywhere gives each pipeline stage its own streams.
STREAM_AXES: dict[Any, tuple[str, ...]] = {
    ParallelMode.GLOBAL: ("pp",),
    ParallelMode.TENSOR: ("pp", "tp"),
    ParallelMode.PIPELINE: ("pp",),
    ParallelMode.DATA: ("pp",),
    ParallelMode.CONTEXT: ("pp", "cp"),
    # gtp_remat: an axis of size 1 leaves the index, hence every seed, as it was before it
    ParallelMode.MODEL: ("pp", "tp", "gtp_remat"),
    ParallelMode.DATA_CONTEXT: ("pp",),
    ParallelMode.EMBEDDING: ("pp",),
    ParallelMode.EXPERT: ("pp", "ep", "etp"),
    ParallelMode.EXPERT_TENSOR: ("pp", "etp"),
    ParallelMode.EXPERT_DATA: ("pp",),
    ParallelMode.EXPERT_TENSOR_AND_EXPERT: ("pp", "ep", "etp"),
    ParallelMode.EXPERT_MODEL: ("pp", "ep", "etp"),
    # HSDP parts of the data axes: like DATA, one stream per pipeline stage.
    ParallelMode.DATA_SHARD: ("pp",),
    ParallelMode.DATA_REPLICATE: ("pp",),
    ParallelMode.DATA_SHARD_CONTEXT: ("pp",),
    ParallelMode.EXPERT_DATA_SHARD: ("pp",),
    ParallelMode.EXPERT_DATA_REPLICATE: ("pp",),
    # generalized tensor parallelism: each weight shard (and the ranks' distinct data) its own
    ParallelMode.GTP_REMAT: ("pp", "tp", "gtp_remat"),
    ParallelMode.EXPERT_GTP_REMAT: ("pp", "ep", "etp", "egtp_remat"),
    REPLICA: ("pp", "dp", "gtp_remat"),
}

SLOT_SPACING = MAX_WORLD_SIZE
"""Distance between the seeds of two slots (2**24): an index is below the world size, so the
indexes of two slots never overlap."""

SLOT_LIMIT = 2**32 // SLOT_SPACING
"""Slots lie in ``[0, SLOT_LIMIT)``: every seed then fits the 32 bits torch's CPU generator keeps."""

STREAMS: tuple[Any, ...] = (*ParallelMode, REPLICA)
"""Every stream key, in slot order."""

_missing = [m for m in STREAMS if m not in STREAM_SLOTS or m not in STREAM_AXES]
if _missing:  # caught by the import itself, so a new mode cannot ship without its seed rules
    raise ImportError(f"parallelctx.seed: no seed slot or axes for {_missing}; add them to STREAM_SLOTS/AXES")
if len(set(STREAM_SLOTS.values())) != len(STREAM_SLOTS):
    raise ImportError("parallelctx.seed: two streams share a seed slot")
if not all(0 <= slot < SLOT_LIMIT for slot in STREAM_SLOTS.values()):
    raise ImportError(f"parallelctx.seed: every seed slot must lie in [0, {SLOT_LIMIT})")


def parse_stream(stream: Stream) -> Any:
    """Return the stream key for ``stream``: a :class:`ParallelMode`, or :data:`REPLICA`; a
    pair ``(module, stream)`` (a stream of another module, ``parallel.modules``) keeps the module.

    Raises:
        LayoutError: ``stream`` names neither a mode (any name of :meth:`ParallelMode.parse`) nor
            ``"replica"`` (any case).
    """
    if isinstance(stream, str) and stream.lower() == REPLICA:
        return REPLICA
    if isinstance(stream, tuple) and len(stream) == 2:  # (module, stream): another module's
        return (stream[0], parse_stream(stream[1]))
    return ParallelMode.parse(stream)


MODULE_SLOT_BASE = 65
"""The first seed slot of the modules after the first (``parallel.modules``): module ``k >= 1``
of the config's order gives stream ``s`` the slot ``65 + (k - 1) * 21 + STREAMS.index(s)``, so
every stream of every module of a rank starts from its own seed; module 0 (and a job without
modules) keeps :data:`STREAM_SLOTS`. Ten modules fill the slots up to 253."""


def stream_slot(key: Any, module: int = 0) -> int:
    """Return the seed slot of stream ``key`` in the config's module number ``module`` (0: the
    first module, or a job without modules).

    Raises:
        ValueError: a module number past :data:`parallelctx.planning.modules.MAX_MODULES`.
    """
    if module == 0:
        return STREAM_SLOTS[key]
    slot = MODULE_SLOT_BASE + (module - 1) * len(STREAMS) + STREAMS.index(key)
    if not 0 < module < MAX_MODULES or slot >= SLOT_LIMIT:
        raise ValueError(f"module number {module} has no seed slots: at most {MAX_MODULES} modules")
    return slot


def mode_seed(layout: Layout, rank: int, mode: Stream, base: int, module: int = 0) -> int:
    """Return the seed of ``mode``'s stream on ``rank`` (formula in the module docstring) in the
    config's module number ``module`` (:func:`stream_slot`).

    Raises:
        LayoutError: an unknown stream or a rank outside the layout.
    """
    key = parse_stream(mode)  # before the rank: an unknown stream is named first, as before
    return seed_at(layout, layout.coords(rank), key, base, module)


def seed_at(layout: Layout, coords: Mapping[str, int], key: Any, base: int, module: int = 0) -> int:
    """Return :func:`mode_seed` for the rank at ``coords`` (``layout.coords(rank)``, read once
    for all of a rank's streams) and the stream key ``key`` (:func:`parse_stream`'s).

    Raises:
        KeyError: ``key`` is no stream key.
        ValueError: as :func:`stream_slot`.
    """
    index = 0
    for axis in STREAM_AXES[key]:
        index = index * layout.axis_size(axis) + coords[axis]
    return (base + stream_slot(key, module) * SLOT_SPACING + index) % 2**32


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    _seed_torch(seed)


def _seed_torch(seed: int, cuda: bool | None = None) -> None:
    """``torch.manual_seed(seed)``, without its CUDA share where CUDA is unavailable (a CPU-only
    build, no GPU; ``cuda``: whether it is, when the caller knows): there each call would only
    queue a deferred CUDA seed that can never apply, recording the caller's stack for it
    (milliseconds per call). The CPU generator gets the same seed either way; where CUDA is
    available nothing changes."""
    if torch.cuda.is_available() if cuda is None else cuda:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


_State = tuple[torch.Tensor, "torch.Tensor | None"]


@dataclass(frozen=True)
class RNGSnapshot:
    """Every stream's generator states at one moment (see :meth:`RNGStreams.snapshot`)."""

    active: Any
    states: dict[Any, _State]


class RNGStreams:
    """One RNG stream per mode (and :data:`REPLICA`), entered with :meth:`fork`.

    The stream of GLOBAL is the default generators' own state: outside any ``fork`` the process
    runs on it.
    """

    def __init__(self, seeds: dict[Any, int], cuda: bool) -> None:
        """Create a stream per entry of ``seeds``; the GLOBAL seed seeds the default generators.

        Raises:
            KeyError: ``seeds`` has no GLOBAL entry.
        """
        self.seeds = dict(seeds)
        self._cuda = cuda
        self._states: dict[Any, _State] = {}
        self._active: Any = ParallelMode.GLOBAL
        seed_everything(self.seeds[ParallelMode.GLOBAL])
        saved = self._capture()
        available = torch.cuda.is_available()
        for mode, seed in self.seeds.items():
            _seed_torch(seed, available)
            self._states[mode] = self._capture()
        self._restore(saved)

    @property
    def cuda(self) -> bool:
        """Whether each stream holds a CUDA generator state too."""
        return self._cuda

    def _capture(self) -> _State:
        return torch.get_rng_state(), (torch.cuda.get_rng_state() if self._cuda else None)

    def _restore(self, state: _State) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    def snapshot(self) -> RNGSnapshot:
        """Return the state of every stream now (the active one read from the generators).

        Returns:
            An :class:`RNGSnapshot`; its tensors are copies, safe to keep.
        """
        states = dict(self._states)
        states[self._active] = self._capture()
        return RNGSnapshot(self._active, states)

    def restore(self, snap: RNGSnapshot, activate: bool = False) -> None:
        """Put every stream back to ``snap``. By default the stream active now stays active
        (``gpc.set_rng_state`` inside a ``with gpc.seed`` block): the generators get its state
        from ``snap``. With ``activate=True`` the stream active in ``snap`` becomes active again,
        as for a recomputation; the caller must then restore a later snapshot the same way
        (:meth:`replay` does both).

        Raises:
            KeyError: ``snap`` lacks a stream this object has (it came from another layout).
        """
        self._check(snap)
        if activate:
            self._load(snap)
            return
        self._states = dict(snap.states)
        self._restore(self._states[self._active])

    @contextlib.contextmanager
    def replay(self, snap: RNGSnapshot) -> Iterator[None]:
        """Run the body as if at the moment of ``snap``: every stream as it was then, and the
        stream active then active again (a checkpointed region's recomputation draws what its
        forward drew, whatever stream is active now). Afterwards every stream, and which one
        is active, are put back as they were before the body.

        Raises:
            KeyError: ``snap`` lacks a stream this object has (it came from another layout).
        """
        now = self.snapshot()
        self.restore(snap, activate=True)
        try:
            yield
        finally:
            self.restore(now, activate=True)

    def _check(self, snap: RNGSnapshot) -> None:
        missing = set(self._states) - set(snap.states)
        if missing:
            raise KeyError(f"the RNG snapshot has no state for streams {sorted(map(str, missing))}")

    def _load(self, snap: RNGSnapshot) -> None:
        """Every stream from ``snap``, and ``snap``'s active stream into the generators."""
        self._states = dict(snap.states)
        self._active = snap.active
        self._restore(self._states[snap.active])

    def reseed(self, stream: Any, seed: int) -> None:
        """Restart ``stream`` from ``seed``: it then draws what a fresh ``torch.Generator`` (CPU,
        and CUDA where used) seeded with ``seed`` draws; ``seeds[stream]`` becomes ``seed``. The
        other streams, and the default generators unless ``stream`` is the active one, keep
        their state. (For code that seeds streams itself, e.g. Megatron's
        ``model_parallel_cuda_manual_seed`` through :mod:`parallelctx.megatron`.)

        Raises:
            KeyError: ``stream`` has no stream here.
        """
        if stream not in self._states:
            raise KeyError(f"no RNG stream {stream!r}; streams are {sorted(map(str, self._states))}")
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = None
        if self._cuda:
            device = torch.device("cuda", torch.cuda.current_device())
            cuda = torch.Generator(device=device).manual_seed(seed).get_state()
        self.seeds[stream] = seed
        self._states[stream] = (cpu, cuda)
        if stream == self._active:
            self._restore((cpu, cuda))

    @contextlib.contextmanager
    def fork(self, mode: Any) -> Iterator[None]:
        """Run the body on ``mode``'s stream (CPU and CUDA), then switch back.

        The generators always hold the active stream; the others wait in ``_states``.

        ``mode`` is a stream key or any name of one (``"tensor"``, ``"tp"``, ``"replica"``).

        Raises:
            LayoutError: ``mode`` names no stream.
            KeyError: ``mode`` has no stream here.
        """
        mode = parse_stream(mode)  # a plain name finds the active stream below
        outer = self._active
        if mode == outer:  # (module, key) pairs are made anew on every call: equal, not identical
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
