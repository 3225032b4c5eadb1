"""DeviceMesh interop: ``gpc.device_mesh`` for DTensor, FSDP2 and other DeviceMesh users.

The mesh is built from the process groups parallelctx already made, with
``DeviceMesh.from_group``, so building it (and slicing it, ``mesh["tp"]``) creates no process
group. Its dimensions are the *enabled* axes (size > 1), slowest-varying first as the order
string puts them. Every axis is a dimension, size 1 included:

* dense mesh (``gpc.device_mesh``): ``pp``, ``dp``, ``cp``, ``tp`` (PIPELINE, DATA, CONTEXT,
  TENSOR). With the default order ``"tp-cp-ep-dp-pp"`` the dims are ``("pp", "dp", "cp", "tp")``;
  with ``"tp-pp-dp"`` they are ``("cp", "dp", "pp", "tp")`` (axes the order string does not
  name come slowest; they have size 1).
* expert mesh (``gpc.expert_device_mesh``): ``pp``, ``edp``, ``ep``, ``etp``
  (PIPELINE, EXPERT_DATA, EXPERT, EXPERT_TENSOR), in the same order.

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

from .layout import Layout, LayoutError, ParallelMode

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_DIMS", "MeshError", "MeshPlan", "build_device_mesh", "mesh_plan"]

# Per grid: order-string token -> (mesh dimension name, the mode whose groups it uses).
MESH_DIMS: dict[str, dict[str, tuple[str, ParallelMode]]] = {
    "dense": {
        "pp": ("pp", ParallelMode.PIPELINE),
        "dp": ("dp", ParallelMode.DATA),
        "cp": ("cp", ParallelMode.CONTEXT),
        "tp": ("tp", ParallelMode.TENSOR),
    },
    "expert": {
        "pp": ("pp", ParallelMode.PIPELINE),
        "dp": ("edp", ParallelMode.EXPERT_DATA),
        "ep": ("ep", ParallelMode.EXPERT),
        "tp": ("etp", ParallelMode.EXPERT_TENSOR),
    },
}
"""Which axes each mesh has, the names of its dimensions and the modes behind them."""


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
    size 1 included, slowest-varying first. Rank ``r`` sits at the coordinates with
    ``r == sum(coord * stride)`` for the grid's strides.

    Returns:
        The :class:`MeshPlan`.

    Raises:
        LayoutError: ``grid`` is neither ``"dense"`` nor ``"expert"``.
    """
    if grid not in MESH_DIMS:
        raise LayoutError(f"grid={grid!r} must be 'dense' or 'expert'")
    strides = layout.strides(grid)
    sizes = {token: layout.size(mode) for token, (_, mode) in MESH_DIMS[grid].items()}
    dims = [t for t in reversed(layout.tokens) if t in MESH_DIMS[grid]]
    shape = tuple(sizes[t] for t in dims)
    ranks = np.zeros(shape, dtype=np.int64)
    for axis, token in enumerate(dims):
        view = [1] * len(dims)
        view[axis] = sizes[token]
        ranks = ranks + (np.arange(sizes[token], dtype=np.int64) * strides[token]).reshape(view)
    return MeshPlan(
        tuple(MESH_DIMS[grid][t][0] for t in dims),
        shape,
        tuple(MESH_DIMS[grid][t][1] for t in dims),
        ranks,
    )


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
        ``mesh[name].get_group()`` is ``groups[mode]`` for each dimension.

    Raises:
        LayoutError: ``grid`` is neither ``"dense"`` nor ``"expert"``.
        MeshError: a mode's process group is missing or its members differ from the mesh's
            slice through this rank (the groups were not made from this layout).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    plan = mesh_plan(layout, grid)
    dim_groups: list[Any] = []
    for dim, (name, mode) in enumerate(zip(plan.dim_names, plan.modes)):
        group = groups.get(mode)
        if group is None:
            raise MeshError(
                f"mesh dimension {name!r} ({mode.value}, size {plan.shape[dim]}) has no process "
                f"group on rank {rank}; launch parallelctx (which makes it) before gpc.device_mesh"
            )
        members = dist.get_process_group_ranks(group)
        expected = _through(plan, dim, rank)
        if members != expected:
            raise MeshError(
                f"the {mode.value} group of rank {rank} holds ranks {members}, but mesh dimension "
                f"{name!r} through rank {rank} is {expected}; the groups were not made from "
                f"layout {layout.describe()}: relaunch with parallelctx.launch"
            )
        dim_groups.append(group)
    return DeviceMesh.from_group(
        dim_groups,
        device_type,
        mesh=torch.as_tensor(plan.ranks, dtype=torch.int),
        mesh_dim_names=plan.dim_names,
    )
