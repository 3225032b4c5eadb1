"""DeviceMesh interop: ``gpc.device_mesh`` for DTensor, FSDP2 and other DeviceMesh users.

The mesh is built from the process groups parallelctx already made, with
``DeviceMesh.from_group``, so building it (and slicing it, ``mesh["tp"]``) creates no process
group. Its dimensions are the axes slowest-varying first as the order string puts them, the data
axis split into its HSDP parts (replicate outer, shard inner). Every axis is a dimension, size 1
included:

* dense mesh (``gpc.device_mesh``): ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``
  (PIPELINE, DATA_REPLICATE, DATA_SHARD, CONTEXT, TENSOR). With the default order
  ``"tp-cp-ep-dp-pp"`` the dims are ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``, torchtitan's
  dense mesh; with ``"tp-pp-dp"`` they are ``("cp", "dp_replicate", "dp_shard", "pp", "tp")`` (axes
  the order string does not name come slowest; they have size 1).
* expert mesh (``gpc.expert_device_mesh``): ``pp``, ``edp_replicate``, ``edp_shard``, ``ep``,
  ``etp`` (PIPELINE, EXPERT_DATA_REPLICATE, EXPERT_DATA_SHARD, EXPERT, EXPERT_TENSOR), in the same
  order.

Flattened dimensions (:data:`FLAT_DIMS`: ``mesh["dp"]``, ``mesh["dp_cp"]``, ...) are registered on
the root mesh over the mode's existing group too, the way ``DeviceMesh._flatten`` registers the
groups it makes, so ``fully_shard(model, mesh=gpc.device_mesh["dp"])`` keeps working and no
flattened dimension creates a group.

A dimension of size 1 lies on the one-rank group that every size-1 mode shares, so
``mesh["tp"]`` works with tensor size 1 too and model code needs no guard.

The mesh tensor holds global ranks; the ranks along each dimension are ascending, so a rank's
coordinate on a dimension equals its local rank in that mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..planning.layout import Layout, LayoutError, ParallelMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "FLAT_DIMS",
    "MESH_DIMS",
    "MeshError",
    "MeshPlan",
    "build_device_mesh",
    "mesh_plan",
    "register_flat",
]

# Per grid: order-string token -> its mesh dimensions, slowest first, each
# (mesh dimension name, the mode whose groups it uses, the key of its stride in Layout.strides).
MESH_DIMS: dict[str, dict[str, tuple[tuple[str, ParallelMode, str], ...]]] = {
    "dense": {
        "pp": (("pp", ParallelMode.PIPELINE, "pp"),),
        "dp": (
            ("dp_replicate", ParallelMode.DATA_REPLICATE, "dp_replicate"),
            ("dp_shard", ParallelMode.DATA_SHARD, "dp_shard"),
        ),
        "cp": (("cp", ParallelMode.CONTEXT, "cp"),),
        "tp": (("tp", ParallelMode.TENSOR, "tp"),),
    },
    "expert": {
        "pp": (("pp", ParallelMode.PIPELINE, "pp"),),
        "dp": (
            ("edp_replicate", ParallelMode.EXPERT_DATA_REPLICATE, "dp_replicate"),
            ("edp_shard", ParallelMode.EXPERT_DATA_SHARD, "dp_shard"),
        ),
        "ep": (("ep", ParallelMode.EXPERT, "ep"),),
        "tp": (("etp", ParallelMode.EXPERT_TENSOR, "tp"),),
    },
}
"""Which axes each mesh has, the names of its dimensions and the modes behind them."""

FLAT_DIMS: dict[str, dict[str, tuple[ParallelMode, tuple[str, ...]]]] = {
    "dense": {
        "dp": (ParallelMode.DATA, ("dp_replicate", "dp_shard")),
        "dp_cp": (ParallelMode.DATA_CONTEXT, ("dp_replicate", "dp_shard", "cp")),
        "dp_shard_cp": (ParallelMode.DATA_SHARD_CONTEXT, ("dp_shard", "cp")),
        # torchtitan's names for the same groups
        "batch": (ParallelMode.DATA, ("dp_replicate", "dp_shard")),
        "loss": (ParallelMode.DATA_CONTEXT, ("dp_replicate", "dp_shard", "cp")),
        "fsdp": (ParallelMode.DATA_SHARD_CONTEXT, ("dp_shard", "cp")),
    },
    "expert": {
        "edp": (ParallelMode.EXPERT_DATA, ("edp_replicate", "edp_shard")),
        "efsdp": (ParallelMode.EXPERT_DATA_SHARD, ("edp_shard",)),
    },
}
"""Flattened dimensions of each mesh: name -> (the mode whose group it is, the dims it merges).
Their ranks are the merged dims' ranks, so where the order string puts the dims apart (``cp``
not next to ``dp``) a flattened dimension still holds the mode's group."""


