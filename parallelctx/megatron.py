"""Megatron-core on parallelctx: ``megatron.core.parallel_state`` answering from gpc's groups.

::

    import parallelctx, parallelctx.megatron
    parallelctx.launch_from_torch("configs/llm_3d.py")
    parallelctx.megatron.install()      # every rank; after launch
    # ... Megatron-core model code, unchanged ...
    gpc.destroy()                        # also uninstalls

:func:`install` fills every module global of ``parallel_state`` (megatron-core 0.16.1) with the
value Megatron's own ``initialize_model_parallel`` gives it for the same sizes and order, taking
the groups from gpc. The four kinds of group parallelctx has no mode for (tensor × data with
and without context, tensor × context, the position-embedding group) are made here, only on
their members, with local synchronization; a group whose members equal a group gpc already has
is that group. It also puts Megatron's RNG tracker on gpc's per-mode streams
(:class:`GpcRNGTracker`), so ``tensor_parallel.get_cuda_rng_tracker().fork()`` and
``tensor_parallel.checkpoint`` run on the CPU as well as on CUDA.

:func:`uninstall` (and ``gpc.destroy()``) puts every global back to its import-time value,
destroys the groups :func:`install` made and restores the RNG tracker that was there before.

Not covered, refused or left as Megatron leaves them by default: see docs/migration.md.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .context import NotLaunchedError, gpc
from .groups import _claim_name, _compact, local_sync_blocker
from .layout import Layout, ParallelMode

try:
    import megatron.core as _mcore
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as _mrandom
except ImportError as _exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "parallelctx.megatron needs megatron-core, which is not installed: "
        "pip install 'parallelctx[megatron]' (megatron-core==0.16.1)"
    ) from _exc

__all__ = [
    "RNG_STREAMS",
    "SUPPORTED_VERSION",
    "GpcRNGTracker",
    "MegatronVersionError",
    "check_megatron_version",
    "install",
    "is_installed",
    "sources",
    "uninstall",
]

logger = logging.getLogger("parallelctx")

SUPPORTED_VERSION = "0.16.1"
"""The megatron-core version whose ``parallel_state`` globals this bridge knows."""

# Megatron's tracker stream names -> gpc streams (docs/migration.md explains the choice).
RNG_STREAMS: dict[str, ParallelMode] = {
    "model-parallel-rng": ParallelMode.TENSOR,
    "expert-parallel-rng": ParallelMode.EXPERT,
    "data-parallel-rng": ParallelMode.DATA,
}
"""Megatron's RNG tracker names and the gpc stream each one runs on."""

_STATES_KEY = "parallelctx"

# Every module global of parallel_state 0.16.1 that holds state, with its import-time value
# (a factory, so that a mutable value is fresh every time).
_PRISTINE: dict[str, Callable[[], Any]] = {
    name: (dict if name == "_HYBRID_DP_CP_GROUPS" else (lambda: None))
    for name in (
        "_TENSOR_MODEL_PARALLEL_GROUP",
        "_PIPELINE_MODEL_PARALLEL_GROUP",
        "_MODEL_PARALLEL_GROUP",
        "_EMBEDDING_GROUP",
        "_POSITION_EMBEDDING_GROUP",
        "_DATA_PARALLEL_GROUP",
        "_DATA_PARALLEL_GROUP_GLOO",
        "_TENSOR_AND_DATA_PARALLEL_GROUP",
        "_EXPERT_MODEL_PARALLEL_GROUP",
        "_EXPERT_TENSOR_PARALLEL_GROUP",
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
        "_EXPERT_DATA_PARALLEL_GROUP",
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
        "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE",
        "_MPU_EXPERT_MODEL_PARALLEL_RANK",
        "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE",
        "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
        "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
        "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
        "_MPU_DATA_PARALLEL_WORLD_SIZE",
        "_MPU_DATA_PARALLEL_RANK",
        "_MPU_TENSOR_MODEL_PARALLEL_RANK",
        "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
        "_EMBEDDING_GLOBAL_RANKS",
        "_POSITION_EMBEDDING_GLOBAL_RANKS",
        "_PIPELINE_GLOBAL_RANKS",
        "_DATA_PARALLEL_GLOBAL_RANKS",
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
        "_EXPERT_MODEL_PARALLEL_RANKS",
        "_MODEL_PARALLEL_GLOBAL_RANKS",
        "_CONTEXT_PARALLEL_GROUP",
        "_CONTEXT_PARALLEL_GLOBAL_RANKS",
        "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
        "_HYBRID_DP_CP_GROUPS",
        "_DATA_PARALLEL_GROUP_WITH_CP",
        "_DATA_PARALLEL_GROUP_WITH_CP_AG",
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
        "_GLOBAL_MEMORY_BUFFER",
        "_GLOBAL_SYMMETRIC_MEMORY_BUFFER",
        "_global_process_group_list",
    )
}
_STATE_NAME = re.compile(r"^_[A-Z][A-Z0-9_]*$")
# What the bridge swaps in megatron.core.tensor_parallel.random.
_RANDOM_NAMES = (
    "_CUDA_RNG_STATE_TRACKER",
    "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
    "_get_all_rng_states",
    "_set_all_rng_states",
    "_MODEL_PARALLEL_RNG_TRACKER_NAME",
    "_EXPERT_PARALLEL_RNG_TRACKER_NAME",
    "_DATA_PARALLEL_RNG_TRACKER_NAME",
)

