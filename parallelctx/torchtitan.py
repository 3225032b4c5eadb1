"""torchtitan interop: a real ``torchtitan`` ``ParallelDims`` whose meshes lie on gpc's groups.

``parallelctx.torchtitan.parallel_dims()`` returns a
``torchtitan.distributed.parallel_dims.ParallelDims`` (torchtitan 0.3.0, the optional extra
``torchtitan``) for gpc's layout: ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp`` and
``ep`` are gpc's sizes, and every mesh it hands out (``get_mesh``, ``get_optional_mesh``,
``world_mesh``, ``spmd_meshes``...) is a ``DeviceMesh`` built with ``DeviceMesh.from_group`` over
the process groups gpc made at launch, so building it creates no process group, where
torchtitan's own ``build_mesh`` makes a group for every dimension of every mesh it unflattens.

torchtitan's mesh names and the gpc mode behind each (``R`` replicate, ``S`` shard, ``C``
context, ``T`` tensor, ``E`` expert):

=================  =========================  ==========================
name               gpc mode                   ranks
=================  =========================  ==========================
``pp``             PIPELINE                   P
``batch``, ``dp``  DATA                       R·S
``loss``           DATA_CONTEXT               R·S·C
``dp_replicate``   DATA_REPLICATE             R
``dp_shard``       DATA_SHARD                 S
``fsdp``           DATA_SHARD_CONTEXT         S·C (``spmd_backend="partial_dtensor"``)
``cp``             CONTEXT                    C
``tp``             TENSOR                     T
``ep``             EXPERT                     E
``efsdp``          EXPERT_DATA_SHARD          S·C·T / E
=================  =========================  ==========================

torchtitan's layout is fixed: the world is ``arange(W).reshape(pp, dp_replicate, dp_shard, cp,
tp)`` and its expert mesh ``(pp, dp_replicate, efsdp, ep)``, with no expert-tensor axis. gpc's
default order ``"tp-cp-ep-dp-pp"`` with ``expert=dict(size=E, tensor=1)`` gives exactly that;
:func:`parallel_dims` refuses a layout that differs, naming the fix.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from .planning.layout import Layout, ParallelMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TorchtitanError", "check_layout", "parallel_dims"]

M = ParallelMode

SPMD_BACKENDS = ("spmd_types", "full_dtensor", "partial_dtensor")

INSTALL_HINT = "pip install 'parallelctx[torchtitan]' && pip install --no-deps torchtitan==0.3.0"
"""The shell command the missing-torchtitan error gives (tests/test_installs.py runs it verbatim)."""


class TorchtitanError(RuntimeError):
    """torchtitan is missing, or gpc's layout is one torchtitan's ParallelDims cannot describe."""


def _parallel_dims_class() -> type:
    """torchtitan's ParallelDims; raises TorchtitanError naming the extra when it is missing."""
    try:
        from torchtitan.distributed.parallel_dims import ParallelDims
    except ImportError as exc:
        raise TorchtitanError(
            f"parallelctx.torchtitan needs torchtitan ({exc}); install the extra, then torchtitan "
            f"without its own requirements (datasets, wandb...): `{INSTALL_HINT}` (docs/torchtitan.md)"
        ) from None
    return ParallelDims


@functools.cache
def _bridge_class() -> type:
    """A ParallelDims whose ``build_mesh`` builds on gpc's groups instead of making new ones."""
    base = _parallel_dims_class()

    class GpcParallelDims(base):  # type: ignore[valid-type, misc]
        """torchtitan's ParallelDims, meshes from gpc's process groups (parallelctx.torchtitan)."""

        def build_mesh(self) -> DeviceMesh:
            from .context import gpc

            return _build_meshes(self, getattr(self, "_parallelctx", None) or gpc)

    GpcParallelDims.__module__ = __name__
    return GpcParallelDims