class MeshError(RuntimeError):
    """The process groups do not match the mesh the layout describes (a bug or a foreign group)."""


@dataclass(frozen=True)
class MeshPlan:
    """The shape of a device mesh: dimension names, sizes and modes, slowest first.

    ``ranks`` is the full mesh of global ranks, an int64 array of shape ``shape``.
    """

    dim_names: tuple[str, ...]
    shape: tuple[int, ...]
    modes: tuple[ParallelMode, ...]
    ranks: np.ndarray

    def dim_groups(self, dim: int) -> list[list[int]]:
        """Return the 1-d slices of the mesh along dimension ``dim``: its groups, each
        ascending, sorted by first member."""
        moved = np.moveaxis(self.ranks, dim, -1).reshape(-1, self.shape[dim])
        return sorted(moved.tolist())


def mesh_plan(layout: Layout, grid: str = "dense") -> MeshPlan:
    """Compute the mesh of ``layout``'s ``"dense"`` or ``"expert"`` grid; pure, no torch.

    The dimensions are every axis of the grid that the mesh covers (see :data:`MESH_DIMS`),
    size 1 included, slowest-varying first (the data axis as replicate, then shard). Rank ``r``
    sits at the coordinates with ``r == sum(coord * stride)`` for the grid's strides.

    Returns:
        The :class:`MeshPlan`.

    Raises:
        LayoutError: ``grid`` is neither ``"dense"`` nor ``"expert"``, or the grid's
            ``gtp_remat`` size is above 1 (the mesh has no ``gtp_remat`` dimension).
    """
    if grid not in MESH_DIMS:
        raise LayoutError(f"grid={grid!r} must be 'dense' or 'expert'")
    gtp = layout.gtp_remat if grid == "dense" else layout.expert_gtp_remat
    if gtp > 1:
        name = "gtp_remat" if grid == "dense" else "expert_gtp_remat"
        raise LayoutError(
            f"{name}={gtp}: the {grid} device mesh has no gtp_remat dimension, so it would hold "
            f"{layout.world_size // gtp} of the {layout.world_size} ranks; use gpc's groups "
            f"(gpc.get_group(ParallelMode.{name.upper()})) or Megatron's process_groups() instead"
        )
    strides = layout.strides(grid)
    dims = [d for t in reversed(layout.tokens) if t in MESH_DIMS[grid] for d in MESH_DIMS[grid][t]]
    shape = tuple(layout.size(mode) for _, mode, _ in dims)
    ranks = np.zeros(shape, dtype=np.int64)
    for axis, (_, _, key) in enumerate(dims):
        view = [1] * len(dims)
        view[axis] = shape[axis]
        ranks = ranks + (np.arange(shape[axis], dtype=np.int64) * strides[key]).reshape(view)
    ranks = ranks + layout.offset  # a module's layout lies on its own global ranks
    return MeshPlan(tuple(d[0] for d in dims), shape, tuple(d[1] for d in dims), ranks)


def _through(plan: MeshPlan, dim: int, rank: int) -> list[int]:
    """The ranks along dimension ``dim`` through ``rank``, in mesh order."""
    where = tuple(int(i) for i in np.argwhere(plan.ranks == rank)[0])
    index: list[int | slice] = list(where)
    index[dim] = slice(None)
    return plan.ranks[tuple(index)].tolist()


