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
a ``ProcessGroupCollection`` without touching ``parallel_state`` (Megatron's road forward), for
gpc or for one module of ``parallel.modules`` (``process_groups(gpc.module("vision"))``). The four kinds of group parallelctx has no mode for (tensor × data with
and without context, tensor × context, the position-embedding group) are made here, only on
their members, with local synchronization; a group whose members equal a group gpc already has
is that group. It also puts Megatron's RNG tracker on gpc's per-mode streams
(:class:`GpcRNGTracker`), so ``tensor_parallel.get_cuda_rng_tracker().fork()`` and
``tensor_parallel.checkpoint`` run on the CPU as well as on CUDA.

For a job of several modules (docs/modules.md, megatron-core 0.19 on): :func:`hyper_comm_grid`
gives a module's ``HyperCommGrid`` on gpc's groups, :func:`multi_module_process_groups` the
``MultiModuleProcessGroupCollection`` Megatron's MIMO example builds, :func:`manual_seed_ranks`
a module's ranks for ``model_parallel_cuda_manual_seed``, and :func:`forbid_globals` makes every
``parallel_state`` getter raise while model code that should take its groups explicitly runs.

:func:`uninstall` (and ``gpc.destroy()``) puts every global back to its import-time value,
destroys the groups :func:`install` made and restores the RNG tracker that was there before.

The package by concern: :mod:`.release` (what the installed release has and whether the bridge
knows it), :mod:`.options` (``initialize_model_parallel``'s options), :mod:`.state` (every
global's value, the groups made here), :mod:`.rng` (the RNG tracker), :mod:`.grid` (the
``HyperCommGrid``), :mod:`.forbid` (the getters refused); this module holds the
entry points. The release is checked by :func:`install` and :func:`process_groups`, not at
import, so an unknown release gets an error naming what differs where it is used.

Not covered, refused or left as Megatron leaves them by default: see docs/migration.md.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

try:
    import megatron.core  # noqa: F401
    from megatron.core import parallel_state as ps
    from megatron.core import process_groups_config as _pgc
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import random as _mrandom
except ImportError as _exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "parallelctx.megatron needs megatron-core, which is not installed: "
        "`pip install 'parallelctx[megatron]'` (megatron-core 0.16 to 0.19; docs/migration.md)"
    ) from _exc

import torch.distributed as dist

from ..context import NotLaunchedError, ParallelContext, gpc
from ..planning.layout import Layout, LayoutError, ParallelMode
from ..runtime.groups import GroupMaker
from ..runtime.local import keep_per_rank
from . import release as _release
from .forbid import MegatronGlobalsError, forbid_globals, forbidden_getters
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
    "MIMO_FIELDS",
    "RNG_STREAMS",
    "SUPPORTED_RELEASES",
    "TESTED_VERSIONS",
    "GpcRNGTracker",
    "MegatronGlobalsError",
    "MegatronVersionError",
    "check_megatron_version",
    "forbid_globals",
    "forbidden_getters",
    "hyper_comm_grid",
    "hyper_comm_grids",
    "install",
    "is_installed",
    "manual_seed_ranks",
    "multi_module_process_groups",
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
# What process_groups(), hyper_comm_grid() and multi_module_process_groups() made since launch.
# Keys start with the module the context answers for (None without parallel.modules; plain gpc
# is its primary module) and the rank (a local world's ranks share this module), so two modules
# never share an entry. One Installed per context: the groups its collections and grid share.
_sources: dict[tuple[str | None, int], Installed] = {}
_collections: dict[tuple[str | None, int, Options], tuple[Any, Installed]] = {}
_grids: dict[tuple[str | None, int], Any] = {}
_multi: dict[tuple[int, Options], Any] = {}


def is_installed() -> bool:
    """Return True between :func:`install` and :func:`uninstall` (or ``gpc.destroy()``)."""
    return _state is not None


def _context(ctx: ParallelContext | None, what: str) -> ParallelContext:
    """``ctx``, or gpc for None."""
    if ctx is None:
        return gpc
    if not isinstance(ctx, ParallelContext):
        raise TypeError(
            f"parallelctx.megatron.{what} takes ctx=gpc or ctx=gpc.module(name), not {ctx!r} "
            f"({type(ctx).__name__})"
        )
    return ctx