# Groups gpc has no mode for: Megatron's rank-generator token -> dense axes and group_desc.
_EXTRA_GROUPS: dict[str, tuple[tuple[str, ...], str]] = {
    "tp-dp-cp": (("tp", "dp", "cp"), "megatron_tensor_data_context"),
    "tp-dp": (("tp", "dp"), "megatron_tensor_data"),
    "tp-cp": (("tp", "cp"), "megatron_tensor_context"),
}


class MegatronVersionError(RuntimeError):
    """The installed megatron-core keeps other ``parallel_state`` globals than the bridge knows."""


def check_megatron_version() -> None:
    """Check that megatron-core's ``parallel_state`` and RNG module hold exactly the globals this
    bridge fills (those of megatron-core 0.16.1); log a warning for another version string whose
    globals are the same.

    Raises:
        MegatronVersionError: globals are missing or new; the message names them and the fix.
    """
    found = {name for name in vars(ps) if _STATE_NAME.match(name)} | (
        {"_global_process_group_list"} if hasattr(ps, "_global_process_group_list") else set()
    )
    known = set(_PRISTINE)
    missing_random = [name for name in _RANDOM_NAMES if not hasattr(_mrandom, name)]
    if found != known or missing_random:
        raise MegatronVersionError(
            f"megatron-core {_mcore.__version__} keeps other parallel_state globals than {SUPPORTED_VERSION}: "
            f"new {sorted(found - known)}, missing {sorted(known - found) + missing_random}; "
            f"install the supported version: pip install 'parallelctx[megatron]' (megatron-core=={SUPPORTED_VERSION})"
        )
    if _mcore.__version__ != SUPPORTED_VERSION:
        logger.warning(
            "parallelctx.megatron is tested with megatron-core %s, found %s (same parallel_state globals)",
            SUPPORTED_VERSION,
            _mcore.__version__,
        )


check_megatron_version()


# --------------------------------------------------------------------------- RNG tracker
class GpcRNGTracker(_mrandom.CudaRNGStatesTracker):
    """Megatron's RNG tracker interface on gpc's per-mode streams (CPU and CUDA generators).

    ``fork(name)`` enters the gpc stream :data:`RNG_STREAMS` maps ``name`` to (default:
    ``"model-parallel-rng"``, the TENSOR stream). ``add("data-parallel-rng", seed)``, which
    Megatron's ``model_parallel_cuda_manual_seed(seed)`` calls first, re-seeds every gpc stream
    with ``gpc.set_seed(seed)``; the other two names are then already there. ``get_states`` /
    ``set_states`` save and restore every gpc stream (what ``tensor_parallel.checkpoint`` and
    checkpoint code use).
    """

    def __init__(self) -> None:  # the base class's state lives in gpc here
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False

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
        return gpc._streams is not None

    def reset(self) -> None:
        """Nothing to forget: the streams belong to gpc (``gpc.set_seed`` re-seeds them)."""

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
        if not isinstance(states, dict) or _STATES_KEY not in states:
            keys = sorted(states) if isinstance(states, dict) else type(states).__name__
            raise ValueError(
                f"RNG tracker states {keys} did not come from parallelctx's tracker; restore what "
                "get_cuda_rng_tracker().get_states() returned while parallelctx.megatron was installed"
            )
        gpc.rng_streams.restore(states[_STATES_KEY])

    def add(self, name: str, seed: int) -> None:
        """Register ``name``: for ``"data-parallel-rng"`` re-seed every gpc stream from ``seed``
        (``gpc.set_seed(seed)``); the other names of :data:`RNG_STREAMS` exist already.

        Raises:
            ValueError: ``name`` is not in :data:`RNG_STREAMS`, or ``seed`` is outside ``[0, 2**32)``.
        """
        if self._mode(name) is RNG_STREAMS["data-parallel-rng"]:
            gpc.set_seed(int(seed))

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
    """Undo :func:`_get_all_rng_states`: every gpc stream, then the generators as they were."""
    _TRACKER.set_states(tracker)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


