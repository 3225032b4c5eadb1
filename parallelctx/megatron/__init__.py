"""Megatron-core on parallelctx: ``megatron.core.parallel_state`` answering from gpc's groups.

::

    import parallelctx, parallelctx.megatron
    parallelctx.launch_from_torch("configs/llm_3d.py")
    parallelctx.megatron.install()      # every rank; after launch
    # ... Megatron-core model code, unchanged ...
    gpc.destroy()                        # also uninstalls

:func:`install` fills every module global of the installed ``parallel_state`` (megatron-core
0.16 to 0.19) with the value that release's own ``initialize_model_parallel`` gives it for the
same sizes and order, taking the groups from gpc; :func:`process_groups` gives the same groups as
a ``ProcessGroupCollection`` without touching ``parallel_state`` (Megatron's road forward). The four kinds of group parallelctx has no mode for (tensor × data with
and without context, tensor × context, the position-embedding group) are made here, only on
their members, with local synchronization; a group whose members equal a group gpc already has
is that group. It also puts Megatron's RNG tracker on gpc's per-mode streams
(:class:`GpcRNGTracker`), so ``tensor_parallel.get_cuda_rng_tracker().fork()`` and
``tensor_parallel.checkpoint`` run on the CPU as well as on CUDA.

:func:`uninstall` (and ``gpc.destroy()``) puts every global back to its import-time value,
destroys the groups :func:`install` made and restores the RNG tracker that was there before.

The package by concern: :mod:`.release` (what the installed release has and whether the bridge
knows it), :mod:`.options` (``initialize_model_parallel``'s options), :mod:`.state` (every
global's value, the groups made here), :mod:`.rng` (the RNG tracker); this module holds the
entry points. The release is checked by :func:`install` and :func:`process_groups`, not at
import, so an unknown release gets an error naming what differs where it is used.

Not covered, refused or left as Megatron leaves them by default: see docs/migration.md.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

try:
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import random as _mrandom
except ImportError as _exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "parallelctx.megatron needs megatron-core, which is not installed: "
        "`pip install 'parallelctx[megatron]'` (megatron-core 0.16 to 0.19; docs/migration.md)"
    ) from _exc

from ..context import NotLaunchedError, gpc
from ..planning.layout import Layout
from ..runtime.local import keep_per_rank
from . import release as _release
from .options import Options, parse_options
from .release import (
    COLLECTION_FIELDS,
    SUPPORTED_RELEASES,
    TESTED_VERSIONS,
    MegatronVersionError,
    Release,
)
from .rng import RNG_STREAMS, SWAPPED, GpcRNGTracker, swap_back, swap_in
from .state import Installed, extra_groups, sources, values

__all__ = [
    "COLLECTION_FIELDS",
    "RNG_STREAMS",
    "SUPPORTED_RELEASES",
    "TESTED_VERSIONS",
    "GpcRNGTracker",
    "MegatronVersionError",
    "check_megatron_version",
    "install",
    "is_installed",
    "process_groups",
    "sources",
    "uninstall",
]


def check_megatron_version() -> Release:
    """Return what the installed megatron-core has (:class:`.release.Release`) after checking
    that the bridge knows all of it (releases 0.16 to 0.19).

    Raises:
        MegatronVersionError: globals, ``ProcessGroupCollection`` fields, options or getters the
            bridge does not know, or ones every known release has that are missing; the message
            names each.
    """
    return _release.check()


# The installed state: set by install(), cleared by uninstall().
_state: Installed | None = None
# Collections process_groups() made since launch, by the rank (a local world's ranks share this
# module) and the options that shape them.
_collections: dict[tuple[int, Options], tuple[Any, Installed]] = {}


def is_installed() -> bool:
    """Return True between :func:`install` and :func:`uninstall` (or ``gpc.destroy()``)."""
    return _state is not None


def _require_launched(what: str) -> Layout:
    try:
        gpc.rng_streams  # noqa: B018 - seeded: the launch is complete
        return gpc.layout
    except NotLaunchedError:
        raise NotLaunchedError(
            f"parallelctx.megatron.{what} needs a launched gpc: call parallelctx.launch_from_torch(config) "
            "(or launch, launch_from_env, spawn) first"
        ) from None


def _require_gtp(layout: Layout, release: Release) -> None:
    if not release.gtp and (layout.gtp_remat > 1 or layout.expert_gtp_remat > 1):
        raise MegatronVersionError(
            f"parallel.gtp_remat={layout.gtp_remat} / parallel.expert.gtp_remat={layout.expert_gtp_remat} "
            f"needs megatron-core 0.19 or later (generalized tensor parallelism); {release.version} is "
            "installed: upgrade megatron-core or set both sizes to 1"
        )


def _build(layout: Layout, opts: Options) -> tuple[Installed, dict[str, Any]]:
    """Make the groups gpc lacks for ``opts`` (with gpc's group maker, so that ``gpc.abort()``
    reaches them) and return them with every global's value."""
    state = Installed(gpc.group_maker())
    try:
        extra = extra_groups(layout, gpc.get_global_rank(), state.maker, opts)
        state.maker.settle("megatron")  # groups that connected as made: every rank done first
        return state, values(layout, extra, opts)
    except BaseException:
        state.maker.destroy(state.created)
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
    release = _release.check()
    # In a local world (parallelctx.run_local) the ranks are threads sharing these modules: each
    # rank keeps its own parallel_state globals, RNG tracker hooks and install state.
    keep_per_rank(ps, *sorted(release.globals))
    keep_per_rank(_mrandom, *SWAPPED)
    keep_per_rank(sys.modules[__name__], "_state")
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
    _require_gtp(layout, release)
    if virtual_pipeline_model_parallel_size is not None:
        options["virtual_pipeline_model_parallel_size"] = virtual_pipeline_model_parallel_size
    opts = parse_options(layout, options, release)
    state, found = _build(layout, opts)
    state.names = tuple(name for name in found if name in release.globals)
    for name in state.names:
        setattr(ps, name, found[name])
    state.random_before = swap_in()
    _state = state
    gpc.add_destroy_hook(
        _on_destroy, functools.partial(_reinstall, virtual_pipeline_model_parallel_size, options)
    )
    return state.calls