def _require_launched(ctx: ParallelContext, what: str) -> Layout:
    try:
        ctx.rng_streams  # noqa: B018 - seeded: the launch is complete
        return ctx.layout
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


def _key(ctx: ParallelContext) -> tuple[str | None, int]:
    """The cache key of ``ctx``: the module it answers for, and the rank."""
    return ctx.launched.module, ctx.get_global_rank()


def _settle(ctx: ParallelContext, maker: GroupMaker) -> None:
    """After groups that connected as they were made, wait until every rank that made them is
    done: every rank of the job (the launch's store) when ``ctx`` spans it, else a barrier on the
    module's CPU group (only the module's ranks make a module's groups)."""
    if not maker.eager:
        return
    if ctx.layout.world_size == ctx.launched.world_size:
        maker.settle("megatron")
    else:
        dist.barrier(group=ctx.get_cpu_group(ParallelMode.GLOBAL))
        maker.eager = False


def _build(ctx: ParallelContext, layout: Layout, opts: Options, state: Installed) -> dict[str, Any]:
    """Find or make, with ``state``, the groups ``ctx`` lacks for ``opts`` (with gpc's group maker,
    so that ``gpc.abort()`` reaches them) and return every global's value; on failure destroy
    the groups made here."""
    before, known = len(state.maker.made), dict(state.known)
    try:
        extra = extra_groups(layout, ctx, state, opts)
        _settle(ctx, state.maker)
        return values(layout, extra, opts, ctx)
    except BaseException:
        made = [held.group for held in state.maker.made[before:]]
        del state.maker.made[before:]
        state.known = known
        state.maker.destroy(made)
        raise


def _source(ctx: ParallelContext) -> Installed:
    """The groups ``ctx``'s collections and grid draw on (made on first use); gpc.destroy()
    destroys what it made."""
    key = _key(ctx)
    if key not in _sources:
        _sources[key] = Installed(ctx.group_maker(), ctx)
        gpc.add_destroy_hook(_on_destroy)
    return _sources[key]


def install(virtual_pipeline_model_parallel_size: int | None = None, **options: Any) -> int:
    """Make ``megatron.core.parallel_state`` answer from gpc's groups, as Megatron's own
    ``initialize_model_parallel`` would for gpc's sizes and order, and put Megatron's RNG tracker
    on gpc's streams. Every rank must call it, after launch, before creating other groups.
    With ``parallel.modules`` it installs the rank's one module; a rank of several (colocated)
    modules is refused: ``parallel_state`` holds one layout, and the other module's model would
    read its groups without a word (pass each model ``pg_collection=process_groups(ctx)``).

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
        LayoutError: this rank belongs to several modules of ``parallel.modules``.
    """
    global _state
    layout = _require_launched(gpc, "install()")
    if len(gpc.modules) > 1:
        raise LayoutError(
            f"parallelctx.megatron.install() on global rank {gpc.get_global_rank()}, which runs modules "
            f"{', '.join(gpc.modules)}: parallel_state holds one layout, so one module's model would read the "
            "other's groups. Give each model its own groups instead: pg_collection=parallelctx.megatron."
            "process_groups(gpc.module(name)) (or multi_module_process_groups()); forbid_globals() finds the "
            "global reads left"
        )
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
    state = Installed(gpc.group_maker(), gpc)
    found = _build(gpc, layout, opts, state)
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


