"""The value of every ``parallel_state`` global (what Megatron's getters read), from a context's
groups (``gpc`` or ``gpc.module(name)``) and the few groups gpc has no mode for, which are made
here (:class:`Installed`: found among gpc's groups by their members, else made once)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..context import ParallelContext
from ..planning.layout import Layout, ParallelMode
from ..runtime.groups import GroupMaker
from .options import Options
from .release import known_globals, pristine

__all__ = ["EXTRA_GROUPS", "Installed", "existing_groups", "extra_groups", "sources", "values"]

# The gloo groups create_gloo_process_groups=False leaves unset.
_GLOO_GLOBALS = (
    "_DATA_PARALLEL_GROUP_GLOO",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO",
    "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
)
_EXPERT_GLOO_GLOBALS = _GLOO_GLOBALS[3:]

# Groups gpc has no mode for: Megatron's rank-generator token -> grid, axes and group_desc.
# gtp_remat has size 1 before 0.19, where these are the 0.16 groups (tp-dp-cp, tp-dp, ...).
EXTRA_GROUPS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "tp-dp-cp": ("dense", ("tp", "gtp_remat", "dp", "cp"), "megatron_tensor_data_context"),
    "tp-dp": ("dense", ("tp", "gtp_remat", "dp"), "megatron_tensor_data"),
    "tp-cp": ("dense", ("tp", "cp"), "megatron_tensor_context"),
    "gtp-dp": ("dense", ("gtp_remat", "dp"), "megatron_gtp_data"),
    "gtp-dp-cp": ("dense", ("gtp_remat", "dp", "cp"), "megatron_gtp_data_context"),
    "egtp-dp": ("expert", ("gtp_remat", "dp"), "megatron_expert_gtp_data"),
    "tp-ep-egtp-pp": ("expert", ("tp", "ep", "gtp_remat", "pp"), "megatron_expert_model_gtp"),
}


@dataclass
class Installed:
    """What one :func:`parallelctx.megatron.install` (or the ``process_groups()``, grids and
    collections of one context) made: the groups (``maker.made``), the RNG tracker it replaced and
    the ``parallel_state`` globals it set. With ``ctx``, :meth:`group` finds a group by its members
    among the context's (and every module's of this rank) before it makes one."""

    maker: GroupMaker
    ctx: ParallelContext | None = None
    random_before: dict[str, Any] = field(default_factory=dict)
    names: tuple[str, ...] = ()  # the globals install() set
    known: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.ctx is not None and not self.known:
            self.known = existing_groups(self.ctx)

    def group(self, members: Sequence[int], every: Callable[[], Iterator[list[int]]], desc: str) -> Any:
        """This rank's group of ``members``: gpc's own, or one made here earlier, or a new one made
        with :attr:`maker` (locally synchronized: only the members call; where torch cannot, every
        group ``every()`` lists, on every rank).

        Raises:
            ValueError: no context was given.
            RuntimeError: from torch (a peer did not arrive within the timeout).
        """
        if self.ctx is None:
            raise ValueError("Installed.group() needs the context whose groups it draws on")
        key = tuple(members)
        if key not in self.known:
            self.known[key] = self.maker.make(members, every, self.ctx.get_global_rank(), desc)
        return self.known[key]

    @property
    def created(self) -> list[Any]:
        """The process groups made for this install."""
        return [held.group for held in self.maker.made]

    @property
    def calls(self) -> int:
        """The ``new_group`` calls made for this install."""
        return self.maker.calls


def existing_groups(ctx: ParallelContext) -> dict[tuple[int, ...], Any]:
    """gpc's groups of this rank by their members, ``{members: group}``: ``ctx``'s own first,
    then those of every other module this rank belongs to (``parallel.modules``), so that no
    group is made twice."""
    found: dict[tuple[int, ...], Any] = {}
    for mode in ParallelMode:
        if ctx.is_initialized(mode):
            found.setdefault(tuple(ctx.get_ranks_in_group(mode)), ctx.get_group(mode))
    for groups in ctx.launched.module_groups.values():
        for held in groups.values():
            found.setdefault(tuple(held.ranks), held.group)
    return found


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


def extra_groups(layout: Layout, ctx: ParallelContext, state: Installed, opts: Options) -> dict[str, Any]:
    """The groups gpc has no mode for, for ``ctx``'s layout, keyed by Megatron's token ``(members,
    group)``, plus ``"pos"``: the position-embedding group (this rank alone, on the first pipeline
    stage only; None elsewhere); with the options, ``"ag"`` (a separate data x context group),
    ``"hcp"`` (the hierarchical context groups) and ``"hybrid"`` (``{size: group}``). Each is
    found or made by ``state`` (:meth:`Installed.group`)."""
    rank = ctx.get_global_rank()
    maker = state.maker
    out: dict[str, Any] = {}
    kind = state.group

    def rows_of(grid: str, axes: tuple[str, ...]) -> Callable[[], Iterator[list[int]]]:
        def every() -> Iterator[list[int]]:
            yield from layout.axes_groups(grid, axes)

        return every

    for token, (grid, axes, desc) in EXTRA_GROUPS.items():
        members = layout.axes_group_of(grid, axes, rank)
        out[token] = (members, kind(members, rows_of(grid, axes), desc))
    # Position embedding: the first stage of each pipeline, alone. When gpc has no one-rank
    # group (no mode of size 1), every rank makes its own, so group counts stay equal across
    # stages (later locally synchronized groups are named by that count).
    alone = [rank]

    def firsts() -> Iterator[list[int]]:
        for pipe in layout.groups(ParallelMode.PIPELINE):
            yield [pipe[0]]

    group = kind(alone, firsts, "megatron_position_embedding")
    first = ctx.get_local_rank(ParallelMode.PIPELINE) == 0
    out["pos"] = (alone, group) if first else ([], None)
    if opts.all_gather:  # a communicator of its own, never an existing group

        def dp_cps() -> Iterator[list[int]]:
            yield from layout.groups(ParallelMode.DATA_CONTEXT)

        members = ctx.get_ranks_in_group(ParallelMode.DATA_CONTEXT)
        out["ag"] = maker.make(members, dp_cps, rank, "megatron_data_context_all_gather")
    if opts.hierarchical_cp:
        levels = []
        for level in range(len(opts.hierarchical_cp)):

            def every(level: int = level) -> Iterator[list[int]]:
                for cp in layout.groups(ParallelMode.CONTEXT):
                    yield from _hierarchical_rows(cp, opts.hierarchical_cp, level)

            rows = _hierarchical_rows(
                ctx.get_ranks_in_group(ParallelMode.CONTEXT), opts.hierarchical_cp, level
            )
            members = next(row for row in rows if rank in row)
            levels.append(kind(members, every, f"megatron_hierarchical_context_L{level}"))
        out["hcp"] = levels
    if opts.hybrid_cp:
        hybrid = {}
        for size, rows in _hybrid_rows(ctx.get_ranks_in_group(ParallelMode.DATA_CONTEXT)).items():

            def chunks(size: int = size) -> Iterator[list[int]]:
                for dp_cp in layout.groups(ParallelMode.DATA_CONTEXT):
                    yield from _hybrid_rows(dp_cp)[size]

            members = next(row for row in rows if rank in row)
            hybrid[size] = kind(members, chunks, f"megatron_hybrid_data_context_{size}")
        out["hybrid"] = hybrid
    return out


def values(layout: Layout, extra: dict[str, Any], opts: Options, ctx: ParallelContext) -> dict[str, Any]:
    """Every known parallel_state global's value for ``ctx``'s groups, as initialize_model_parallel
    sets it with ``opts`` (num_distributed_optimizer_instances=1, default embedding ranks); the
    caller keeps those of the installed release."""
    M = ParallelMode

    def group(mode: ParallelMode) -> Any:
        return ctx.get_group(mode)

    def cpu(mode: ParallelMode) -> Any:
        return ctx.get_cpu_group(mode)

    def ranks(mode: ParallelMode) -> list[int]:
        return ctx.get_ranks_in_group(mode)

    v: dict[str, Any] = {name: pristine(name) for name in known_globals()}
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
        # 0.19: generalized tensor parallelism (with sizes 1: groups of one rank, and the data
        # groups "with GTP" are the plain ones)
        _GTP_WEIGHT_REMAT_GROUP=group(M.GTP_REMAT),
        _GTP_WEIGHT_REMAT_GLOBAL_RANKS=ranks(M.GTP_REMAT),
        _EXPERT_GTP_WEIGHT_REMAT_GROUP=group(M.EXPERT_GTP_REMAT),
        _EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS=ranks(M.EXPERT_GTP_REMAT),
        _EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP=extra["tp-ep-egtp-pp"][1],
        _DATA_PARALLEL_GROUP_WITH_GTP_REMAT=extra["gtp-dp"][1],
        _DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT=extra["gtp-dp-cp"][1],
        _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT=extra["gtp-dp-cp"][1],
        _EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT=extra["egtp-dp"][1],
        _INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT=extra["egtp-dp"][1],
    )
    if ctx.is_initialized(M.EMBEDDING):
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
    # Megatron 0.19 makes no gloo groups when gtp_remat_size > 1 (dense and expert, the flag is
    # cleared before both) and no expert gloo groups when expert_gtp_remat_size > 1.
    if not opts.gloo or opts.gtp:
        for name in _GLOO_GLOBALS:
            v[name] = None
    if opts.egtp:
        for name in _EXPERT_GLOO_GLOBALS:
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


def sources() -> dict[str, str]:
    """Return, for every ``parallel_state`` global of megatron-core 0.16 to 0.19, where
    :func:`install` takes its value from (the table of docs/migration.md).

    Returns:
        ``{global name: description}``, in a fixed order.
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
        "_GTP_WEIGHT_REMAT_GROUP": M.GTP_REMAT,
        "_EXPERT_GTP_WEIGHT_REMAT_GROUP": M.EXPERT_GTP_REMAT,
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
        "_GTP_WEIGHT_REMAT_GLOBAL_RANKS": M.GTP_REMAT,
        "_EXPERT_GTP_WEIGHT_REMAT_GLOBAL_RANKS": M.EXPERT_GTP_REMAT,
    }
    made = {
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "made by install(): tensor × gtp_remat × data × context "
        "(`tp-gtp_remat-dp-cp`)",
        "_TENSOR_AND_DATA_PARALLEL_GROUP": "made by install(): tensor × gtp_remat × data (`tp-gtp_remat-dp`)",
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "0.19: expert tensor × expert × expert "
        "gtp_remat × pipeline (`gpc.get_group(M.EXPERT_MODEL)` when expert gtp_remat is 1)",
        "_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "0.19: gtp_remat × data, made by install() (`M.DATA` when gtp_remat is 1)",
        "_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "0.19: gtp_remat × data × context, made by install() "
        "(`M.DATA_CONTEXT` when gtp_remat is 1)",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT": "0.19: as `_DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT`",
        "_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "0.19: expert gtp_remat × expert data, made by install() "
        "(`M.EXPERT_DATA` when expert gtp_remat is 1)",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT": "0.19: as `_EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT`",
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
    for name in known_globals():
        if name in by_mode:
            extra = " (middle stages: None)" if by_mode[name] is M.EMBEDDING else ""
            out[name] = f"`gpc.get_group(M.{by_mode[name].name})`{extra}"
        elif name in gloo:
            out[name] = (
                f"`gpc.get_cpu_group(M.{gloo[name].name})` (None with `create_gloo_process_groups=False` or a gtp_remat size > 1)"
            )
        elif name in ranks:
            out[name] = f"`gpc.get_ranks_in_group(M.{ranks[name].name})`"
        elif name in made:
            out[name] = made[name]
        else:
            out[name] = "None, as Megatron leaves it"
    return out
