"""Which megatron-core release is installed, and what of it the bridge knows.

The bridge reads the installed release instead of assuming one: the module globals of
``parallel_state`` (what its getters read), the fields of ``ProcessGroupCollection``, the
keyword options of ``initialize_model_parallel`` and every getter's parameters. :func:`detect`
collects them; :func:`check` compares them with the tables below, which hold what megatron-core
0.16, 0.17, 0.18 and 0.19 have, and refuses anything else by name. Supporting the next release
is a change to these tables (and, for a new group, to :mod:`.state`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import megatron.core as _mcore
from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import random as _mrandom

__all__ = ["SUPPORTED_RELEASES", "MegatronVersionError", "Release", "check", "detect"]

SUPPORTED_RELEASES = ("0.16", "0.17", "0.18", "0.19")
"""The megatron-core minor releases whose ``parallel_state`` the bridge knows."""

TESTED_VERSIONS = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
"""The versions the test suite runs the bridge under (0.16.1: ``make test``; the others: ``make
test-megatron-017``, ``-018``, ``-019``, each in its own venv; all four: ``make
test-megatron-upstream``)."""


class MegatronVersionError(RuntimeError):
    """The installed megatron-core has globals, fields, options or getters the bridge does not know,
    or lacks ones every known release has."""


# megatron-core 0.19's globals of generalized tensor parallelism (absent before 0.19)
_GTP_GLOBALS = (
    "_GTP_WEIGHT_REMAT_GROUP",
    "_GTP_WEIGHT_REMAT_GLOBAL_RANKS",
    "_EXPERT_GTP_WEIGHT_REMAT_GROUP",
    "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP",
    "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
    "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
)

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
        *_GTP_GLOBALS,
    )
}

# The globals every known release has; the others (GTP in 0.19, the all-gather group and the
# symmetric memory buffer before 0.18/0.17) depend on the release.
RELEASE_GLOBALS: frozenset[str] = frozenset(
    {
        "_DATA_PARALLEL_GROUP_WITH_CP_AG",
        "_GLOBAL_SYMMETRIC_MEMORY_BUFFER",
        *_GTP_GLOBALS,
    }
)

_STATE_NAME = re.compile(r"^_[A-Z][A-Z0-9_]*$")

# What the bridge swaps in megatron.core.tensor_parallel.random (every known release has them).
RANDOM_NAMES = (
    "CudaRNGStatesTracker",
    "_CUDA_RNG_STATE_TRACKER",
    "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
    "_get_all_rng_states",
    "_set_all_rng_states",
    "_MODEL_PARALLEL_RNG_TRACKER_NAME",
    "_EXPERT_PARALLEL_RNG_TRACKER_NAME",
    "_DATA_PARALLEL_RNG_TRACKER_NAME",
)

# ProcessGroupCollection field -> the parallel_state global use_mpu_process_groups() reads
# (None: the field use_mpu_process_groups() leaves None in every release that has it).
COLLECTION_FIELDS: dict[str, str | None] = {
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
    # 0.18: all-gather groups are made by create_all_gather_groups(), never by the init
    "dp_cp_ag": None,
    "expt_dp_ag": None,
    # 0.19: generalized tensor parallelism
    "tp_ep_pp_with_egtp_remat": "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP",
    "dp_cp_gtp_remat": "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT",
    "gtp_remat": "_GTP_WEIGHT_REMAT_GROUP",
    "expt_gtp_remat": "_EXPERT_GTP_WEIGHT_REMAT_GROUP",
    "expt_dp_gtp_remat": "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT",
}
"""Each known field of Megatron's ``ProcessGroupCollection`` and the ``parallel_state`` global it
mirrors (None where Megatron leaves it unset, as ``use_mpu_process_groups()`` gives)."""

# initialize_model_parallel's keyword options, 0.16 to 0.19.
KNOWN_OPTIONS: tuple[str, ...] = (
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
    "create_all_gather_group",  # 0.16, 0.17
    "rank_offset",  # 0.17 on
    "local_world_size",  # 0.17 on
    "gtp_remat_size",  # 0.19 on
    "expert_gtp_remat_size",  # 0.19 on
)

# Generated from the parallel_state.py of megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2:
# every get_/set_/is_ function and the union of its parameters.
KNOWN_GETTERS: dict[str, tuple[str, ...]] = {
    "get_all_ranks": (),
    "get_amax_reduction_group": ("with_context_parallel", "tp_only_amax_red"),
    "get_context_parallel_global_ranks": ("check_initialized",),
    "get_context_parallel_group": ("check_initialized",),
    "get_context_parallel_rank": (),
    "get_context_parallel_world_size": (),
    "get_data_modulo_expert_parallel_group": ("partial_expert_data_parallel",),
    "get_data_parallel_group": (
        "with_context_parallel",
        "partial_data_parallel",
        "independent_all_gather",
        "with_gtp_remat",
    ),
    "get_data_parallel_group_gloo": ("with_context_parallel", "partial_data_parallel"),
    "get_data_parallel_rank": ("with_context_parallel", "partial_data_parallel", "with_gtp_remat"),
    "get_data_parallel_src_rank": ("with_context_parallel",),
    "get_data_parallel_world_size": ("with_context_parallel", "partial_data_parallel", "with_gtp_remat"),
    "get_embedding_group": ("check_initialized",),
    "get_expert_data_parallel_group": ("check_initialized", "partial_expert_data_parallel", "with_gtp_remat"),
    "get_expert_data_parallel_group_gloo": ("partial_expert_data_parallel",),
    "get_expert_data_parallel_rank": ("partial_expert_data_parallel", "with_gtp_remat"),
    "get_expert_data_parallel_world_size": ("partial_expert_data_parallel", "with_gtp_remat"),
    "get_expert_gtp_weight_remat_global_ranks": ("check_initialized",),
    "get_expert_gtp_weight_remat_group": ("check_initialized",),
    "get_expert_gtp_weight_remat_rank": (),
    "get_expert_gtp_weight_remat_world_size": (),
    "get_expert_model_parallel_group": ("check_initialized",),
    "get_expert_model_parallel_rank": (),
    "get_expert_model_parallel_src_rank": (),
    "get_expert_model_parallel_world_size": (),
    "get_expert_tensor_and_model_parallel_group": ("check_initialized",),
    "get_expert_tensor_and_model_parallel_rank": (),
    "get_expert_tensor_and_model_parallel_world_size": (),
    "get_expert_tensor_model_pipeline_parallel_group": ("check_initialized", "with_egtp_remat"),
    "get_expert_tensor_parallel_group": ("check_initialized",),
    "get_expert_tensor_parallel_rank": (),
    "get_expert_tensor_parallel_world_size": (),
    "get_global_memory_buffer": (),
    "get_global_symmetric_memory_buffer": (),
    "get_gtp_weight_remat_global_ranks": ("check_initialized",),
    "get_gtp_weight_remat_group": ("check_initialized",),
    "get_gtp_weight_remat_rank": (),
    "get_gtp_weight_remat_world_size": (),
    "get_hierarchical_context_parallel_groups": ("check_initialized",),
    "get_hybrid_data_context_parallel_groups": ("check_initialized", "group_size"),
    "get_inter_distributed_optimizer_instance_group": ("check_initialized",),
    "get_intra_distributed_optimizer_instance_group": ("check_initialized",),
    "get_model_parallel_group": ("check_initialized",),
    "get_model_parallel_src_rank": (),
    "get_nccl_options": ("pg_name", "nccl_comm_cfgs"),
    "get_pipeline_model_parallel_first_rank": (),
    "get_pipeline_model_parallel_group": ("check_initialized",),
    "get_pipeline_model_parallel_last_rank": (),
    "get_pipeline_model_parallel_next_rank": (),
    "get_pipeline_model_parallel_prev_rank": (),
    "get_pipeline_model_parallel_rank": (),
    "get_pipeline_model_parallel_world_size": (),
    "get_position_embedding_group": ("check_initialized",),
    "get_tensor_and_context_parallel_group": ("check_initialized",),
    "get_tensor_and_context_parallel_rank": (),
    "get_tensor_and_context_parallel_world_size": (),
    "get_tensor_and_data_parallel_group": ("check_initialized", "with_context_parallel"),
    "get_tensor_model_parallel_group": ("check_initialized",),
    "get_tensor_model_parallel_rank": (),
    "get_tensor_model_parallel_src_rank": (),
    "get_tensor_model_parallel_world_size": (),
    "get_virtual_pipeline_model_parallel_rank": (),
    "get_virtual_pipeline_model_parallel_world_size": (),
    "is_initialized": (),
    "is_pipeline_first_stage": ("ignore_virtual", "vp_stage"),
    "is_pipeline_last_stage": ("ignore_virtual", "vp_stage"),
    "is_rank_in_embedding_group": ("ignore_virtual", "vp_stage"),
    "is_rank_in_position_embedding_group": (),
    "is_unitialized": (),
    "set_data_parallel_rank": ("rank",),
    "set_expert_model_parallel_rank": ("rank",),
    "set_expert_model_parallel_world_size": ("world_size",),
    "set_expert_tensor_parallel_rank": ("rank",),
    "set_expert_tensor_parallel_world_size": ("world_size",),
    "set_pipeline_model_parallel_rank": ("rank",),
    "set_pipeline_model_parallel_world_size": ("world_size",),
    "set_tensor_model_parallel_rank": ("rank",),
    "set_tensor_model_parallel_world_size": ("world_size",),
    "set_virtual_pipeline_model_parallel_rank": ("rank",),
    "set_virtual_pipeline_model_parallel_world_size": ("world_size",),
}
# The getters every known release has (a release without one of them is refused).
COMMON_GETTERS: frozenset[str] = frozenset(
    {
        "get_all_ranks",
        "get_amax_reduction_group",
        "get_context_parallel_global_ranks",
        "get_context_parallel_group",
        "get_context_parallel_rank",
        "get_context_parallel_world_size",
        "get_data_parallel_group",
        "get_data_parallel_group_gloo",
        "get_data_parallel_rank",
        "get_data_parallel_src_rank",
        "get_data_parallel_world_size",
        "get_embedding_group",
        "get_expert_data_parallel_group",
        "get_expert_data_parallel_group_gloo",
        "get_expert_data_parallel_rank",
        "get_expert_data_parallel_world_size",
        "get_expert_model_parallel_group",
        "get_expert_model_parallel_rank",
        "get_expert_model_parallel_src_rank",
        "get_expert_model_parallel_world_size",
        "get_expert_tensor_and_model_parallel_group",
        "get_expert_tensor_and_model_parallel_rank",
        "get_expert_tensor_and_model_parallel_world_size",
        "get_expert_tensor_model_pipeline_parallel_group",
        "get_expert_tensor_parallel_group",
        "get_expert_tensor_parallel_rank",
        "get_expert_tensor_parallel_world_size",
        "get_global_memory_buffer",
        "get_hierarchical_context_parallel_groups",
        "get_hybrid_data_context_parallel_groups",
        "get_inter_distributed_optimizer_instance_group",
        "get_intra_distributed_optimizer_instance_group",
        "get_model_parallel_group",
        "get_model_parallel_src_rank",
        "get_nccl_options",
        "get_pipeline_model_parallel_first_rank",
        "get_pipeline_model_parallel_group",
        "get_pipeline_model_parallel_last_rank",
        "get_pipeline_model_parallel_next_rank",
        "get_pipeline_model_parallel_prev_rank",
        "get_pipeline_model_parallel_rank",
        "get_pipeline_model_parallel_world_size",
        "get_position_embedding_group",
        "get_tensor_and_context_parallel_group",
        "get_tensor_and_context_parallel_rank",
        "get_tensor_and_context_parallel_world_size",
        "get_tensor_and_data_parallel_group",
        "get_tensor_model_parallel_group",
        "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_src_rank",
        "get_tensor_model_parallel_world_size",
        "get_virtual_pipeline_model_parallel_rank",
        "get_virtual_pipeline_model_parallel_world_size",
        "is_initialized",
        "is_pipeline_first_stage",
        "is_pipeline_last_stage",
        "is_rank_in_embedding_group",
        "is_rank_in_position_embedding_group",
        "set_data_parallel_rank",
        "set_expert_model_parallel_rank",
        "set_expert_model_parallel_world_size",
        "set_expert_tensor_parallel_rank",
        "set_expert_tensor_parallel_world_size",
        "set_pipeline_model_parallel_rank",
        "set_pipeline_model_parallel_world_size",
        "set_tensor_model_parallel_rank",
        "set_tensor_model_parallel_world_size",
        "set_virtual_pipeline_model_parallel_rank",
        "set_virtual_pipeline_model_parallel_world_size",
    }
)


@dataclass(frozen=True)
class Release:
    """What the installed megatron-core has, read from its modules (see :func:`detect`)."""

    version: str
    globals: frozenset[str]
    fields: tuple[str, ...]
    options: tuple[str, ...]
    getters: dict[str, tuple[str, ...]]
    random_missing: tuple[str, ...]

    @property
    def gtp(self) -> bool:
        """True when ``initialize_model_parallel`` has ``gtp_remat_size`` (0.19 on)."""
        return "gtp_remat_size" in self.options


@functools.cache
def _cached_parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _parameters(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The parameter names of ``fn``, read once per function object: a function's signature
    does not change, and reading the getters' (about 80) took about 3 ms a call of
    :func:`detect`. A getter replaced by another function (a patch) is read afresh, and so is
    a callable that cannot be hashed (a user's wrapper object that defines ``__eq__``)."""
    try:
        return _cached_parameters(fn)
    except TypeError:  # unhashable: not cached
        return tuple(inspect.signature(fn).parameters)