def process_groups(ctx: ParallelContext | None = None, **options: Any) -> Any:
    """Return a Megatron ``ProcessGroupCollection`` built from the groups of ``ctx`` (``gpc``
    when None, or ``gpc.module(name)`` for one module of ``parallel.modules``), for Megatron-core
    models and DDP that take ``pg_collection=``: every field of the installed release holds the
    group (or None, or the list) that ``ProcessGroupCollection.use_mpu_process_groups()`` gives
    after that release's own ``initialize_model_parallel`` for the context's sizes and order on
    its ranks (a module's: ``rank_offset`` = its first rank, ``intra_dist_opt`` its ranks). Needs
    no :func:`install` and leaves ``parallel_state`` alone. Every rank of the context must call
    it (the first call per launch makes the groups gpc lacks, on their members only); with
    several modules, every rank calls it for its modules in the same order. Later calls return
    the same collection; ``gpc`` and ``gpc.module(primary)`` give the same one.

    ``options`` are :func:`install`'s; of those only ``hierarchical_context_parallel_sizes``
    shapes a field (``hcp``).

    Returns:
        A ``megatron.core.process_groups_config.ProcessGroupCollection``.

    Raises:
        TypeError: ``ctx`` is not gpc or a module context; or as :func:`install` for ``options``.
        NotLaunchedError: gpc is not launched (or was destroyed since ``ctx`` was taken).
        MegatronVersionError: the installed megatron-core has fields, globals, options or
            getters the bridge does not know (the message names them), or the context's layout
            has a gtp_remat size > 1 and the release predates 0.19.
        ValueError: as :func:`install` for ``options``.
    """
    ctx = _context(ctx, "process_groups()")
    layout = _require_launched(ctx, "process_groups()")
    release = _release.check()
    _require_gtp(layout, release)
    opts = parse_options(layout, options, release)
    shape = Options(hierarchical_cp=opts.hierarchical_cp, gtp=opts.gtp, egtp=opts.egtp)
    key = (*_key(ctx), shape)
    if key not in _collections:
        state = _source(ctx)
        found = _build(ctx, layout, shape, state)
        fields = {
            f: (None if g is None else found[g]) for f, g in COLLECTION_FIELDS.items() if f in release.fields
        }
        _collections[key] = (ProcessGroupCollection(**fields), state)
    return _collections[key][0]


def hyper_comm_grid(ctx: ParallelContext | None = None) -> Any:
    """Return a ``megatron.core.hyper_comm_grid.HyperCommGrid`` (megatron-core 0.19 on) for
    ``ctx`` (``gpc`` when None, or ``gpc.module(name)``), shaped as Megatron's MIMO example builds
    a module's grid: dims ``tp, cp, dp, pp`` (``tp`` fastest), ``rank_offset`` the module's first
    rank, and the view ``"expert"`` (``expt_tp, ep, expt_dp, pp``, sharing ``pp``), already
    holding a group for every dims combination that example creates
    (:data:`.grid.TOPOLOGY_GROUPS`). ``get_pg`` answers with gpc's groups: a dims combination gpc
    has a group for is that group; the others (tensor × data, tensor × context, ...) are made
    once, with the context's group maker, only on their members (``gpc.abort()`` reaches them,
    ``gpc.destroy()`` destroys them), and shared with :func:`process_groups`. Every rank of the
    context calls it; later calls return the same grid (a new one after its ``destroy()``).
    ``RankRole.build`` and Megatron's ``BridgeCommunicator`` take it as they take Megatron's.

    Returns:
        A :class:`.grid.GpcCommGrid`, a subclass of ``HyperCommGrid``.

    Raises:
        TypeError: ``ctx`` is not gpc or a module context.
        NotLaunchedError: gpc is not launched.
        MegatronVersionError: megatron-core before 0.19 (no grid views), or one the bridge does
            not know.
        LayoutError: the layout has a gtp_remat axis, or an order the grid's dims cannot hold
            (the message names the module, the order and the dim).
    """
    ctx = _context(ctx, "hyper_comm_grid()")
    _require_launched(ctx, "hyper_comm_grid()")
    grid_class = _grid_class()
    key = _key(ctx)
    if key not in _grids:
        state = _source(ctx)
        module = ctx.launched.module
        where = "gpc" if module is None else f"gpc.module({module!r})"
        grid = grid_class(ctx.layout, where, ctx, state, on_destroy=functools.partial(_grids.pop, key, None))
        _settle(ctx, state.maker)
        _grids[key] = grid
    return _grids[key]


def _grid_class() -> Any:
    """:class:`.grid.GpcCommGrid`, after checking the release has grid views."""
    release = _release.check()
    from megatron.core.hyper_comm_grid import HyperCommGrid

    if not hasattr(HyperCommGrid, "register_view"):
        raise MegatronVersionError(
            f"parallelctx.megatron's HyperCommGrid needs megatron-core 0.19 or later (grid views, Megatron's "
            f"MIMO grids); {release.version} is installed: upgrade megatron-core, or use "
            "process_groups(gpc.module(name)) for a module's groups"
        )
    from .grid import GpcCommGrid

    return GpcCommGrid


