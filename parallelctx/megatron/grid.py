"""Megatron-core's ``HyperCommGrid`` (0.19 on) answering from gpc's groups, for one context.

Megatron's multi-module models (MIMO) take one grid per module: the dense dims ``tp``, ``cp``,
``dp``, ``pp`` (``tp`` varying fastest) on the module's ranks, from ``rank_offset`` on, and an
``"expert"`` view ``expt_tp``, ``ep``, ``expt_dp``, ``pp`` sharing ``pp`` with it (as
``examples/mimo/training/topology.py`` builds them at core_v0.19.0). :class:`GpcCommGrid` is that
grid for ``gpc`` or ``gpc.module(name)``: its ``create_pg`` never calls
``new_subgroups_by_enumeration`` (which every rank of the job must enter); it takes the group of
the members its own enumeration gives from gpc, or makes it once, locally synchronized, with the
context's group maker (``gpc.abort()`` reaches it, ``gpc.destroy()`` destroys it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from megatron.core.hyper_comm_grid import HyperCommGrid

from ..context import ParallelContext
from ..planning.layout import Layout, LayoutError
from .state import Installed

__all__ = ["DENSE_DIMS", "EXPERT_DIMS", "EXPERT_VIEW", "TOPOLOGY_GROUPS", "GpcCommGrid", "check_expressible"]

DENSE_DIMS: tuple[str, ...] = ("tp", "cp", "dp", "pp")
"""The base view's dims, fastest first (Megatron's MIMO example)."""

EXPERT_VIEW = "expert"
"""The name of the expert view (Megatron's MIMO example's)."""

EXPERT_DIMS: tuple[str, ...] = ("expt_tp", "ep", "expt_dp", "pp")
"""The expert view's dims, fastest first; ``pp`` is shared with the base view."""

_BASE = "base"  # HyperCommGrid's name for the base view