def detect() -> Release:
    """Return what the installed megatron-core has: its version, ``parallel_state`` state
    globals, ``ProcessGroupCollection`` fields, ``initialize_model_parallel`` options, getters
    (``get_*``, ``set_*``, ``is_*``) with their parameters, and which of the RNG names the bridge
    swaps are missing.
    """
    found = {name for name in vars(ps) if _STATE_NAME.match(name)}
    if hasattr(ps, "_global_process_group_list"):
        found.add("_global_process_group_list")
    getters = {
        name: _parameters(fn)
        for name, fn in vars(ps).items()
        if name.startswith(("get_", "set_", "is_"))
        and inspect.isfunction(fn)
        and getattr(fn, "__module__", "") == ps.__name__
    }
    return Release(
        version=str(_mcore.__version__).split("+")[0],
        globals=frozenset(found),
        fields=tuple(f.name for f in dataclasses.fields(ProcessGroupCollection)),
        options=_parameters(ps.initialize_model_parallel),
        getters=getters,
        random_missing=tuple(name for name in RANDOM_NAMES if not hasattr(_mrandom, name)),
    )


def differences(release: Release) -> list[str]:
    """Return, one line each, what ``release`` has that the bridge does not know and what every
    known release has that it lacks (empty: the bridge knows it all)."""
    out: list[str] = []
    known_globals = set(_PRISTINE)
    common_globals = known_globals - RELEASE_GLOBALS

    def note(what: str, names: Any) -> None:
        if names:
            out.append(f"{what}: {sorted(names)}")

    note("unknown parallel_state globals", release.globals - known_globals)
    note("missing parallel_state globals", common_globals - release.globals)
    note("unknown ProcessGroupCollection fields", set(release.fields) - set(COLLECTION_FIELDS))
    note("unknown initialize_model_parallel options", set(release.options) - set(KNOWN_OPTIONS))
    note("unknown getters", set(release.getters) - set(KNOWN_GETTERS))
    note("missing getters", COMMON_GETTERS - set(release.getters))
    unknown_args = [
        f"{name}({arg}=...)"
        for name, params in release.getters.items()
        if name in KNOWN_GETTERS
        for arg in params
        if arg not in KNOWN_GETTERS[name]
    ]
    note("getters with unknown parameters", unknown_args)
    note("missing tensor_parallel.random names", release.random_missing)
    return out