def hyper_comm_grids() -> dict[str, Any]:
    """Return every module's ``HyperCommGrid`` (``parallel.modules``, config order), as Megatron's
    MIMO example holds them on every rank (its ``module_to_grid_map`` for ``MimoModel``,
    ``RankRole.build`` and ``BridgeCommunicator``): for this rank's modules
    :func:`hyper_comm_grid` ``(gpc.module(name))``; for the others a grid of the module's shape
    and ranks whose groups are None (as Megatron's grids are on ranks outside them), made
    without any ``new_group`` call. Every rank calls it; later calls return the same grids.

    Returns:
        ``{module name: HyperCommGrid}``.

    Raises:
        NotLaunchedError: gpc is not launched.
        LayoutError: no ``parallel.modules``, or a module the grid cannot hold
            (:func:`hyper_comm_grid`).
        MegatronVersionError: megatron-core before 0.19.
    """
    _require_launched(gpc, "hyper_comm_grids()")
    grid_class = _grid_class()
    plan = gpc.launched.plan
    if plan is None:
        raise LayoutError(
            "parallelctx.megatron.hyper_comm_grids() needs parallel.modules (docs/modules.md); this job has "
            "one layout: use parallelctx.megatron.hyper_comm_grid()"
        )
    rank = gpc.get_global_rank()
    grids = {}
    for name in plan.names:
        if name in gpc.modules:
            grids[name] = hyper_comm_grid(gpc.module(name))
            continue
        key = (name, rank)
        if key not in _grids:
            where = f"module {name!r}"
            _grids[key] = grid_class(
                plan.layouts[name], where, on_destroy=functools.partial(_grids.pop, key, None)
            )
        grids[name] = _grids[key]
    return grids


MIMO_FIELDS: tuple[str, ...] = (
    "tp",
    "cp",
    "pp",
    "dp",
    "dp_cp",
    "intra_dp_cp",
    "tp_cp",
    "tp_dp_cp",
    "mp",
    "intra_dist_opt",
    "ep",
    "expt_tp",
    "expt_dp",
    "intra_expt_dp",
    "tp_ep",
    "tp_ep_pp",
)
"""The ``ProcessGroupCollection`` fields Megatron's MIMO example (``pg_collection_from_grid`` in
``examples/mimo/training/topology.py``) sets for every module; it also sets ``tp_dp`` (tensor ×
data, no field of the class) and, on the language module only, ``embd`` and ``pos_embd``."""

_GTP_FIELDS = (
    "tp_ep_pp_with_egtp_remat",
    "dp_cp_gtp_remat",
    "gtp_remat",
    "expt_gtp_remat",
    "expt_dp_gtp_remat",
)


def multi_module_process_groups(**options: Any) -> Any:
    """Return the ``MultiModuleProcessGroupCollection`` (megatron-core 0.19 on) of this rank's
    modules (``parallel.modules``), as Megatron's MIMO example (``create_topology`` in
    ``examples/mimo/training/topology.py``) builds it: ``module_pgs`` holds, for each module this
    rank belongs to (config order), a ``ProcessGroupCollection`` with the fields of
    :data:`MIMO_FIELDS` and ``tp_dp``; ``embd`` and ``pos_embd`` on the language module only
    (None on the others and on stages that hold none); ``language_model_module_name`` the
    language module when this rank has it, else None. A module with a gtp_remat size > 1 (which
    the example's grids cannot hold) also gets the gtp fields, as Megatron 0.19's
    ``initialize_model_parallel(gtp_remat_size=...)`` sets them. The groups are
    :func:`process_groups`'s for each module (the same objects). Every rank calls it; later calls
    return the same collection.

    ``options``: :func:`process_groups`'s, for every module.

    Returns:
        A ``megatron.core.process_groups_config.MultiModuleProcessGroupCollection``.

    Raises:
        NotLaunchedError: gpc is not launched.
        LayoutError: the job has no ``parallel.modules`` (use :func:`process_groups`).
        MegatronVersionError: megatron-core before 0.19 (no ``MultiModuleProcessGroupCollection``).
        TypeError, ValueError: as :func:`process_groups` for ``options``.
    """
    _require_launched(gpc, "multi_module_process_groups()")
    release = _release.check()
    plan = gpc.launched.plan
    if plan is None:
        raise LayoutError(
            "parallelctx.megatron.multi_module_process_groups() needs parallel.modules (docs/modules.md); "
            "this job has one layout: use parallelctx.megatron.process_groups()"
        )
    multi = getattr(_pgc, "MultiModuleProcessGroupCollection", None)
    if multi is None:
        raise MegatronVersionError(
            "parallelctx.megatron.multi_module_process_groups() needs megatron-core 0.19 or later "
            f"(MultiModuleProcessGroupCollection); {release.version} is installed: upgrade megatron-core, "
            "or use process_groups(gpc.module(name)) per module"
        )
    rank = gpc.get_global_rank()
    layout = gpc.layout
    shape = parse_options(layout, dict(options), release)
    key = (rank, Options(hierarchical_cp=shape.hierarchical_cp))
    if key not in _multi:
        module_pgs = {}
        for name in gpc.modules:
            ctx = gpc.module(name)
            module_pgs[name] = _mimo_collection(ctx, process_groups(ctx, **options), name == plan.language)
        language = plan.language if plan.language in module_pgs else None
        _multi[key] = multi(module_pgs=module_pgs, language_model_module_name=language)
    return _multi[key]