# Each dim of each view: the Layout grid and the order-string token it is.
_TOKENS: dict[str, tuple[str, dict[str, str]]] = {
    _BASE: ("dense", {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp"}),
    EXPERT_VIEW: ("expert", {"expt_tp": "tp", "ep": "ep", "expt_dp": "dp", "pp": "pp"}),
}

TOPOLOGY_GROUPS: dict[str, tuple[tuple[str, ...], ...]] = {
    _BASE: (
        ("tp",),
        ("cp",),
        ("pp",),
        ("dp",),
        ("dp", "cp"),
        ("tp", "cp"),
        ("tp", "pp"),
        ("tp", "dp"),
        ("tp", "dp", "cp"),
        ("tp", "cp", "dp", "pp"),
    ),
    EXPERT_VIEW: (("ep",), ("expt_tp",), ("expt_dp",), ("expt_tp", "ep"), ("expt_tp", "ep", "pp")),
}
"""The dims combinations each view holds a group of from the start: those Megatron's MIMO
example (``_build_grid`` in ``examples/mimo/training/topology.py``) creates."""


def check_expressible(where: str, layout: Layout) -> None:
    """Return None when Megatron's MIMO grid (dims ``tp, cp, dp, pp``, the expert view
    ``expt_tp, ep, expt_dp, pp``) can hold ``layout``'s groups: no ``gtp_remat`` axis, and an
    order in which those dims come in that order (others of size 1 anywhere), e.g. the default
    ``tp-cp-ep-dp-pp``. ``where`` names the context in messages (``"gpc.module('vision')"``).

    Raises:
        LayoutError: the layout has a gtp_remat size > 1, or its order gives a dim other groups
            than the grid; the message names the module, the size or order and the dim.
    """
    if layout.gtp_remat > 1 or layout.expert_gtp_remat > 1:
        raise LayoutError(
            f"{where} has gtp_remat={layout.gtp_remat} / expert gtp_remat={layout.expert_gtp_remat}: "
            "Megatron's HyperCommGrid for MIMO has the dims tp, cp, dp, pp and no gtp_remat axis "
            "(megatron-core 0.19 builds gtp groups only in parallel_state's RankGenerator); use "
            f"parallelctx.megatron.process_groups({where}) for this module, or set its gtp_remat sizes to 1"
        )
    dense = (layout.tensor, layout.context, layout.data, layout.pipeline)
    expert = (layout.axis_size("etp"), layout.expert, layout.expert_data, layout.pipeline)
    for view, dims, sizes in ((_BASE, DENSE_DIMS, dense), (EXPERT_VIEW, EXPERT_DIMS, expert)):
        grid, tokens = _TOKENS[view]
        stride = 1
        for dim, size in zip(dims, sizes):
            if size > 1 and layout.strides(grid)[tokens[dim]] != stride:
                fix = "tp-cp-ep-dp-pp" if "pp" in layout.order else "tp-cp-ep-dp"
                raise LayoutError(
                    f"{where}: order={layout.order!r} gives {dim} (size {size}) stride "
                    f"{layout.strides(grid)[tokens[dim]]} in the {grid} grid, where Megatron's MIMO "
                    f"HyperCommGrid ({', '.join(dims)}, the first fastest) has stride {stride}: the grid "
                    f"cannot hold these groups; give the module an order with its dims in that order, "
                    f"e.g. {fix!r}"
                )
            stride *= size


class GpcCommGrid(HyperCommGrid):
    """A ``megatron.core.hyper_comm_grid.HyperCommGrid`` for one module's layout (use
    :func:`parallelctx.megatron.hyper_comm_grid` or :func:`~parallelctx.megatron.hyper_comm_grids`),
    holding from the start a group for each dims combination of :data:`TOPOLOGY_GROUPS`.

    Everything Megatron reads of a grid (``shape``, ``dim_names``, ``rank_offset``, ``size``,
    ``get_rank_enum``, ``_gen_rank_enum``, ``is_current_rank_in_grid``, the views) is
    HyperCommGrid's own. What differs: :meth:`create_pg` takes gpc's group of the members its
    enumeration gives (or makes it once with the context's group maker, on the members only), so
    only the module's ranks call it; :meth:`destroy` forgets the groups and leaves them to
    ``gpc.destroy()``. On a rank outside the module (``ctx`` None) every group is None, as on
    Megatron's grids.
    """

    def __init__(
        self,
        layout: Layout,
        where: str,
        ctx: ParallelContext | None = None,
        state: Installed | None = None,
        on_destroy: Callable[[], None] | None = None,
    ):
        """Build the grid of ``layout`` (``where`` names it in messages) and take its groups from
        ``state`` for ``ctx`` (None on a rank outside the module: no groups).

        Raises:
            LayoutError: the layout does not fit the grid (:func:`check_expressible`).
            RuntimeError: from torch, when a peer does not arrive to make a group.
        """
        check_expressible(where, layout)
        self._ctx, self._state, self._on_destroy = ctx, state, on_destroy
        self._made: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._view_dims: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
        shape = [layout.tensor, layout.context, layout.data, layout.pipeline]
        super().__init__(shape, list(DENSE_DIMS), rank_offset=layout.offset, backend=None)
        self._view_dims[_BASE] = (DENSE_DIMS, ())
        expert = [layout.axis_size("etp"), layout.expert, layout.expert_data, layout.pipeline]
        self.register_view(EXPERT_VIEW, expert, list(EXPERT_DIMS), shared_dims=["pp"])
        for view, combos in TOPOLOGY_GROUPS.items():
            for dims in combos:
                self.create_pg(list(dims), view=None if view == _BASE else view)

    def register_view(
        self, name: str, shape: list[int], dim_names: list[str], shared_dims: list[str] | None = None
    ) -> None:
        """HyperCommGrid's ``register_view`` (another factorization of the same ranks); returns None.

        Raises:
            ValueError: as HyperCommGrid's (a name taken, sizes that do not fit, shared dims whose
                groups differ).
        """
        super().register_view(name, shape, dim_names, shared_dims)
        self._view_dims[name] = (tuple(dim_names), tuple(shared_dims or ()))

    def _key(self, dims: str | list[str], view: str | None) -> tuple[str, tuple[str, ...]]:
        name = _BASE if view is None else view
        if name not in self._view_dims:
            raise KeyError(f"View {name!r} is not registered. Registered views: {sorted(self._view_dims)}")
        wanted = [dims] if isinstance(dims, str) else list(dims)
        names, shared = self._view_dims[name]
        missing = [d for d in wanted if d not in names]
        if missing:
            raise ValueError(f"{missing[0]!r} is not in view {name!r} with dim_names {list(names)}")
        canonical = tuple(sorted(set(wanted)))
        if name != _BASE and all(d in shared for d in canonical):
            return _BASE, canonical  # a shared dim's group is the base view's
        return name, canonical

    def create_pg(self, dims: str | list[str], *, view: str | None = None, **kwargs: Any) -> Any:
        """This rank's group spanning ``dims`` (of ``view``, default the base view): gpc's group
        with those members when it has one, else one made now with the context's group maker,
        locally synchronized (every rank of the module calls, as every rank of the job calls
        Megatron's). ``group_desc=`` names a group made here.

        Returns:
            The process group (None on a rank outside the module).

        Raises:
            KeyError: that group is already in the grid (as Megatron's grid raises; use
                :meth:`get_pg`), or an unknown view.
            ValueError: a dim the view does not have.
            TypeError: an option other than ``group_desc`` (``timeout``, ``pg_options``: gpc's
                groups are made with gpc's).
        """
        key = self._key(dims, view)
        if key in self._made:
            raise KeyError(
                f"Process group {dims} of view {key[0]!r} is already in this grid (gpc's group, or one "
                "made once from gpc's group maker); get it with get_pg"
            )
        options = sorted(set(kwargs) - {"group_desc"})
        if options:
            raise TypeError(
                f"create_pg({', '.join(f'{o}=...' for o in options)}) is not supported on gpc's grid: its "
                "groups are gpc's, made with gpc's timeout and backend; drop the option (set dist.timeout "
                "in the config)"
            )
        if self._ctx is None or self._state is None:  # not a member: as Megatron's grid
            self._made[key] = None
            return None
        rows = [sorted(row) for row in self.get_rank_enum(dims, view=view)]
        rank = self._ctx.get_global_rank()
        mine = next(row for row in rows if rank in row)

        def every() -> Iterator[list[int]]:
            yield from rows

        desc = kwargs.get("group_desc") or f"megatron_grid_{key[0]}_{'_'.join(key[1])}"
        group = self._state.group(mine, every, desc)
        self._made[key] = group
        return group

    def get_pg(self, dims: str | list[str], *, view: str | None = None) -> Any:
        """This rank's group spanning ``dims`` of ``view`` (default: the base view).

        Returns:
            The process group (None on a rank outside the module).

        Raises:
            KeyError: no group of those dims yet (call :meth:`create_pg`), or an unknown view.
            ValueError: a dim the view does not have.
        """
        key = self._key(dims, view)
        if key not in self._made:
            raise KeyError(
                f"Process group {dims} of view {key[0]!r} hasn't been created. Call create_pg first."
            )
        return self._made[key]

    def destroy(self) -> None:
        """Forget this grid's groups (they are gpc's, or the bridge's, and ``gpc.destroy()``
        destroys them); a later :func:`parallelctx.megatron.hyper_comm_grid` gives a new grid on
        the same groups. Returns None."""
        self._made.clear()
        if self._on_destroy is not None:
            self._on_destroy()
