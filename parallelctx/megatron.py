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

import dataclasses
import inspect
import logging
import math
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .context import NotLaunchedError, gpc
from .groups import _claim_name, _compact, local_sync_blocker
from .layout import Layout, ParallelMode

try:
    import megatron.core as _mcore
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import random as _mrandom
except ImportError as _exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "parallelctx.megatron needs megatron-core, which is not installed: "
        "`pip install 'parallelctx[megatron]'` (megatron-core==0.16.1)"
    ) from _exc

__all__ = [
    "COLLECTION_FIELDS",
    "RNG_STREAMS",
    "SUPPORTED_VERSION",
    "GpcRNGTracker",
    "MegatronVersionError",
    "check_megatron_version",
    "install",
    "is_installed",
    "process_groups",
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
    "CudaRNGStatesTracker",
    "_CUDA_RNG_STATE_TRACKER",
    "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
    "_get_all_rng_states",
    "_set_all_rng_states",
    "_MODEL_PARALLEL_RNG_TRACKER_NAME",
    "_EXPERT_PARALLEL_RNG_TRACKER_NAME",
    "_DATA_PARALLEL_RNG_TRACKER_NAME",
)

# The gloo groups create_gloo_process_groups=False leaves unset.
_GLOO_GLOBALS = (
    "_DATA_PARALLEL_GROUP_GLOO",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
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
    fix = f"install the supported version: `pip install 'parallelctx[megatron]'` (megatron-core=={SUPPORTED_VERSION})"
    if found != known or missing_random:
        raise MegatronVersionError(
            f"megatron-core {_mcore.__version__} keeps other parallel_state globals than {SUPPORTED_VERSION}: "
            f"new {sorted(found - known)}, missing {sorted(known - found) + missing_random}; {fix}"
        )
    options = set(inspect.signature(ps.initialize_model_parallel).parameters)
    fields = {f.name for f in dataclasses.fields(ProcessGroupCollection)}
    for what, theirs, mine in (
        ("initialize_model_parallel options", options, set(_MEGATRON_OPTIONS)),
        ("ProcessGroupCollection fields", fields, set(COLLECTION_FIELDS)),
    ):
        if theirs != mine:
            raise MegatronVersionError(
                f"megatron-core {_mcore.__version__} has other {what} than {SUPPORTED_VERSION}: "
                f"new {sorted(theirs - mine)}, missing {sorted(mine - theirs)}; {fix}"
            )
    if _mcore.__version__ != SUPPORTED_VERSION:
        logger.warning(
            "parallelctx.megatron is tested with megatron-core %s, found %s (same parallel_state globals)",
            SUPPORTED_VERSION,
            _mcore.__version__,
        )


# --------------------------------------------------------------------------- RNG tracker
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
        return gpc._streams is not None

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
            gpc._note_group(group)
            return group
        mine = None
        for row in every():
            group = dist.new_group(row, timeout=self.timeout, group_desc=desc)
            self.state.calls += 1
            if self.rank in row:
                mine = group
                self.state.created.append(group)
                gpc._note_group(group)
        return mine


@dataclass(frozen=True)
class _Options:
    """The options of Megatron's ``initialize_model_parallel`` that change the installed state."""

    virtual: int | None = None
    all_gather: bool = False
    hierarchical_cp: tuple[int, ...] = ()
    hybrid_cp: bool = False
    gloo: bool = True


# initialize_model_parallel's keyword options in megatron-core 0.16.1 (checked at import).
_MEGATRON_OPTIONS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_comm_backend",
    "use_sharp",
    "context_parallel_size",
    "hierarchical_context_parallel_sizes",
    "hybrid_context_parallel",
    "expert_model_parallel_size",
    "num_distributed_optimizer_instances",
    "expert_tensor_parallel_size",
    "nccl_communicator_config_path",
    "distributed_timeout_minutes",
    "order",
    "get_embedding_ranks",
    "get_position_embedding_ranks",
    "create_gloo_process_groups",
    "high_priority_stream_groups",
    "sharp_enabled_group",
    "create_all_gather_group",
)