def build_device_mesh(
    layout: Layout,
    rank: int,
    groups: Mapping[ParallelMode, Any],
    device_type: str,
    grid: str = "dense",
) -> DeviceMesh:
    """Build a ``DeviceMesh`` of ``layout``'s ``grid`` over existing process groups (no group is
    created): ``groups`` maps each mode to this rank's group of it (``gpc``'s table).

    ``gpc.device_mesh`` and ``gpc.expert_device_mesh`` call this once each and keep the result.
    Dimension names and the size-1 rule are in the module docstring.

    Returns:
        A :class:`torch.distributed.device_mesh.DeviceMesh` on ``device_type`` whose
        ``mesh[name].get_group()`` is ``groups[mode]`` for each dimension and each flattened
        dimension of :data:`FLAT_DIMS`.

    Raises:
        LayoutError: ``grid`` is neither ``"dense"`` nor ``"expert"``, or the grid's
            ``gtp_remat`` size is above 1 (see :func:`mesh_plan`).
        MeshError: a mode's process group is missing or its members differ from the mesh's
            slice through this rank (the groups were not made from this layout).
    """
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    plan = mesh_plan(layout, grid)
    dim_groups: list[Any] = []
    for dim, (name, mode) in enumerate(zip(plan.dim_names, plan.modes)):
        group = _checked_group(layout, groups, mode, name, rank, _through(plan, dim, rank))
        dim_groups.append(group)
    mesh = DeviceMesh.from_group(
        dim_groups,
        device_type,
        mesh=torch.as_tensor(plan.ranks, dtype=torch.int),
        mesh_dim_names=plan.dim_names,
    )
    for flat, (mode, merged) in FLAT_DIMS[grid].items():
        in_order = tuple(sorted(merged, key=plan.dim_names.index))  # slicing wants mesh order
        axes = [plan.dim_names.index(d) for d in in_order]
        expected = sorted(_through_many(plan, axes, rank))
        group = _checked_group(layout, groups, mode, flat, rank, expected)
        register_flat(mesh, in_order, flat, group)
    return mesh


def _checked_group(
    layout: Layout,
    groups: Mapping[ParallelMode, Any],
    mode: ParallelMode,
    name: str,
    rank: int,
    expected: list[int],
) -> Any:
    """``groups[mode]`` after checking its members are ``expected``; raises MeshError."""
    import torch.distributed as dist

    group = groups.get(mode)
    if group is None:
        raise MeshError(
            f"mesh dimension {name!r} ({mode.value}, size {len(expected)}) has no process "
            f"group on rank {rank}; launch parallelctx (which makes it) before gpc.device_mesh"
        )
    members = dist.get_process_group_ranks(group)
    if members != expected:
        raise MeshError(
            f"the {mode.value} group of rank {rank} holds ranks {members}, but mesh dimension "
            f"{name!r} through rank {rank} is {expected}; the groups were not made from "
            f"layout {layout.describe()}: relaunch with parallelctx.launch"
        )
    return group


def _through_many(plan: MeshPlan, dims: list[int], rank: int) -> list[int]:
    """The ranks of the sub-mesh spanning ``dims`` through ``rank``."""
    where = tuple(int(i) for i in np.argwhere(plan.ranks == rank)[0])
    index: list[int | slice] = list(where)
    for dim in dims:
        index[dim] = slice(None)
    return plan.ranks[tuple(index)].ravel().tolist()


def register_flat(mesh: DeviceMesh, dims: tuple[str, ...], name: str, group: Any) -> DeviceMesh:
    """Register ``group`` as the flattened dimension ``name`` of ``mesh``'s dims ``dims`` and
    return the flattened 1-d mesh; no process group is created.

    It does what ``mesh[dims]._flatten(name)`` does, except that the group is given instead of
    made: the flattened mesh is kept in the root mesh's flatten mapping, so ``mesh[name]`` and
    ``mesh[name].get_group()`` find it. The caller checks that ``group`` holds the ranks of
    ``mesh[dims]`` through this rank (:func:`build_device_mesh` does). Relies on torch's private
    ``DeviceMesh`` fields (``_layout``, ``_flatten_mapping``, ``_pg_registry``), the same ones
    ``_flatten`` sets; tests/test_mesh.py checks them on the pinned torch.

    Raises:
        KeyError: ``dims`` names no dimensions of ``mesh``.
        ValueError: ``name`` is already one of ``mesh``'s dimension names.
    """
    from torch.distributed.device_mesh import DeviceMesh, _MeshLayout

    root = mesh._get_root_mesh()
    if name in (root.mesh_dim_names or ()):
        raise ValueError(f"cannot flatten into {name!r}: the mesh already has a dimension of that name")
    sub = root[dims] if tuple(dims) != tuple(root.mesh_dim_names or ()) else root
    flat = DeviceMesh(
        root.device_type,
        _layout=_MeshLayout([sub._layout.collapse()]),
        _rank_map=root._rank_map,
        mesh_dim_names=(name,),
        _root_mesh=root,
        _init_backend=False,
    )
    flat._dim_group_names = [group.group_name]
    root._pg_registry[group.group_name] = group
    root._flatten_mapping[name] = flat
    return flat