_TRACKER = GpcRNGTracker()


# --------------------------------------------------------------------------- install
@dataclass
class _Installed:
    created: list[Any] = field(default_factory=list)
    random_before: dict[str, Any] = field(default_factory=dict)
    calls: int = 0


_state: _Installed | None = None


def is_installed() -> bool:
    """Return True between :func:`install` and :func:`uninstall` (or ``gpc.destroy()``)."""
    return _state is not None


def _members(layout: Layout, rank: int, axes: Sequence[str]) -> list[int]:
    """Ascending members of the dense-grid group spanning ``axes`` that holds ``rank``."""
    strides = layout.strides("dense")
    coords = layout.coords(rank)
    base = rank - sum(coords[a] * strides[a] for a in axes)
    members = [base]
    for axis in axes:
        members = [m + i * strides[axis] for i in range(layout.axis_size(axis)) for m in members]
    return sorted(members)


def _existing_groups() -> dict[tuple[int, ...], tuple[Any, Any]]:
    """gpc's groups of this rank by their members: ``{members: (group, cpu group)}``."""
    found: dict[tuple[int, ...], tuple[Any, Any]] = {}
    for mode in ParallelMode:
        if gpc.is_initialized(mode):
            found.setdefault(
                tuple(gpc.get_ranks_in_group(mode)), (gpc.get_group(mode), gpc.get_cpu_group(mode))
            )
    return found


class _Maker:
    """Makes the groups gpc lacks: only its members call, locally synchronized (or, where torch
    cannot, every rank makes every group of the kind, as groups.py does)."""

    def __init__(self, layout: Layout, rank: int, state: _Installed) -> None:
        self.layout, self.rank, self.state = layout, rank, state
        self.timeout = gpc.config.dist.timeout
        self.blocker = local_sync_blocker() if layout.world_size > 1 else None
        self.used: set[Any] = set() if gpc._owns_default_group else gpc._meetings.adopted_names()

    def make(self, members: Sequence[int], every: Callable[[], Iterator[list[int]]], desc: str) -> Any:
        """This rank's new group with ``members`` (``every`` lists all groups of the kind)."""
        if self.blocker is None:
            _claim_name(_compact(list(members)), self.used)
            group = dist.new_group(
                list(members), timeout=self.timeout, use_local_synchronization=True, group_desc=desc
            )
            self.state.calls += 1
            self.state.created.append(group)
            return group
        mine = None
        for row in every():
            group = dist.new_group(row, timeout=self.timeout, group_desc=desc)
            self.state.calls += 1
            if self.rank in row:
                mine = group
                self.state.created.append(group)
        return mine