def _reinstall(virtual_pipeline_model_parallel_size: int | None, options: dict[str, Any]) -> None:
    """Install again with the same options, on the world ``gpc.reform()`` made."""
    install(virtual_pipeline_model_parallel_size, **options)


def process_groups(**options: Any) -> Any:
    """Return a Megatron ``ProcessGroupCollection`` built from gpc's groups, for Megatron-core
    models and DDP that take ``pg_collection=``: every field of the installed release holds the
    group (or None, or the list) that ``ProcessGroupCollection.use_mpu_process_groups()`` gives
    after that release's own ``initialize_model_parallel`` for gpc's sizes and order. Needs no
    :func:`install` and leaves ``parallel_state`` alone. Every rank must call it (the first call
    per launch makes the groups gpc lacks, as :func:`install` does); later calls return the same
    collection.

    ``options`` are :func:`install`'s; of those only ``hierarchical_context_parallel_sizes``
    shapes a field (``hcp``).

    Returns:
        A ``megatron.core.process_groups_config.ProcessGroupCollection``.

    Raises:
        NotLaunchedError: gpc is not launched.
        MegatronVersionError: the installed megatron-core has fields, globals, options or
            getters the bridge does not know (the message names them), or gpc's layout has a
            gtp_remat size > 1 and the release predates 0.19.
        TypeError, ValueError: as :func:`install` for ``options``.
    """
    layout = _require_launched("process_groups()")
    release = _release.check()
    _require_gtp(layout, release)
    opts = parse_options(layout, options, release)
    shape = Options(hierarchical_cp=opts.hierarchical_cp, gtp=opts.gtp, egtp=opts.egtp)
    key = (gpc.get_global_rank(), shape)
    if key not in _collections:
        state, found = _build(layout, shape)
        fields = {
            f: (None if g is None else found[g]) for f, g in COLLECTION_FIELDS.items() if f in release.fields
        }
        collection = ProcessGroupCollection(**fields)
        _collections[key] = (collection, state)
        gpc.add_destroy_hook(_on_destroy)
    return _collections[key][0]


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
    for name in state.names:
        setattr(ps, name, _release.pristine(name))
    swap_back(state.random_before)
    state.maker.destroy(state.created)
    return True


def _on_destroy() -> None:
    uninstall()
    rank = gpc.get_global_rank()
    for key in [k for k in _collections if k[0] == rank]:
        _, state = _collections.pop(key)
        state.maker.destroy(state.created)