# Options that only exist to set NCCL communicator properties at group creation: gpc's groups
# are made at launch, so only Megatron's default is accepted.
_REFUSED_UNLESS_DEFAULT: dict[str, tuple[Any, str]] = {
    "use_sharp": (
        False,
        "SHARP must be enabled (NCCL_COLLNET_ENABLE) when the data-parallel communicator is created, "
        "and gpc's groups are made at launch",
    ),
    "sharp_enabled_group": (None, "it only applies with use_sharp=True, which is not supported"),
    "nccl_communicator_config_path": (
        None,
        "per-group NCCL communicator options (min_ctas, max_ctas, cga_cluster_size) must be given when "
        "a group is created, and gpc's groups are made at launch with the default options",
    ),
    "high_priority_stream_groups": (
        None,
        "NCCL stream priority is a communicator option set when a group is created, and gpc's groups "
        "are made at launch with the default options",
    ),
}


def _option_error(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"install({name}={value!r}) is not supported: {why}")


def _check_same(name: str, value: Any, mine: Any, key: str) -> None:
    if value != mine:
        raise ValueError(
            f"install({name}={value!r}) differs from gpc's {key}={mine!r}: the groups come from gpc's "
            f"launch; set {key} in the config, or drop {name}"
        )


def _parse_options(layout: Layout, options: dict[str, Any]) -> _Options:
    """Validate ``install``'s keyword options against gpc's launch (docs/migration.md's table).

    Raises:
        TypeError: an option ``initialize_model_parallel`` does not have.
        ValueError: an option refused, or one that contradicts gpc's layout; the message names
            it and says why.
    """
    unknown = sorted(set(options) - set(_MEGATRON_OPTIONS))
    if unknown:
        raise TypeError(
            f"install() got unknown options {unknown}; it takes the keyword options of Megatron's "
            f"initialize_model_parallel: {', '.join(_MEGATRON_OPTIONS)}"
        )
    get = options.get
    sizes = {
        "tensor_model_parallel_size": (layout.tensor, "parallel.tensor"),
        "pipeline_model_parallel_size": (layout.pipeline, "parallel.pipeline"),
        "context_parallel_size": (layout.context, "parallel.context"),
        "expert_model_parallel_size": (layout.expert, "parallel.expert.size"),
    }
    for name, (mine, key) in sizes.items():
        if name in options:
            _check_same(name, options[name], mine, key)
    if "expert_tensor_parallel_size" in options:
        etp = options["expert_tensor_parallel_size"]
        _check_same(
            "expert_tensor_parallel_size",
            layout.tensor if etp is None else etp,
            layout.expert_tensor,
            "parallel.expert.tensor",
        )
    if "order" in options:
        order = options["order"]
        try:
            theirs = Layout(
                layout.world_size,
                layout.tensor,
                layout.pipeline,
                layout.context,
                layout.expert,
                layout.expert_tensor,
                order,
            ).to_dict()
        except ValueError as exc:
            raise ValueError(
                f"install(order={order!r}) is not a valid order for gpc's sizes: {exc}"
            ) from None
        if theirs != layout.to_dict():
            raise ValueError(
                f"install(order={order!r}) gives other groups than gpc's parallel.order={layout.order!r}; "
                "set parallel.order in the config, or drop order"
            )
    if "distributed_timeout_minutes" in options:
        minutes = options["distributed_timeout_minutes"]
        timeout = gpc.config.dist.timeout
        if minutes is None or timedelta(minutes=minutes) != timeout:
            raise ValueError(
                f"install(distributed_timeout_minutes={minutes!r}) differs from gpc's dist.timeout={timeout}: "
                "the groups use gpc's timeout; set dist.timeout in the config, or drop the option"
            )
    backend = get("pipeline_model_parallel_comm_backend")
    if backend is not None and backend != str(dist.get_backend()):
        raise _option_error(
            "pipeline_model_parallel_comm_backend",
            backend,
            f"the pipeline groups are gpc's, on its backend {dist.get_backend()!r}; a separate backend "
            "for pipeline communication (e.g. 'ucc') needs groups parallelctx does not make",
        )
    for name, (default, why) in _REFUSED_UNLESS_DEFAULT.items():
        value = get(name, default)
        if value != default and not (name == "high_priority_stream_groups" and value == []):
            raise _option_error(name, value, why)
    instances = get("num_distributed_optimizer_instances", 1)
    if instances != 1:
        raise _option_error(
            "num_distributed_optimizer_instances",
            instances,
            "several distributed-optimizer instances need the data axis split into replicate x shard "
            "groups, which gpc does not make yet; use 1 (one instance spanning the data-parallel ranks)",
        )
    for name in ("get_embedding_ranks", "get_position_embedding_ranks"):
        fn = get(name)
        if fn is None:
            continue
        default = (
            ps.default_embedding_ranks
            if name == "get_embedding_ranks"
            else ps.default_position_embedding_ranks
        )
        pipes = layout.groups(ParallelMode.PIPELINE)
        if any(list(fn(pipe)) != list(default(pipe)) for pipe in pipes):
            raise _option_error(
                name,
                fn,
                "it picks other ranks than Megatron's default for some pipeline; custom embedding "
                "groups would need groups that span pipeline stages, which gpc makes only at launch "
                "(its EMBEDDING group holds the first and last stage)",
            )
    virtual = get("virtual_pipeline_model_parallel_size")
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
    hierarchical = tuple(get("hierarchical_context_parallel_sizes") or ())
    if hierarchical:
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in hierarchical):
            raise ValueError(
                f"hierarchical_context_parallel_sizes={list(hierarchical)!r} must be positive integers"
            )
        if math.prod(hierarchical) != layout.context:
            raise ValueError(
                f"hierarchical_context_parallel_sizes={list(hierarchical)!r} multiply to "
                f"{math.prod(hierarchical)}, not to parallel.context={layout.context}; give sizes whose "
                "product is the context size"
            )
    hybrid = bool(get("hybrid_context_parallel", False))
    dp_cp = layout.data * layout.context
    if hybrid and dp_cp % 2:
        raise ValueError(
            f"hybrid_context_parallel=True needs an even number of data x context ranks, not {dp_cp}; "
            "change parallel.context or the world size, or drop the option"
        )
    return _Options(
        virtual=virtual,
        all_gather=bool(get("create_all_gather_group", False)),
        hierarchical_cp=hierarchical,
        hybrid_cp=hybrid,
        gloo=bool(get("create_gloo_process_groups", True)),
    )