def _extra_groups(layout: Layout, rank: int, maker: _Maker) -> dict[str, tuple[list[int], Any]]:
    """The groups gpc has no mode for, keyed by Megatron's token, plus ``"pos"``: the
    position-embedding group (this rank alone, on the first pipeline stage only; None elsewhere)."""
    existing = _existing_groups()
    out: dict[str, tuple[list[int], Any]] = {}
    for token, (axes, desc) in _EXTRA_GROUPS.items():
        members = _members(layout, rank, axes)
        if tuple(members) not in existing:

            def every(axes: tuple[str, ...] = axes) -> Iterator[list[int]]:
                seen = set()
                for r in range(layout.world_size):
                    row = tuple(_members(layout, r, axes))
                    if row not in seen:
                        seen.add(row)
                        yield list(row)

            existing[tuple(members)] = (maker.make(members, every, desc), None)
        out[token] = (members, existing[tuple(members)][0])
    # Position embedding: the first stage of each pipeline, alone. When gpc has no one-rank
    # group (no mode of size 1), every rank makes its own, so group counts stay equal across
    # stages (later locally synchronized groups are named by that count).
    alone = (rank,)
    if alone not in existing:

        def firsts() -> Iterator[list[int]]:
            for pipe in layout.groups(ParallelMode.PIPELINE):
                yield [pipe[0]]

        existing[alone] = (maker.make(alone, firsts, "megatron_position_embedding"), None)
    first = gpc.get_local_rank(ParallelMode.PIPELINE) == 0
    out["pos"] = ([rank], existing[alone][0]) if first else ([], None)
    return out


def _values(
    layout: Layout, rank: int, extra: dict[str, tuple[list[int], Any]], virtual: int | None
) -> dict[str, Any]:
    """Every parallel_state global's value after install, as initialize_model_parallel sets it
    (num_distributed_optimizer_instances=1, no all-gather group, no hierarchical or hybrid
    context parallelism, default embedding ranks)."""
    M = ParallelMode

    def group(mode: ParallelMode) -> Any:
        return gpc.get_group(mode)

    def cpu(mode: ParallelMode) -> Any:
        return gpc.get_cpu_group(mode)

    def ranks(mode: ParallelMode) -> list[int]:
        return gpc.get_ranks_in_group(mode)

    v: dict[str, Any] = {name: factory() for name, factory in _PRISTINE.items()}
    v.update(
        _DATA_PARALLEL_GROUP_WITH_CP=group(M.DATA_CONTEXT),
        _DATA_PARALLEL_GROUP_WITH_CP_GLOO=cpu(M.DATA_CONTEXT),
        _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP=ranks(M.DATA_CONTEXT),
        _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP=group(M.DATA_CONTEXT),
        _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO=cpu(M.DATA_CONTEXT),
        _DATA_PARALLEL_GROUP=group(M.DATA),
        _DATA_PARALLEL_GROUP_GLOO=cpu(M.DATA),
        _DATA_PARALLEL_GLOBAL_RANKS=ranks(M.DATA),
        _CONTEXT_PARALLEL_GROUP=group(M.CONTEXT),
        _CONTEXT_PARALLEL_GLOBAL_RANKS=ranks(M.CONTEXT),
        _MODEL_PARALLEL_GROUP=group(M.MODEL),
        _MODEL_PARALLEL_GLOBAL_RANKS=ranks(M.MODEL),
        _TENSOR_MODEL_PARALLEL_GROUP=group(M.TENSOR),
        _TENSOR_MODEL_PARALLEL_GLOBAL_RANKS=ranks(M.TENSOR),
        _PIPELINE_MODEL_PARALLEL_GROUP=group(M.PIPELINE),
        _PIPELINE_GLOBAL_RANKS=ranks(M.PIPELINE),
        _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP=extra["tp-dp-cp"][1],
        _TENSOR_AND_DATA_PARALLEL_GROUP=extra["tp-dp"][1],
        _TENSOR_AND_CONTEXT_PARALLEL_GROUP=extra["tp-cp"][1],
        _EXPERT_MODEL_PARALLEL_GROUP=group(M.EXPERT),
        _EXPERT_MODEL_PARALLEL_RANKS=ranks(M.EXPERT),
        _EXPERT_TENSOR_PARALLEL_GROUP=group(M.EXPERT_TENSOR),
        _EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP=group(M.EXPERT_TENSOR_AND_EXPERT),
        _EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP=group(M.EXPERT_MODEL),
        _EXPERT_DATA_PARALLEL_GROUP=group(M.EXPERT_DATA),
        _EXPERT_DATA_PARALLEL_GROUP_GLOO=cpu(M.EXPERT_DATA),
        _INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP=group(M.EXPERT_DATA),
        _INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO=cpu(M.EXPERT_DATA),
        # One distributed-optimizer instance spans the world.
        _INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP=group(M.GLOBAL),
        _GLOBAL_MEMORY_BUFFER=ps.GlobalMemoryBuffer(),
    )
    if gpc.is_initialized(M.EMBEDDING):
        v["_EMBEDDING_GROUP"] = group(M.EMBEDDING)
        v["_EMBEDDING_GLOBAL_RANKS"] = ranks(M.EMBEDDING)
    if extra["pos"][1] is not None:
        v["_POSITION_EMBEDDING_GROUP"] = extra["pos"][1]
        v["_POSITION_EMBEDDING_GLOBAL_RANKS"] = extra["pos"][0]
    if virtual is not None:
        v["_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK"] = 0
        v["_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"] = virtual
    # What update_pg_timeout walks: None (the default group), then every group of this rank.
    listed: list[Any] = [None]
    for name in sorted(v):
        value = v[name]
        if isinstance(value, dist.ProcessGroup) and all(value is not g for g in listed):
            listed.append(value)
    v["_global_process_group_list"] = listed
    return v