def check(release: Release | None = None) -> Release:
    """Return the installed release (or ``release``) after checking that the bridge knows all
    of it.

    Raises:
        MegatronVersionError: the release has globals, fields, options or getters the bridge
            does not know, or lacks ones every known release has; the message names each and
            the fix.
    """
    if release is None:
        # what detect() reads: parallel_state's names and functions (by identity; never its other
        # values, process groups after install(), which the cache must not keep alive),
        # initialize_model_parallel, the RNG module's names and the version
        state = vars(ps)
        functions = (ps.initialize_model_parallel, *(v for v in state.values() if inspect.isfunction(v)))
        try:
            return _checked(tuple(state), functions, tuple(vars(_mrandom)), str(_mcore.__version__))
        except TypeError:  # an unhashable callable (a user's wrapper object): not cached
            return check(detect())
    found = differences(release)
    if found:
        raise MegatronVersionError(
            f"megatron-core {release.version} differs from the releases parallelctx.megatron knows "
            f"({', '.join(SUPPORTED_RELEASES)}): " + "; ".join(found) + ". Install a supported release "
            "(`pip install 'megatron-core>=0.16,<0.20'`), or add the differences to "
            "parallelctx/megatron/release.py and state.py"
        )
    return release


@functools.lru_cache(maxsize=1)
def _checked(
    names: tuple[str, ...], functions: tuple[Any, ...], random_names: tuple[str, ...], version: str
) -> Release:
    """The installed release, checked (:func:`check`), for what :func:`detect` reads: a launch
    after the first pays for neither while nothing changed, and a patched getter or a new global
    is read afresh. The key holds the functions themselves (compared by identity), never another
    ``parallel_state`` value."""
    return check(detect())


def pristine(name: str) -> Any:
    """Return the import-time value of the ``parallel_state`` global ``name`` (a fresh one)."""
    return _PRISTINE[name]()


def known_globals() -> tuple[str, ...]:
    """Return every ``parallel_state`` global the bridge fills, in a fixed order."""
    return tuple(_PRISTINE)