def _hierarchical_rows(ranks: Sequence[int], sizes: Sequence[int], level: int) -> list[list[int]]:
    """Megatron's hierarchical sub-groups of ``ranks`` at ``level``: with ``u`` the product of
    the sizes below it, members ``u`` apart, ``sizes[level]`` of them (as ``[2, 2, 4]`` over 16
    ranks gives [0,1].., [0,2].., [0,4,8,12]..)."""
    inner = math.prod(sizes[:level])
    size = sizes[level]
    outer = math.prod(sizes[level + 1 :])
    return [
        [ranks[o * size * inner + k * inner + u] for k in range(size)]
        for o in range(outer)
        for u in range(inner)
    ]


def _hybrid_rows(ranks: Sequence[int]) -> dict[int, list[list[int]]]:
    """Megatron's hybrid data x context groups of ``ranks``: for every power of two from 2 up
    to half the ranks, consecutive chunks of that size."""
    sizes = [2**i for i in range(int(math.log2(len(ranks))))][1:]
    return {n: [list(ranks[i : i + n]) for i in range(0, len(ranks), n)] for n in sizes}


def _extra_groups(layout: Layout, rank: int, maker: _Maker, opts: _Options) -> dict[str, Any]:
    """The groups gpc has no mode for, keyed by Megatron's token ``(members, group)``, plus
    ``"pos"``: the position-embedding group (this rank alone, on the first pipeline stage only;
    None elsewhere); with the options, ``"ag"`` (a separate data x context group), ``"hcp"`` (the
    hierarchical context groups) and ``"hybrid"`` (``{size: group}``)."""
    existing = _existing_groups()
    out: dict[str, Any] = {}

    def kind(members: list[int], every: Callable[[], Iterator[list[int]]], desc: str) -> Any:
        key = tuple(members)
        if key not in existing:
            existing[key] = (maker.make(members, every, desc), None)
        return existing[key][0]

    def rows_of(axes: tuple[str, ...]) -> Callable[[], Iterator[list[int]]]:
        def every() -> Iterator[list[int]]:
            seen = set()
            for r in range(layout.world_size):
                row = tuple(_members(layout, r, axes))
                if row not in seen:
                    seen.add(row)
                    yield list(row)

        return every

    for token, (axes, desc) in _EXTRA_GROUPS.items():
        members = _members(layout, rank, axes)
        out[token] = (members, kind(members, rows_of(axes), desc))
    # Position embedding: the first stage of each pipeline, alone. When gpc has no one-rank
    # group (no mode of size 1), every rank makes its own, so group counts stay equal across
    # stages (later locally synchronized groups are named by that count).
    alone = [rank]

    def firsts() -> Iterator[list[int]]:
        for pipe in layout.groups(ParallelMode.PIPELINE):
            yield [pipe[0]]

    group = kind(alone, firsts, "megatron_position_embedding")
    first = gpc.get_local_rank(ParallelMode.PIPELINE) == 0
    out["pos"] = (alone, group) if first else ([], None)
    if opts.all_gather:  # a communicator of its own, never an existing group

        def dp_cps() -> Iterator[list[int]]:
            yield from layout.groups(ParallelMode.DATA_CONTEXT)

        members = gpc.get_ranks_in_group(ParallelMode.DATA_CONTEXT)
        out["ag"] = maker.make(members, dp_cps, "megatron_data_context_all_gather")
    if opts.hierarchical_cp:
        levels = []
        for level in range(len(opts.hierarchical_cp)):

            def every(level: int = level) -> Iterator[list[int]]:
                for cp in layout.groups(ParallelMode.CONTEXT):
                    yield from _hierarchical_rows(cp, opts.hierarchical_cp, level)

            rows = _hierarchical_rows(
                gpc.get_ranks_in_group(ParallelMode.CONTEXT), opts.hierarchical_cp, level
            )
            members = next(row for row in rows if rank in row)
            levels.append(kind(members, every, f"megatron_hierarchical_context_L{level}"))
        out["hcp"] = levels
    if opts.hybrid_cp:
        hybrid = {}
        for size, rows in _hybrid_rows(gpc.get_ranks_in_group(ParallelMode.DATA_CONTEXT)).items():

            def chunks(size: int = size) -> Iterator[list[int]]:
                for dp_cp in layout.groups(ParallelMode.DATA_CONTEXT):
                    yield from _hybrid_rows(dp_cp)[size]

            members = next(row for row in rows if rank in row)
            hybrid[size] = kind(members, chunks, f"megatron_hybrid_data_context_{size}")
        out["hybrid"] = hybrid
    return out