def install(virtual_pipeline_model_parallel_size: int | None = None) -> int:
    """Make ``megatron.core.parallel_state`` answer from gpc's groups, as Megatron's own
    ``initialize_model_parallel`` would for gpc's sizes and order, and put Megatron's RNG tracker
    on gpc's streams. Every rank must call it, after launch, before creating other groups.

    ``virtual_pipeline_model_parallel_size`` is Megatron's argument of the same name
    (interleaved pipeline): the virtual rank starts at 0, as Megatron's does.

    Returns:
        The number of ``new_group`` calls this rank made (0 to 4; the groups gpc has are reused).

    Raises:
        NotLaunchedError: gpc is not launched.
        RuntimeError: already installed (call :func:`uninstall` first), or Megatron's own
            ``initialize_model_parallel`` has filled ``parallel_state`` (call
            ``parallel_state.destroy_model_parallel()`` first).
        ValueError: ``virtual_pipeline_model_parallel_size`` is not a positive integer, or is
            given with a pipeline of size 1 (Megatron refuses that too).
        MegatronVersionError: megatron-core keeps other globals than the supported version.
    """
    global _state
    if gpc._layout is None or gpc._streams is None:
        raise NotLaunchedError(
            "parallelctx.megatron.install() needs a launched gpc: call parallelctx.launch_from_torch(config) "
            "(or launch, launch_from_env, spawn) first"
        )
    if _state is not None:
        raise RuntimeError(
            "parallelctx.megatron is already installed; call parallelctx.megatron.uninstall() (or gpc.destroy()) "
            "before installing again"
        )
    if ps._DATA_PARALLEL_GROUP is not None or ps._TENSOR_MODEL_PARALLEL_GROUP is not None:
        raise RuntimeError(
            "megatron.core.parallel_state is already initialised (Megatron's initialize_model_parallel ran); "
            "call parallel_state.destroy_model_parallel() first, or use only one of the two"
        )
    check_megatron_version()
    layout = gpc.layout
    virtual = virtual_pipeline_model_parallel_size
    if virtual is not None:
        if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={virtual!r} must be a positive integer or None"
            )
        if layout.pipeline < 2:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={virtual} needs a pipeline of size > 1, but "
                f"parallel.pipeline is {layout.pipeline}; drop it or configure a pipeline"
            )
    rank = gpc.get_global_rank()
    state = _Installed()
    try:
        extra = _extra_groups(layout, rank, _Maker(layout, rank, state))
        values = _values(layout, rank, extra, virtual)
    except BaseException:
        _destroy_groups(state.created)
        raise
    for name, value in values.items():
        setattr(ps, name, value)
    state.random_before = {name: getattr(_mrandom, name) for name in _RANDOM_NAMES[:4]}
    _mrandom._CUDA_RNG_STATE_TRACKER = _TRACKER
    _mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _mrandom._get_all_rng_states = _get_all_rng_states
    _mrandom._set_all_rng_states = _set_all_rng_states
    _state = state
    gpc.add_destroy_hook(_on_destroy)
    return state.calls


def _destroy_groups(groups: list[Any]) -> None:
    if not dist.is_initialized():
        return
    registry = dist.distributed_c10d._world.pg_map
    for group in groups:
        if group is not None and group in registry:
            dist.destroy_process_group(group)