def _mimo_collection(ctx: ParallelContext, full: Any, language: bool) -> Any:
    """One module's collection in the MIMO example's shape, from its :func:`process_groups`."""
    layout: Layout = ctx.layout
    pgc = ProcessGroupCollection()
    for name in MIMO_FIELDS:
        setattr(pgc, name, getattr(full, name))
    # tensor × data (× gtp_remat), the group the bridge made for _TENSOR_AND_DATA_PARALLEL_GROUP
    axes = ("tp", "gtp_remat", "dp")
    members = layout.axes_group_of("dense", axes, ctx.get_global_rank())

    def every() -> Any:
        yield from layout.axes_groups("dense", axes)

    pgc.tp_dp = _source(ctx).group(members, every, "megatron_tensor_data")
    pgc.embd = full.embd if language else None
    pgc.pos_embd = full.pos_embd if language else None
    if layout.gtp_remat > 1 or layout.expert_gtp_remat > 1:
        for name in _GTP_FIELDS:
            setattr(pgc, name, getattr(full, name))
    return pgc


# model_parallel_cuda_manual_seed's rank arguments and the mode each one is the rank in.
_SEED_RANKS: dict[str, ParallelMode] = {
    "tp_rank": ParallelMode.TENSOR,
    "ep_rank": ParallelMode.EXPERT,
    "etp_rank": ParallelMode.EXPERT_TENSOR,
}


def manual_seed_ranks(ctx: ParallelContext | None = None) -> dict[str, int]:
    """Return the explicit rank arguments of the installed release's
    ``tensor_parallel.model_parallel_cuda_manual_seed`` for ``ctx`` (``gpc`` when None, or
    ``gpc.module(name)``), so that it seeds without reading ``parallel_state``:
    ``model_parallel_cuda_manual_seed(seed, **manual_seed_ranks(gpc.module("vision")))``.
    ``tp_rank``, ``ep_rank`` and ``etp_rank`` are this rank's tensor, expert and expert-tensor
    ranks in that context (megatron-core 0.16 to 0.19 take these three; none takes a gtp rank).

    Returns:
        ``{"tp_rank": ..., "ep_rank": ..., "etp_rank": ...}``, the names the signature has.

    Raises:
        TypeError: ``ctx`` is not gpc or a module context.
        NotLaunchedError: gpc is not launched.
        MegatronVersionError: the installed signature has a ``*_rank`` argument the bridge does not
            know (the message names it).
    """
    ctx = _context(ctx, "manual_seed_ranks()")
    _require_launched(ctx, "manual_seed_ranks()")
    params = inspect.signature(_mrandom.model_parallel_cuda_manual_seed).parameters
    unknown = sorted(p for p in params if p.endswith("_rank") and p not in _SEED_RANKS)
    if unknown:
        raise MegatronVersionError(
            f"model_parallel_cuda_manual_seed of megatron-core {_release.detect().version} takes "
            f"{', '.join(unknown)}, which parallelctx.megatron.manual_seed_ranks() does not know; add them "
            "to _SEED_RANKS in parallelctx/megatron/__init__.py"
        )
    return {name: ctx.get_local_rank(mode) for name, mode in _SEED_RANKS.items() if name in params}


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
    for collection in [k for k in _collections if k[1] == rank]:
        del _collections[collection]
    for grid in [k for k in _grids if k[1] == rank]:
        del _grids[grid]
    for multi in [k for k in _multi if k[0] == rank]:
        del _multi[multi]
    for source in [k for k in _sources if k[1] == rank]:
        state = _sources.pop(source)
        state.maker.destroy(state.created)