def check_layout(layout: Layout) -> None:
    """Check that ``layout`` is one torchtitan's fixed mesh layout can describe.

    torchtitan puts the world as ``arange(W).reshape(pp, dp_replicate, dp_shard, cp, tp)`` and
    the expert grid as ``(pp, dp_replicate, efsdp, ep)`` (no expert-tensor axis).

    Raises:
        TorchtitanError: the order string, the expert-tensor size or a ``gtp_remat`` size above 1
            puts ranks elsewhere; the message names the value and the fix.
    """
    if layout.gtp_remat > 1 or layout.expert_gtp_remat > 1:
        name, size = (
            ("gtp_remat", layout.gtp_remat)
            if layout.gtp_remat > 1
            else ("expert.gtp_remat", layout.expert_gtp_remat)
        )
        raise TorchtitanError(
            f"parallel.{name}={size}: torchtitan's meshes have no gtp_remat axis "
            "(Megatron-core 0.19's generalized tensor parallelism); launch with gtp_remat=1 for torchtitan"
        )
    if layout.expert > 1 and layout.expert_tensor != 1:
        raise TorchtitanError(
            f"parallel.expert.tensor={layout.expert_tensor}: torchtitan 0.3.0's expert mesh "
            "(pp, dp_replicate, efsdp, ep) has no expert-tensor axis; launch with "
            f"expert=dict(size={layout.expert}, tensor=1)"
        )
    strides = layout.strides("dense")
    want = _strides((layout.pipeline, layout.replicate, layout.shard, layout.context, layout.tensor))
    got = tuple(strides[k] for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    if any(g != w for g, w, n in zip(got, want, _sizes(layout)) if n > 1):
        raise TorchtitanError(
            f"order={layout.order!r} does not lay ranks out as torchtitan does "
            "(pp, dp_replicate, dp_shard, cp, tp, slowest first); use the default order "
            "'tp-cp-ep-dp-pp'"
        )
    if layout.expert > 1:
        expert = layout.strides("expert")
        want = _strides((layout.pipeline, layout.replicate, layout.expert_shard, layout.expert))
        sizes = (layout.pipeline, layout.replicate, layout.expert_shard, layout.expert)
        got = tuple(expert[k] for k in ("pp", "dp_replicate", "dp_shard", "ep"))
        if any(g != w for g, w, n in zip(got, want, sizes) if n > 1):
            raise TorchtitanError(
                f"order={layout.order!r} puts the expert axis elsewhere than torchtitan's "
                "(pp, dp_replicate, efsdp, ep); put 'ep' before 'dp', e.g. 'tp-cp-ep-dp-pp'"
            )


def _sizes(layout: Layout) -> tuple[int, ...]:
    return (layout.pipeline, layout.replicate, layout.shard, layout.context, layout.tensor)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (slowest first)."""
    out, stride = [], 1
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


def parallel_dims(spmd_backend: str = "spmd_types", ctx: Any = None) -> Any:
    """Return a torchtitan ``ParallelDims`` for gpc's layout (``ctx``: a module's context,
    ``gpc.module(name)``, for that module's), its meshes built on its groups.

    The degrees are gpc's: ``dp_replicate`` / ``dp_shard`` (``parallel.data``), ``cp``, ``tp``,
    ``pp``, ``ep``. Every mesh torchtitan's ``build_mesh`` would make, with the same names, shape
    and ranks, is made here with ``DeviceMesh.from_group`` over ``gpc.get_group(mode)`` (table in
    the module docstring), so no real process group is created; flattened meshes (``loss``) are
    registered the way ``DeviceMesh._flatten`` registers them. One exception, as in torchtitan:
    with ``ep == 1`` and an expert-tensor size > 1, ``efsdp`` (``dp_shard·cp·tp`` ranks, kept by
    torchtitan only for its shape) lies on a group of torch's ``fake`` backend, which never
    communicates. The device type is
    ``gpc.device.type`` (``"cpu"`` on a machine without GPU, where torchtitan would assume CUDA).

    Args:
        spmd_backend: torchtitan's ``parallelism.spmd_backend``: ``"spmd_types"`` (its default),
            ``"full_dtensor"`` or ``"partial_dtensor"``.

    Returns:
        A ``ParallelDims`` (a subclass whose ``build_mesh`` is the one described), meshes built.

    Raises:
        NotLaunchedError: gpc is not launched.
        TorchtitanError: torchtitan is not installed, ``spmd_backend`` is unknown, or the layout
            is not one torchtitan can describe (see :func:`check_layout`).
    """
    from .context import gpc

    if spmd_backend not in SPMD_BACKENDS:
        raise TorchtitanError(f"spmd_backend={spmd_backend!r} must be one of {', '.join(SPMD_BACKENDS)}")
    ctx = gpc if ctx is None else ctx
    layout = ctx.layout
    check_layout(layout)
    dims = _bridge_class()(
        dp_replicate=layout.replicate,
        dp_shard=layout.shard,
        cp=layout.context,
        tp=layout.tensor,
        pp=layout.pipeline,
        ep=layout.expert,
        world_size=layout.world_size,
        spmd_backend=spmd_backend,
    )
    dims._parallelctx = ctx
    dims.build_mesh()
    return dims


def _mesh(
    ctx: Any,
    names: tuple[str, ...],
    modes: tuple[ParallelMode, ...],
    shape: tuple[int, ...],
    fake: tuple[str, ...] = (),
) -> Any:
    """A DeviceMesh over gpc's groups: ``names`` (slowest first), world ``arange(W).reshape(shape)``;
    the dims named in ``fake`` get a group of the ``fake`` backend instead (no communication)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    world = np.arange(ctx.layout.offset, ctx.layout.offset + ctx.layout.world_size).reshape(shape)
    where = np.argwhere(world == ctx.get_global_rank())[0]
    groups = []
    for dim, (name, mode) in enumerate(zip(names, modes)):
        index: list[Any] = list(where)
        index[dim] = slice(None)
        expected = world[tuple(index)].tolist()
        if name in fake:
            groups.append(_fake_group(expected, name))
            continue
        if ctx.get_ranks_in_group(mode) != expected:
            raise TorchtitanError(
                f"gpc's {mode.value} group {ctx.get_ranks_in_group(mode)} is not torchtitan's {name!r} "
                f"slice {expected} on rank {ctx.get_global_rank()}; check_layout should have refused "
                f"layout {ctx.layout.describe()}"
            )
        groups.append(ctx.get_group(mode))
    tensor = torch.as_tensor(world, dtype=torch.int)
    return DeviceMesh.from_group(groups, ctx.device.type, mesh=tensor, mesh_dim_names=names)


def _fake_group(members: list[int], name: str) -> Any:
    """A process group of torch's ``fake`` backend over ``members`` (each member makes it; no
    communication, as torchtitan does for a dimension it keeps only for its shape)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    return dist.new_group(members, backend="fake", use_local_synchronization=True, group_desc=f"titan_{name}")


def _build_meshes(dims: Any, ctx: Any) -> Any:
    """Fill ``dims`` (a ParallelDims) with meshes over ``ctx``'s groups; return the world mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    from .runtime.mesh import register_flat

    pp, rep, shard, cp, tp, ep = dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.ep
    batch, efsdp = rep * shard, shard * cp * tp // ep
    backend = dims.spmd_backend
    world = DeviceMesh.from_group(ctx.get_group(M.GLOBAL), ctx.device.type, mesh_dim_names=("world",))
    loading = _mesh(
        ctx, ("pp", "batch", "cp", "tp"), (M.PIPELINE, M.DATA, M.CONTEXT, M.TENSOR), (pp, batch, cp, tp)
    )
    loss = register_flat(loading, ("batch", "cp"), "loss_mesh", ctx.get_group(M.DATA_CONTEXT))
    full = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    full_modes = (M.PIPELINE, M.DATA_REPLICATE, M.DATA_SHARD, M.CONTEXT, M.TENSOR)
    if backend == "partial_dtensor":
        dense = _mesh(
            ctx,
            ("pp", "dp_replicate", "fsdp", "tp"),
            (M.PIPELINE, M.DATA_REPLICATE, M.DATA_SHARD_CONTEXT, M.TENSOR),
            (pp, rep, shard * cp, tp),
        )
    else:
        dense = _mesh(ctx, full, full_modes, (pp, rep, shard, cp, tp))
    # With ep == 1 torchtitan keeps efsdp (dp_shard·cp·tp ranks) only for its shape, on a fake
    # group; gpc's expert-data shard holds those ranks only when the expert-tensor size is 1.
    efsdp_ranks = shard * cp * tp
    fake = ("efsdp",) if ep == 1 and ctx.get_world_size(M.EXPERT_DATA_SHARD) != efsdp_ranks else ()
    sparse = _mesh(
        ctx,
        ("pp", "dp_replicate", "efsdp", "ep"),
        (M.PIPELINE, M.EXPERT_DATA_REPLICATE, M.EXPERT_DATA_SHARD, M.EXPERT),
        (pp, rep, efsdp, ep),
        fake,
    )
    meshes = {"dataloading": loading, "loss": loss, "dense": dense, "sparse": sparse}
    single = {
        "pp": loading["pp"],
        "batch": loading["batch"],
        "loss": loss,
        "dp_replicate": dense["dp_replicate"],
        "cp": loading["cp"],
        "tp": loading["tp"],
        "ep": sparse["ep"],
        "efsdp": sparse["efsdp"],
    }
    dense_axes = {
        "full_dtensor": ["dp_replicate", "dp_shard", "cp", "tp"],
        "spmd_types": ["dp", "cp", "tp"],
        "partial_dtensor": ["dp_replicate", "fsdp", "tp"],
    }[backend]
    if backend == "spmd_types":
        fwdbwd = _mesh(
            ctx, ("pp", "dp", "cp", "tp"), (M.PIPELINE, M.DATA, M.CONTEXT, M.TENSOR), (pp, batch, cp, tp)
        )
        meshes["spmd_dense_for_fwdbwd"] = fwdbwd["dp", "cp", "tp"]
        single["dp"] = meshes["spmd_dense_for_fwdbwd"]["dp"]
        if ep > 1:
            meshes["spmd_sparse_for_fwdbwd"] = sparse["dp_replicate", "efsdp", "ep"]
    if backend == "partial_dtensor":
        single["fsdp"] = dense["fsdp"]
    else:
        single["dp_shard"] = dense["dp_shard"]
    dims._world_mesh = world
    dims._global_meshes = meshes
    dims._single_axis_meshes = single
    dims._multi_axis_meshes = {}
    dims._validate_meshes()
    active = [dims.get_activated_mesh(dense_axes), dims.get_activated_mesh(["dp_replicate", "efsdp", "ep"])]
    dims._spmd_meshes = [m for m in active if m is not None]
    return world