def uninstall() -> bool:
    """Put every ``parallel_state`` global back to its import-time value, the RNG tracker back to
    what it was before :func:`install`, and destroy the groups :func:`install` made.
    ``gpc.destroy()`` calls it. Safe to call when not installed.

    Returns:
        True when something was installed, False otherwise.
    """
    global _state
    state = _state
    if state is None:
        return False
    _state = None
    for name, factory in _PRISTINE.items():
        setattr(ps, name, factory())
    for name, value in state.random_before.items():
        setattr(_mrandom, name, value)
    _destroy_groups(state.created)
    return True


def _on_destroy() -> None:
    uninstall()


def sources() -> dict[str, str]:
    """Return, for every ``parallel_state`` global, where :func:`install` takes its value from
    (the table of docs/migration.md).

    Returns:
        ``{global name: description}``, in the order of :data:`_PRISTINE`.
    """
    M = ParallelMode
    by_mode = {
        "_DATA_PARALLEL_GROUP": M.DATA,
        "_DATA_PARALLEL_GROUP_WITH_CP": M.DATA_CONTEXT,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": M.DATA_CONTEXT,
        "_CONTEXT_PARALLEL_GROUP": M.CONTEXT,
        "_MODEL_PARALLEL_GROUP": M.MODEL,
        "_TENSOR_MODEL_PARALLEL_GROUP": M.TENSOR,
        "_PIPELINE_MODEL_PARALLEL_GROUP": M.PIPELINE,
        "_EMBEDDING_GROUP": M.EMBEDDING,
        "_EXPERT_MODEL_PARALLEL_GROUP": M.EXPERT,
        "_EXPERT_TENSOR_PARALLEL_GROUP": M.EXPERT_TENSOR,
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": M.EXPERT_TENSOR_AND_EXPERT,
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": M.EXPERT_MODEL,
        "_EXPERT_DATA_PARALLEL_GROUP": M.EXPERT_DATA,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": M.EXPERT_DATA,
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": M.GLOBAL,
    }
    gloo = {
        "_DATA_PARALLEL_GROUP_GLOO": M.DATA,
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": M.DATA_CONTEXT,
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": M.DATA_CONTEXT,
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO": M.EXPERT_DATA,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": M.EXPERT_DATA,
    }
    ranks = {
        "_DATA_PARALLEL_GLOBAL_RANKS": M.DATA,
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": M.DATA_CONTEXT,
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": M.CONTEXT,
        "_MODEL_PARALLEL_GLOBAL_RANKS": M.MODEL,
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": M.TENSOR,
        "_PIPELINE_GLOBAL_RANKS": M.PIPELINE,
        "_EMBEDDING_GLOBAL_RANKS": M.EMBEDDING,
        "_EXPERT_MODEL_PARALLEL_RANKS": M.EXPERT,
    }
    made = {
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "made by install(): tensor × data × context (`tp-dp-cp`)",
        "_TENSOR_AND_DATA_PARALLEL_GROUP": "made by install(): tensor × data (`tp-dp`)",
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "made by install(): tensor × context (`tp-cp`)",
        "_POSITION_EMBEDDING_GROUP": "made by install(): this rank alone, first pipeline stage only",
        "_POSITION_EMBEDDING_GLOBAL_RANKS": "`[this rank]` on the first pipeline stage, else None",
        "_GLOBAL_MEMORY_BUFFER": "a new `GlobalMemoryBuffer()`, as Megatron makes",
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": "0 when `virtual_pipeline_model_parallel_size` is given, else None",
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": "`virtual_pipeline_model_parallel_size`, else None",
        "_global_process_group_list": "`[None]` + this rank's installed groups (for `update_pg_timeout`)",
        "_HYBRID_DP_CP_GROUPS": "`{}` (hybrid context parallelism is not supported)",
    }
    out: dict[str, str] = {}
    for name in _PRISTINE:
        if name in by_mode:
            extra = " (middle stages: None)" if by_mode[name] is M.EMBEDDING else ""
            out[name] = f"`gpc.get_group(M.{by_mode[name].name})`{extra}"
        elif name in gloo:
            out[name] = f"`gpc.get_cpu_group(M.{gloo[name].name})`"
        elif name in ranks:
            out[name] = f"`gpc.get_ranks_in_group(M.{ranks[name].name})`"
        elif name in made:
            out[name] = made[name]
        else:
            out[name] = "None, as Megatron leaves it"
    return out