def _values(layout: Layout, rank: int, extra: dict[str, Any], opts: _Options) -> dict[str, Any]:
    """Every parallel_state global's value after install, as initialize_model_parallel sets it
    with ``opts`` (num_distributed_optimizer_instances=1, default embedding ranks)."""
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
    if opts.virtual is not None:
        v["_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK"] = 0
        v["_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE"] = opts.virtual
    if opts.all_gather:
        v["_DATA_PARALLEL_GROUP_WITH_CP_AG"] = extra["ag"]
    if opts.hierarchical_cp:
        v["_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"] = extra["hcp"]
    if opts.hybrid_cp:
        v["_HYBRID_DP_CP_GROUPS"] = dict(extra["hybrid"])
    if not opts.gloo:
        for name in _GLOO_GLOBALS:
            v[name] = None
    # What update_pg_timeout walks: None (the default group), then every group of this rank.
    listed: list[Any] = [None]
    for name in sorted(v):
        value = v[name]
        values = (
            value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [value]
        )
        for group in values:
            if isinstance(group, dist.ProcessGroup) and all(group is not g for g in listed):
                listed.append(group)
    v["_global_process_group_list"] = listed
    return v


def _require_launched(what: str) -> Layout:
    if gpc._layout is None or gpc._streams is None:
        raise NotLaunchedError(
            f"parallelctx.megatron.{what} needs a launched gpc: call parallelctx.launch_from_torch(config) "
            "(or launch, launch_from_env, spawn) first"
        )
    return gpc._layout


def _build(layout: Layout, opts: _Options) -> tuple[_Installed, dict[str, Any]]:
    """Make the groups gpc lacks for ``opts`` and return them with every global's value."""
    rank = gpc.get_global_rank()
    state = _Installed()
    try:
        extra = _extra_groups(layout, rank, _Maker(layout, rank, state), opts)
        return state, _values(layout, rank, extra, opts)
    except BaseException:
        _destroy_groups(state.created)
        raise


def install(virtual_pipeline_model_parallel_size: int | None = None, **options: Any) -> int:
    """Make ``megatron.core.parallel_state`` answer from gpc's groups, as Megatron's own
    ``initialize_model_parallel`` would for gpc's sizes and order, and put Megatron's RNG tracker
    on gpc's streams. Every rank must call it, after launch, before creating other groups.

    ``virtual_pipeline_model_parallel_size`` and ``options`` are ``initialize_model_parallel``'s
    keyword options by their Megatron names; each gives what Megatron gives or is refused by
    name with the reason (the table in docs/migration.md). The sizes, ``order`` and
    ``distributed_timeout_minutes`` are accepted when they agree with gpc's launch.

    Returns:
        The number of ``new_group`` calls this rank made (0 to 4 without options; the groups
        gpc has are reused).

    Raises:
        NotLaunchedError: gpc is not launched.
        RuntimeError: already installed (call :func:`uninstall` first), or Megatron's own
            ``initialize_model_parallel`` has filled ``parallel_state`` (call
            ``parallel_state.destroy_model_parallel()`` first).
        TypeError: an option ``initialize_model_parallel`` does not have.
        ValueError: an option that is refused or contradicts gpc's launch (the message names
            it), e.g. ``virtual_pipeline_model_parallel_size`` with a pipeline of size 1 (Megatron
            refuses that too) or ``num_distributed_optimizer_instances > 1``.
        MegatronVersionError: megatron-core keeps other globals than the supported version.
    """
    global _state
    layout = _require_launched("install()")
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
    if virtual_pipeline_model_parallel_size is not None:
        options["virtual_pipeline_model_parallel_size"] = virtual_pipeline_model_parallel_size
    opts = _parse_options(layout, options)
    state, values = _build(layout, opts)
    for name, value in values.items():
        setattr(ps, name, value)
    state.random_before = {name: getattr(_mrandom, name) for name in _RANDOM_NAMES[:5]}
    # Megatron's initialize_rng_tracker(force_reset=True) (also through
    # model_parallel_cuda_manual_seed(..., force_reset_rng=True)) builds a new tracker of the
    # class it finds here: make that a tracker on gpc's streams too, which gpc's checkpoint and
    # get_rng_state keep restoring.
    _mrandom.CudaRNGStatesTracker = GpcRNGTracker
    _mrandom._CUDA_RNG_STATE_TRACKER = _TRACKER
    _mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _mrandom._get_all_rng_states = _get_all_rng_states
    _mrandom._set_all_rng_states = _set_all_rng_states
    _state = state
    gpc.add_destroy_hook(_on_destroy)
    return state.calls


# ProcessGroupCollection field -> the parallel_state global use_mpu_process_groups() reads.
COLLECTION_FIELDS: dict[str, str] = {
    "tp": "_TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "_PIPELINE_MODEL_PARALLEL_GROUP",
    "mp": "_MODEL_PARALLEL_GROUP",
    "embd": "_EMBEDDING_GROUP",
    "pos_embd": "_POSITION_EMBEDDING_GROUP",
    "cp": "_CONTEXT_PARALLEL_GROUP",
    "tp_cp": "_TENSOR_AND_CONTEXT_PARALLEL_GROUP",
    "hcp": "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
    "ep": "_EXPERT_MODEL_PARALLEL_GROUP",
    "expt_tp": "_EXPERT_TENSOR_PARALLEL_GROUP",
    "tp_ep": "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",
    "tp_ep_pp": "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",
    "tp_dp_cp": "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP",
    "dp": "_DATA_PARALLEL_GROUP",
    "dp_cp": "_DATA_PARALLEL_GROUP_WITH_CP",
    "expt_dp": "_EXPERT_DATA_PARALLEL_GROUP",
    "intra_dp_cp": "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "intra_expt_dp": "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "inter_dist_opt": "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
    "intra_dist_opt": "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
}
"""Each field of Megatron's ``ProcessGroupCollection`` and the ``parallel_state`` global it
mirrors (None where Megatron leaves it unset, as ``use_mpu_process_groups()`` gives)."""

# Collections process_groups() made since launch, by the options that shape them.
_collections: dict[_Options, tuple[Any, list[Any]]] = {}


def process_groups(**options: Any) -> Any:
    """Return a Megatron ``ProcessGroupCollection`` built from gpc's groups, for Megatron-core
    models and DDP that take ``pg_collection=``: every field holds the group (or None, or the
    list) that ``ProcessGroupCollection.use_mpu_process_groups()`` gives after Megatron's own
    ``initialize_model_parallel`` for gpc's sizes and order. Needs no :func:`install` and leaves
    ``parallel_state`` alone. Every rank must call it (the first call per launch makes the 0 to
    4 groups gpc lacks, as :func:`install` does); later calls return the same collection.

    ``options`` are :func:`install`'s; of those only ``hierarchical_context_parallel_sizes``
    shapes a field (``hcp``).

    Returns:
        A ``megatron.core.process_groups_config.ProcessGroupCollection``.

    Raises:
        NotLaunchedError: gpc is not launched.
        TypeError, ValueError: as :func:`install` for ``options``.
    """
    layout = _require_launched("process_groups()")
    opts = _parse_options(layout, options)
    key = _Options(hierarchical_cp=opts.hierarchical_cp)
    if key not in _collections:
        state, values = _build(layout, key)
        collection = ProcessGroupCollection(**{f: values[g] for f, g in COLLECTION_FIELDS.items()})
        _collections[key] = (collection, state.created)
        gpc.add_destroy_hook(_on_destroy)
    return _collections[key][0]


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
    made = [group for _, created in _collections.values() for group in created]
    _collections.clear()
    _destroy_groups(made)


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
        "_HYBRID_DP_CP_GROUPS": "made by install(hybrid_context_parallel=True): `{size: group}` of "
        "consecutive data × context ranks; else `{}`",
        "_DATA_PARALLEL_GROUP_WITH_CP_AG": "made by install(create_all_gather_group=True): data × context, "
        "a communicator of its own; else None",
        "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": "made by install(hierarchical_context_parallel_sizes=[...]): "
        "one group per level inside the context group; else None",
    }
    out: dict[str, str] = {}
    for name in _PRISTINE:
        if name in by_mode:
            extra = " (middle stages: None)" if by_mode[name] is M.EMBEDDING else ""
            out[name] = f"`gpc.get_group(M.{by_mode[name].name})`{extra}"
        elif name in gloo:
            out[name] = (
                f"`gpc.get_cpu_group(M.{gloo[name].name})` (None with `create_gloo_process_groups=False`)"
            )
        elif name in ranks:
            out[name] = f"`gpc.get_ranks_in_group(M.{ranks[name].name})`"
        elif name in made:
            out[name] = made[name]
        else:
            out[name] = "None, as Megatron leaves it"
    return out


check_megatron_version()
