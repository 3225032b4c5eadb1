"""Pure rank layout maths: which global rank sits in which group of each parallel mode.

Nothing here imports torch. A :class:`Layout` is computed from the world size, the sizes of
the parallel axes and an *order string* that names the axes from fastest-varying (neighbouring
ranks) to slowest, as Megatron-LM does. For the default order ``"tp-cp-ep-dp-pp"`` the dense
world is ``arange(W).reshape(P, D, C, T)``.

Two grids share the world:

* the **dense grid** with axes ``tp`` (tensor), ``cp`` (context), ``dp`` (data) and ``pp``
  (pipeline); ``ep`` has size 1 in it;
* the **expert grid** with axes ``tp`` standing for the expert-tensor size, ``ep`` (expert),
  ``dp`` standing for the expert-data size and the same ``pp``; ``cp`` has size 1 in it.

Both grids use the same order string, and their pipeline groups must coincide (Megatron-core's
rule), so a pipeline stage holds the same ranks in both.

The data axis of each grid is split in two for HSDP (torchtitan's ``dp_replicate × dp_shard``):
the **shard** part is its inner (faster-varying) part and the **replicate** part its outer one,
so with ``replicate=R`` the ``dp`` token stands for the sub-axes ``dps`` (size ``D/R``, stride of
``dp``) and ``dpr`` (size ``R``) next to each other. In the expert grid the same ``R`` splits the
expert-data size: expert shard ``ED/R``, expert replicate ``R``. With ``R = 1`` (the default)
nothing changes. The default order then equals torchtitan's mesh
``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` read slowest first.

Each grid also has a ``gtp_remat`` axis, Megatron-core 0.19's generalized tensor parallelism
(weights sharded and rematerialized across ``gtp_remat`` ranks that carry distinct data):
``parallel.gtp_remat`` in the dense grid, ``parallel.expert.gtp_remat`` in the expert grid, so
``world = tensor * gtp_remat * context * data * pipeline``. When the order string does not name
``gtp_remat``, it sits right after ``tp`` in the dense grid and right after ``ep`` in the expert
grid (after ``tp`` when there is no ``ep``), as Megatron's ``initialize_model_parallel`` places it.
With both sizes 1 (the default) nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any

import numpy as np

from ._fastenum import FastEnumType, speed_up
from .limits import MAX_WORLD_SIZE

__all__ = [
    "AXES",
    "DEFAULT_ORDER",
    "HSDP_MODES",
    "MAX_WORLD_SIZE",
    "MODE_ALIASES",
    "Layout",
    "LayoutError",
    "ParallelMode",
    "plan",
]

AXES: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp", "gtp_remat")
"""Every token an order string may name."""

DEFAULT_ORDER = "tp-cp-ep-dp-pp"

_AXIS_NAMES = {
    "tp": "tensor",
    "cp": "context",
    "ep": "expert",
    "dp": "data",
    "pp": "pipeline",
    "gtp_remat": "gtp_remat",
}


MODE_ALIASES: dict[str, str] = {
    "tp": "tensor",
    "pp": "pipeline",
    "dp": "data",
    "cp": "context",
    "ep": "expert",
    "etp": "expert_tensor",
    "edp": "expert_data",
    "world": "global",
    # the HSDP parts, by their device-mesh and torchtitan names
    "dp_shard": "data_shard",
    "dp_replicate": "data_replicate",
    "dp_shard_cp": "data_shard_context",
    "fsdp": "data_shard_context",
    "dp_cp": "data_context",
    "edp_shard": "expert_data_shard",
    "efsdp": "expert_data_shard",
    "edp_replicate": "expert_data_replicate",
    # generalized tensor parallelism (megatron-core 0.19), by Megatron's names
    "gtp": "gtp_remat",
    "egtp_remat": "expert_gtp_remat",
    "expt_gtp_remat": "expert_gtp_remat",
}
"""Other names of modes, accepted wherever a mode is (in any case): the order string's tokens,
the device meshes' dim names (``dp_shard``, ``edp_replicate``, ...), torchtitan's ``fsdp`` and
``efsdp``, and ``world`` (the name of ``gpc.world``)."""


class LayoutError(ValueError):
    """A layout that cannot be built: bad sizes, a bad order string or an unknown mode."""


class _ParallelModeType(FastEnumType):
    """The metaclass of :class:`ParallelMode` alone (see :mod:`parallelctx._fastenum`)."""


class ParallelMode(str, Enum, metaclass=_ParallelModeType):
    """The parallel modes. A plain string such as ``"tensor"`` is accepted wherever a mode is."""

    GLOBAL = "global"
    TENSOR = "tensor"
    PIPELINE = "pipeline"
    DATA = "data"
    CONTEXT = "context"
    MODEL = "model"
    DATA_CONTEXT = "data_context"
    EMBEDDING = "embedding"
    EXPERT = "expert"
    EXPERT_TENSOR = "expert_tensor"
    EXPERT_DATA = "expert_data"
    EXPERT_TENSOR_AND_EXPERT = "expert_tensor_and_expert"
    EXPERT_MODEL = "expert_model"
    DATA_SHARD = "data_shard"
    DATA_REPLICATE = "data_replicate"
    DATA_SHARD_CONTEXT = "data_shard_context"
    EXPERT_DATA_SHARD = "expert_data_shard"
    EXPERT_DATA_REPLICATE = "expert_data_replicate"
    GTP_REMAT = "gtp_remat"
    EXPERT_GTP_REMAT = "expert_gtp_remat"

    # Hash and print like the plain string, so dict lookups by "tensor" find ParallelMode.TENSOR.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> ParallelMode | None:
        # Any case of a name ("TENSOR", "Data"), or an alias of MODE_ALIASES ("tp", "PP").
        if isinstance(value, str):
            key = value.lower()
            return cls._value2member_map_.get(key) or cls._value2member_map_.get(MODE_ALIASES.get(key, ""))  # type: ignore[return-value]
        return None

    @classmethod
    def parse(cls, mode: ParallelMode | str) -> ParallelMode:
        """Return the :class:`ParallelMode` for ``mode``: a member, its name in any case
        (``"tensor"``, ``"TENSOR"``), or an alias of :data:`MODE_ALIASES` in any case (the
        order string's tokens ``"tp"``, ``"pp"``, ``"dp"``, ``"cp"``, ``"ep"``, the expert
        mesh's ``"etp"``, ``"edp"``, and ``"world"``).

        Raises:
            LayoutError: ``mode`` names no mode; the message lists the valid names and aliases.
        """
        if mode.__class__ is cls:  # a member already: the common case, without the enum call
            return mode
        try:
            return cls(mode)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            aliases = ", ".join(f"{alias}={name}" for alias, name in MODE_ALIASES.items())
            raise LayoutError(
                f"unknown parallel mode {mode!r}; valid modes: {valid} (any case); aliases: {aliases}"
            ) from None


HSDP_MODES: tuple[ParallelMode, ...] = (
    ParallelMode.DATA_SHARD,
    ParallelMode.DATA_REPLICATE,
    ParallelMode.DATA_SHARD_CONTEXT,
    ParallelMode.EXPERT_DATA_SHARD,
    ParallelMode.EXPERT_DATA_REPLICATE,
)
"""The modes of the HSDP split of the data axes (``parallel.data=dict(replicate=R)``)."""

GTP_MODES: tuple[ParallelMode, ...] = (ParallelMode.GTP_REMAT, ParallelMode.EXPERT_GTP_REMAT)
"""The modes of generalized tensor parallelism (``parallel.gtp_remat``, ``parallel.expert.gtp_remat``)."""

# Member lookups (ParallelMode.TENSOR) at plain-attribute speed on Python 3.11.
speed_up(ParallelMode)


# Which grid and which axes each lattice mode spans. EMBEDDING is not a lattice: handled apart.
_DENSE, _EXPERT = "dense", "expert"
# Grid axes: the order-string tokens, with "dp" split into its shard ("dps", inner) and replicate
# ("dpr", outer) parts.
_DP = ("dps", "dpr")
_MODE_AXES: dict[ParallelMode, tuple[str, tuple[str, ...]]] = {
    ParallelMode.GLOBAL: (_DENSE, ("tp", "cp", *_DP, "pp", "gtp_remat")),
    ParallelMode.TENSOR: (_DENSE, ("tp",)),
    ParallelMode.PIPELINE: (_DENSE, ("pp",)),
    ParallelMode.DATA: (_DENSE, _DP),
    ParallelMode.CONTEXT: (_DENSE, ("cp",)),
    ParallelMode.MODEL: (_DENSE, ("tp", "gtp_remat", "pp")),
    ParallelMode.DATA_CONTEXT: (_DENSE, (*_DP, "cp")),
    ParallelMode.EXPERT: (_EXPERT, ("ep",)),
    ParallelMode.EXPERT_TENSOR: (_EXPERT, ("tp",)),
    ParallelMode.EXPERT_DATA: (_EXPERT, _DP),
    ParallelMode.EXPERT_TENSOR_AND_EXPERT: (_EXPERT, ("tp", "ep")),
    ParallelMode.EXPERT_MODEL: (_EXPERT, ("tp", "ep", "pp")),
    ParallelMode.DATA_SHARD: (_DENSE, ("dps",)),
    ParallelMode.DATA_REPLICATE: (_DENSE, ("dpr",)),
    ParallelMode.DATA_SHARD_CONTEXT: (_DENSE, ("dps", "cp")),
    ParallelMode.EXPERT_DATA_SHARD: (_EXPERT, ("dps",)),
    ParallelMode.EXPERT_DATA_REPLICATE: (_EXPERT, ("dpr",)),
    ParallelMode.GTP_REMAT: (_DENSE, ("gtp_remat",)),
    ParallelMode.EXPERT_GTP_REMAT: (_EXPERT, ("gtp_remat",)),
}


_uncovered = set(ParallelMode) - set(_MODE_AXES) - {ParallelMode.EMBEDDING}
if _uncovered:  # caught at import, so a new mode cannot ship without its axes
    raise ImportError(
        f"parallelctx.layout: no axes for modes {sorted(map(str, _uncovered))}; add them to _MODE_AXES"
    )


def parse_order(order: str) -> tuple[str, ...]:
    """Return the tokens of an order string, fastest-varying first.

    Raises:
        LayoutError: an unknown or repeated token, or an empty string.
    """
    if not isinstance(order, str) or not order.strip():
        raise LayoutError(f"order={order!r} must be a string such as {DEFAULT_ORDER!r}")
    tokens = tuple(t.strip().lower() for t in order.split("-"))
    for token in tokens:
        if token not in AXES:
            raise LayoutError(f"order={order!r} has unknown token {token!r}; valid tokens: {', '.join(AXES)}")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise LayoutError(f"order={order!r} repeats {', '.join(repeated)}; name each axis once")
    return tokens


def place_gtp_remat(tokens: tuple[str, ...], after: str) -> tuple[str, ...]:
    """Return ``tokens`` with ``gtp_remat`` placed as Megatron-core 0.19 places it: unchanged when
    named, else right after ``after`` (``"tp"`` for the dense grid, ``"ep"`` for the expert grid),
    after ``tp`` when ``after`` is not named, first when neither is."""
    if "gtp_remat" in tokens:
        return tokens
    anchor = after if after in tokens else "tp"
    pos = tokens.index(anchor) + 1 if anchor in tokens else 0
    return (*tokens[:pos], "gtp_remat", *tokens[pos:])


@dataclass(frozen=True)
class _Grid:
    """One n-d grid over the world: axis sizes and strides, in order-string order."""

    tokens: tuple[str, ...]
    sizes: tuple[int, ...]

    @cached_property
    def strides(self) -> tuple[int, ...]:
        out, stride = [], 1
        for size in self.sizes:
            out.append(stride)
            stride *= size
        return tuple(out)

    def size_of(self, token: str) -> int:
        return self.sizes[self.tokens.index(token)]

    def coords(self, rank: int) -> dict[str, int]:
        return {t: (rank // s) % n for t, s, n in zip(self.tokens, self.strides, self.sizes)}

    def signature(self, axes: Iterable[str]) -> tuple[tuple[int, int], ...]:
        """(stride, size) of the spanned axes of size > 1, merging axes that are contiguous.

        Two lattice modes partition the world identically exactly when their signatures match.
        """
        spans = sorted(
            (self.strides[i], self.sizes[i])
            for i, t in enumerate(self.tokens)
            if t in axes and self.sizes[i] > 1
        )
        merged: list[tuple[int, int]] = []
        for stride, size in spans:
            if merged and merged[-1][0] * merged[-1][1] == stride:
                merged[-1] = (merged[-1][0], merged[-1][1] * size)
            else:
                merged.append((stride, size))
        return tuple(merged)

    def group_array(self, axes: Iterable[str]) -> np.ndarray:
        """Every group spanning ``axes``: an array (n_groups, group_size), rows ascending."""
        axes = set(axes)
        world = int(np.prod(self.sizes))
        # C order wants the slowest axis first.
        cube = np.arange(world, dtype=np.int64).reshape(tuple(reversed(self.sizes)))
        n = len(self.tokens)
        slow_first = [self.tokens[n - 1 - i] for i in range(n)]
        outer = [i for i, t in enumerate(slow_first) if t not in axes]
        inner = [i for i, t in enumerate(slow_first) if t in axes]
        group_size = int(np.prod([self.size_of(slow_first[i]) for i in inner], dtype=np.int64))
        return cube.transpose(outer + inner).reshape(-1, group_size)

    def members(self, axes: Iterable[str], rank: int, offset: int = 0) -> list[int]:
        """The ascending members of the group spanning ``axes`` that holds ``rank``, each plus
        ``offset``: listed in Python for a small group (numpy's fixed cost per call is larger
        there), with numpy for a large one; plain ints either way."""
        rank, offset = int(rank), int(offset)
        spanned = [
            (stride, size)
            for token, stride, size in zip(self.tokens, self.strides, self.sizes)
            if token in axes and size > 1
        ]
        base = rank + offset - sum(((rank // stride) % size) * stride for stride, size in spanned)
        # Strides grow along the order, so each new axis goes outermost and the result stays
        # ascending without a sort.
        if math.prod(size for _, size in spanned) > _PYTHON_MEMBERS:
            array = np.zeros(1, dtype=np.int64)
            for stride, size in spanned:
                array = (np.arange(size, dtype=np.int64)[:, None] * stride + array[None, :]).ravel()
            return (array + base).tolist()
        members = [0]
        for stride, size in spanned:
            members = [k * stride + m for k in range(size) for m in members]
        return [m + base for m in members]


# Up to this many members a group is listed in Python (:meth:`_Grid.members`), beyond with numpy.
_PYTHON_MEMBERS = 256


@dataclass(frozen=True)
class Layout:
    """The rank layout of one world: sizes, order string, and the groups of every mode.

    ``Layout(...)`` and :func:`plan` take the same arguments and both validate them (the rules
    are in :func:`plan`); ``expert_tensor=None`` means the tensor size, and the attribute always
    holds the resolved int. ``replicate`` is the outer (HSDP replicate) part of the data axis;
    :attr:`shard` the inner part. Members of every group are listed in ascending global rank; a rank's
    local rank in a mode is its index in that list.

    ``offset`` places the layout on the global ranks ``offset .. offset + world_size - 1`` (one
    module of a job that runs several, :mod:`parallelctx.planning.modules`): every group, rank
    and coordinate is then in global ranks, and ``world_size`` is the layout's own rank count.

    Raises:
        LayoutError: sizes or an order string that cannot make a layout (see :func:`plan`), or
            an offset that is negative or puts the last rank past the largest world.
    """

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None
    order: str = DEFAULT_ORDER
    replicate: int = 1
    gtp_remat: int = 1
    expert_gtp_remat: int = 1
    offset: int = 0
    _etp: int = field(init=False, repr=False, compare=False)
    _tokens: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _dense: _Grid = field(init=False, repr=False, compare=False)
    _expert: _Grid = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = _validated_sizes(
            self.world_size,
            self.tensor,
            self.pipeline,
            self.context,
            self.expert,
            self.expert_tensor,
            self.replicate,
            self.gtp_remat,
            self.expert_gtp_remat,
        )
        for name, value in zip(
            (
                "world_size",
                "tensor",
                "pipeline",
                "context",
                "expert",
                "expert_tensor",
                "replicate",
                "gtp_remat",
                "expert_gtp_remat",
            ),
            sizes,
        ):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_etp", sizes[5])
        _check_offset(self.offset, self.world_size)
        object.__setattr__(self, "offset", int(self.offset))
        _check_axes_named(self)
        named = parse_order(self.order)
        object.__setattr__(self, "_tokens", (*named, *(t for t in AXES if t not in named)))

        def grid_axes(after: str) -> tuple[str, ...]:
            # Megatron places gtp_remat in the order as given, then appends the axes not named.
            placed = list(place_gtp_remat(named, after))
            placed += [t for t in AXES if t not in placed]
            # The grids split "dp" into its shard (inner) and replicate (outer) parts.
            return tuple(a for t in placed for a in (_DP if t == "dp" else (t,)))

        r = self.replicate
        dense = {"tp": self.tensor, "cp": self.context, "ep": 1, "pp": self.pipeline}
        dense.update(dps=self.data // r, dpr=r, gtp_remat=self.gtp_remat)
        expert = {"tp": self._etp, "cp": 1, "ep": self.expert, "pp": self.pipeline}
        expert.update(dps=self.expert_data // r, dpr=r, gtp_remat=self.expert_gtp_remat)
        dense_axes, expert_axes = grid_axes("tp"), grid_axes("ep")
        object.__setattr__(self, "_dense", _Grid(dense_axes, tuple(dense[a] for a in dense_axes)))
        object.__setattr__(self, "_expert", _Grid(expert_axes, tuple(expert[a] for a in expert_axes)))
        _check_pipelines_coincide(self)

    # ----------------------------------------------------------------------------- sizes
    @property
    def data(self) -> int:
        """The data-parallel size, ``world_size / (tensor * pipeline * context * gtp_remat)``."""
        return self.world_size // (self.tensor * self.pipeline * self.context * self.gtp_remat)

    @property
    def expert_data(self) -> int:
        """The expert-data size, ``world_size / (expert_tensor * expert * pipeline * expert_gtp_remat)``."""
        return self.world_size // (self._etp * self.expert * self.pipeline * self.expert_gtp_remat)

    @property
    def shard(self) -> int:
        """The data-shard size (the inner part of the data axis), ``data / replicate``."""
        return self.data // self.replicate

    @property
    def expert_shard(self) -> int:
        """The expert-data shard size, ``expert_data / replicate`` (torchtitan's ``efsdp``)."""
        return self.expert_data // self.replicate

    @property
    def tokens(self) -> tuple[str, ...]:
        """The full order, fastest-varying first, with the unnamed axes appended. An unnamed
        ``gtp_remat`` is listed last here but placed in each grid as Megatron-core 0.19 places it
        (after ``tp`` in the dense grid, after ``ep`` in the expert grid): :meth:`strides` gives
        its real place."""
        return self._tokens

    def size(self, mode: ParallelMode | str) -> int:
        """Return the number of ranks in each group of ``mode``.

        Raises:
            LayoutError: ``mode`` is not a parallel mode.
        """
        mode = ParallelMode.parse(mode)
        if mode is ParallelMode.EMBEDDING:
            return min(self.pipeline, 2)
        grid, axes = self._grid_axes(mode)
        return math.prod(grid.size_of(t) for t in axes)

    # ----------------------------------------------------------------------------- groups
    def _grid_axes(self, mode: ParallelMode) -> tuple[_Grid, tuple[str, ...]]:
        kind, axes = _MODE_AXES[mode]
        return (self._dense if kind == _DENSE else self._expert), axes

    def group_array(self, mode: ParallelMode | str) -> np.ndarray:
        """Return every group of ``mode`` as an int64 array of shape (n_groups, group_size).

        Rows are ascending and sorted by their first member.

        Raises:
            LayoutError: ``mode`` is not a parallel mode.
        """
        mode = ParallelMode.parse(mode)
        if mode is ParallelMode.EMBEDDING:
            pipe = self.group_array(ParallelMode.PIPELINE)
            return pipe[:, [0, -1]] if self.pipeline > 1 else pipe
        grid, axes = self._grid_axes(mode)
        rows = grid.group_array(axes)
        return rows + self.offset if self.offset else rows

    def groups(self, mode: ParallelMode | str) -> list[list[int]]:
        """Return every group of ``mode`` as a list of ascending lists of global ranks.

        For EMBEDDING these are the first and last stage of each pipeline group, so the middle
        stages of a pipeline longer than 2 belong to no embedding group.

        Raises:
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self.group_array(mode).tolist()

    def group_of(self, mode: ParallelMode | str, rank: int) -> list[int]:
        """Return the ascending members of the group of ``mode`` that holds ``rank``.

        Costs O(group size), independent of the world size. Returns an empty list when the
        rank belongs to no group of that mode (only EMBEDDING, for middle pipeline stages).

        Raises:
            LayoutError: unknown mode, or ``rank`` outside ``[0, world_size)``.
        """
        mode = ParallelMode.parse(mode)
        self._check_rank(rank)
        if mode is ParallelMode.EMBEDDING:
            pipe = self.group_of(ParallelMode.PIPELINE, rank)
            ends = sorted({pipe[0], pipe[-1]})
            return ends if rank in ends else []
        grid, axes = self._grid_axes(mode)
        return grid.members(axes, rank - self.offset, self.offset)

    def axes_groups(self, grid: str, axes: Iterable[str]) -> list[list[int]]:
        """Return every group spanning the order-string tokens ``axes`` (``dp`` is the whole
        data axis) of the ``"dense"`` or ``"expert"`` grid: groups that are no mode's, such as
        Megatron's tensor × data groups. Rows ascending, sorted by their first member.

        Raises:
            LayoutError: an unknown grid or token.
        """
        g, spanned = self._grid_tokens(grid, axes)
        return (g.group_array(spanned) + self.offset).tolist()

    def axes_group_of(self, grid: str, axes: Iterable[str], rank: int) -> list[int]:
        """Return the ascending members of the group of :meth:`axes_groups` holding ``rank``.

        Raises:
            LayoutError: an unknown grid or token, or ``rank`` outside the world.
        """
        self._check_rank(rank)
        g, spanned = self._grid_tokens(grid, axes)
        return g.members(spanned, rank - self.offset, self.offset)

    def _grid_tokens(self, grid: str, axes: Iterable[str]) -> tuple[_Grid, tuple[str, ...]]:
        if grid not in (_DENSE, _EXPERT):
            raise LayoutError(f"grid={grid!r} must be 'dense' or 'expert'")
        spanned: list[str] = []
        for token in axes:
            if token not in AXES:
                raise LayoutError(f"axis token {token!r} must be one of {', '.join(AXES)}")
            spanned.extend(_DP if token == "dp" else (token,))
        return (self._dense if grid == _DENSE else self._expert), tuple(spanned)

    def local_rank(self, mode: ParallelMode | str, rank: int) -> int:
        """Return the index of ``rank`` in its group of ``mode``.

        Raises:
            LayoutError: unknown mode, rank out of range, or a rank in no group of that mode.
        """
        members = self.group_of(mode, rank)
        if not members:
            raise LayoutError(
                f"rank {rank} belongs to no {ParallelMode.parse(mode).value} group: only the "
                f"first and last of {self.pipeline} pipeline stages hold the embedding"
            )
        return members.index(rank)

    def signature(self, mode: ParallelMode | str) -> tuple:
        """Return a key that is equal for two modes exactly when their groups are identical.

        Raises:
            LayoutError: ``mode`` is not a parallel mode.
        """
        mode = ParallelMode.parse(mode)
        if mode is ParallelMode.EMBEDDING:
            if self.pipeline <= 2:
                return self.signature(ParallelMode.PIPELINE)
            return ("embedding",) + self.signature(ParallelMode.PIPELINE)
        grid, axes = self._grid_axes(mode)
        return grid.signature(axes)

    def axis_size(self, axis: str) -> int:
        """Return the size of a coordinate axis: ``tp``, ``cp``, ``dp``, ``pp``,
        ``dp_replicate``, ``dp_shard`` (dense grid) or ``etp``, ``ep``, ``edp``,
        ``edp_replicate``, ``edp_shard`` (expert grid), ``gtp_remat`` (dense) and
        ``egtp_remat`` (expert), the keys of :meth:`coords`.

        Raises:
            LayoutError: an unknown axis name.
        """
        sizes = {
            "tp": self.tensor,
            "cp": self.context,
            "dp": self.data,
            "pp": self.pipeline,
            "etp": self._etp,
            "ep": self.expert,
            "edp": self.expert_data,
            "dp_replicate": self.replicate,
            "dp_shard": self.shard,
            "edp_replicate": self.replicate,
            "edp_shard": self.expert_shard,
            "gtp_remat": self.gtp_remat,
            "egtp_remat": self.expert_gtp_remat,
        }
        if axis not in sizes:
            raise LayoutError(f"axis={axis!r} must be one of {', '.join(sizes)}")
        return sizes[axis]

    def where(self, rank: int) -> str:
        """Return ``rank``'s place as a person reads it: its pipeline stage and its tensor,
        context, data and expert ranks, for the axes larger than 1 (``"pipeline stage 1, tensor
        rank 0, data rank 3"``; ``""`` for a world of one axis).

        Raises:
            LayoutError: ``rank`` outside ``[0, world_size)``.
        """
        c = self.coords(rank)
        axes = (("pp", self.pipeline, "pipeline stage"), ("tp", self.tensor, "tensor rank"),
                ("cp", self.context, "context rank"), ("dp", self.data, "data rank"),
                ("ep", self.expert, "expert rank"))  # fmt: skip
        return ", ".join(f"{words} {c[key]}" for key, size, words in axes if size > 1)

    def coords(self, rank: int) -> dict[str, int]:
        """Return the coordinates of ``rank``.

        Keys ``tp``, ``cp``, ``dp``, ``pp`` are the dense-grid coordinates; ``etp``, ``ep``
        and ``edp`` the expert-tensor, expert and expert-data coordinates. In each grid
        ``rank == sum(coord * stride)`` with the strides of :meth:`strides`. The data
        coordinates split as ``dp == dp_replicate * shard + dp_shard`` (and ``edp`` likewise
        into ``edp_replicate`` and ``edp_shard``). ``gtp_remat`` and ``egtp_remat`` are the
        coordinates on the dense and expert ``gtp_remat`` axes.

        Raises:
            LayoutError: ``rank`` outside ``[0, world_size)``.
        """
        self._check_rank(rank)
        dense = self._dense.coords(rank - self.offset)
        expert = self._expert.coords(rank - self.offset)
        return {
            "tp": dense["tp"],
            "cp": dense["cp"],
            "dp": dense["dpr"] * self.shard + dense["dps"],
            "pp": dense["pp"],
            "etp": expert["tp"],
            "ep": expert["ep"],
            "edp": expert["dpr"] * self.expert_shard + expert["dps"],
            "dp_replicate": dense["dpr"],
            "dp_shard": dense["dps"],
            "edp_replicate": expert["dpr"],
            "edp_shard": expert["dps"],
            "gtp_remat": dense["gtp_remat"],
            "egtp_remat": expert["gtp_remat"],
        }

    def strides(self, grid: str = "dense") -> dict[str, int]:
        """Return the stride of each axis token in the ``"dense"`` or ``"expert"`` grid.

        The keys are the order-string tokens; ``dp`` is the stride of the data axis (of its
        shard part), and ``dp_replicate`` the stride of its replicate part
        (``dp_shard`` equals ``dp``).

        Raises:
            LayoutError: ``grid`` is neither ``"dense"`` nor ``"expert"``.
        """
        if grid not in (_DENSE, _EXPERT):
            raise LayoutError(f"grid={grid!r} must be 'dense' or 'expert'")
        g = self._dense if grid == _DENSE else self._expert
        by_axis = dict(zip(g.tokens, g.strides))
        out = {t: by_axis["dps" if t == "dp" else t] for t in self._tokens}
        out["dp_shard"] = by_axis["dps"]
        out["dp_replicate"] = by_axis["dpr"]
        return out

    def modes(self) -> list[ParallelMode]:
        """Return every mode this layout describes, in a fixed order (GLOBAL first)."""
        return list(ParallelMode)

    def shown_modes(self) -> list[ParallelMode]:
        """Return the modes worth showing a reader (``plan``'s table and picture): every mode,
        except the HSDP parts (:data:`HSDP_MODES`) when ``replicate`` is 1, where they repeat
        DATA, DATA_CONTEXT and EXPERT_DATA or have size 1, and the GTP modes
        (:data:`GTP_MODES`) when both ``gtp_remat`` sizes are 1 (groups of one rank)."""
        hidden: set[ParallelMode] = set()
        if self.replicate == 1:
            hidden.update(HSDP_MODES)
        if self.gtp_remat == 1 and self.expert_gtp_remat == 1:
            hidden.update(GTP_MODES)
        return [m for m in self.modes() if m not in hidden]

    def to_dict(self) -> dict[str, list[list[int]]]:
        """Return ``{mode name: groups}`` for every mode, mode names lower-case."""
        return {mode.value: self.groups(mode) for mode in self.modes()}

    def _check_rank(self, rank: int) -> None:
        if not self.offset <= rank < self.offset + self.world_size:
            if self.offset:
                raise LayoutError(
                    f"rank={rank} is outside this layout's ranks [{self.offset}, {self.offset + self.world_size})"
                )
            raise LayoutError(f"rank={rank} is outside [0, world_size={self.world_size})")

    @property
    def ranks(self) -> range:
        """The global ranks this layout covers: ``range(offset, offset + world_size)``."""
        return range(self.offset, self.offset + self.world_size)

    def describe(self) -> str:
        """Return a one-line summary such as ``world=8 tp=2 cp=1 dp=2 pp=2 order=tp-cp-ep-dp-pp``."""
        text = f"world={self.world_size} tp={self.tensor} cp={self.context} dp={self.data} pp={self.pipeline}"
        if self.replicate > 1:
            text += f" dp_replicate={self.replicate} dp_shard={self.shard}"
        if self.expert > 1 or self._etp != self.tensor:
            text += f" ep={self.expert} etp={self._etp} edp={self.expert_data}"
        if self.gtp_remat > 1 or self.expert_gtp_remat > 1:
            text += f" gtp_remat={self.gtp_remat} egtp_remat={self.expert_gtp_remat}"
        if self.offset:
            text += f" offset={self.offset}"
        return text + f" order={self.order}"


def _check_offset(offset: Any, world_size: int) -> None:
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise LayoutError(
            f"offset={offset!r} must be a non-negative integer (the first global rank of the layout)"
        )
    if offset + world_size > MAX_WORLD_SIZE:
        raise LayoutError(
            f"offset={offset} + world_size={world_size} is past the largest world, {MAX_WORLD_SIZE} ranks"
        )


def _check_size(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise LayoutError(f"{name}={value!r} must be a positive integer")


def plan(
    world_size: int,
    tensor: int = 1,
    pipeline: int = 1,
    context: int = 1,
    expert: int = 1,
    expert_tensor: int | None = None,
    order: str = DEFAULT_ORDER,
    replicate: int = 1,
    gtp_remat: int = 1,
    expert_gtp_remat: int = 1,
) -> Layout:
    """Compute the rank layout of a world; pure and torch-free.

    ``data = world_size / (tensor * pipeline * context)`` is derived. ``expert_tensor``
    defaults to ``tensor``; ``expert_data = world_size / (expert_tensor * expert * pipeline)``.
    ``replicate`` splits the data axis for HSDP: replicate (outer) × shard (inner), shard =
    ``data / replicate``; the expert-data axis splits the same way (expert shard =
    ``expert_data / replicate``).
    ``gtp_remat`` and ``expert_gtp_remat`` are Megatron-core 0.19's generalized tensor
    parallelism on the dense and expert grids: ``data = world_size / (tensor * pipeline * context
    * gtp_remat)``, ``expert_data = world_size / (expert_tensor * expert * pipeline *
    expert_gtp_remat)``; the groups are those of Megatron's ``RankGenerator``.
    ``world_size`` may be at most :data:`MAX_WORLD_SIZE` (2**24 = 16,777,216).

    Returns:
        The validated :class:`Layout`.

    Raises:
        LayoutError: a size that is not a positive integer, a world larger than
            :data:`MAX_WORLD_SIZE`, a size product that does not divide ``world_size``, an order
            string with an unknown or repeated token, an axis of size > 1 that the order string
            leaves out, an order string not in lowercase with a gtp_remat size > 1 (Megatron-core
            0.19 places ``gtp_remat`` case-sensitively), a ``replicate`` that does not divide the
            data or expert-data size, or an expert layout whose pipeline groups
            differ from the dense ones (the rules Megatron-core enforces). The message names the
            values and the fix.
    """
    return Layout(
        world_size,
        tensor,
        pipeline,
        context,
        expert,
        expert_tensor,
        order,
        replicate,
        gtp_remat,
        expert_gtp_remat,
    )


def _validated_sizes(
    world_size: Any,
    tensor: Any,
    pipeline: Any,
    context: Any,
    expert: Any,
    expert_tensor: Any,
    replicate: Any = 1,
    gtp_remat: Any = 1,
    expert_gtp_remat: Any = 1,
) -> tuple[int, int, int, int, int, int, int, int, int]:
    """The sizes as plain ints, ``expert_tensor`` resolved; raises LayoutError (see :func:`plan`)."""
    expert_tensor = tensor if expert_tensor is None else expert_tensor
    for name, value in (
        ("world_size", world_size),
        ("tensor", tensor),
        ("pipeline", pipeline),
        ("context", context),
        ("expert", expert),
        ("expert_tensor", expert_tensor),
        ("replicate", replicate),
        ("gtp_remat", gtp_remat),
        ("expert_gtp_remat", expert_gtp_remat),
    ):
        _check_size(name, value)
    world_size, tensor, pipeline, context, expert, expert_tensor, replicate, gtp_remat, expert_gtp_remat = (
        int(v)
        for v in (
            world_size,
            tensor,
            pipeline,
            context,
            expert,
            expert_tensor,
            replicate,
            gtp_remat,
            expert_gtp_remat,
        )
    )
    if world_size > MAX_WORLD_SIZE:
        raise LayoutError(
            f"world_size={world_size} is larger than the largest world parallelctx plans, "
            f"MAX_WORLD_SIZE={MAX_WORLD_SIZE} (2**24); use at most {MAX_WORLD_SIZE} ranks"
        )
    model = tensor * pipeline * context * gtp_remat
    if world_size % model:
        gtp = f" x gtp_remat={gtp_remat}" if gtp_remat > 1 else ""
        raise LayoutError(
            f"tensor={tensor} x pipeline={pipeline} x context={context}{gtp} = {model} does not divide "
            f"world_size={world_size}; choose sizes whose product divides the world size"
        )
    expert_model = expert_tensor * expert * pipeline * expert_gtp_remat
    if world_size % expert_model:
        egtp = f" x expert_gtp_remat={expert_gtp_remat}" if expert_gtp_remat > 1 else ""
        raise LayoutError(
            f"expert_tensor={expert_tensor} x expert={expert} x pipeline={pipeline}{egtp} = "
            f"{expert_model} does not divide world_size={world_size}; choose expert, expert_tensor "
            f"and pipeline sizes whose product divides the world size"
        )
    data, expert_data = world_size // model, world_size // expert_model
    if data % replicate:
        raise LayoutError(
            f"replicate={replicate} does not divide the data size {data} (world_size={world_size} / "
            f"(tensor x pipeline x context = {model})); choose a replicate size that divides it"
        )
    if expert_data % replicate:
        raise LayoutError(
            f"replicate={replicate} does not divide the expert-data size {expert_data} "
            f"(world_size={world_size} / (expert_tensor x expert x pipeline = {expert_model})); "
            f"choose a replicate size that divides both the data and expert-data sizes"
        )
    return (
        world_size,
        tensor,
        pipeline,
        context,
        expert,
        expert_tensor,
        replicate,
        gtp_remat,
        expert_gtp_remat,
    )


def _check_axes_named(layout: Layout) -> None:
    """Raise LayoutError when the order string cannot place the layout's axes (see :func:`plan`)."""
    order = layout.order
    tokens = parse_order(order)
    data, expert_data = layout.data, layout.expert_data
    needed = {
        "tp": max(layout.tensor, layout._etp),
        "cp": layout.context,
        "ep": layout.expert,
        "dp": max(data, expert_data),
        "pp": layout.pipeline,
    }
    for token, size in needed.items():
        if size > 1 and token not in tokens:
            raise LayoutError(
                f"order={order!r} leaves out {token!r} but the {_AXIS_NAMES[token]} size is "
                f"{size}; name every axis of size > 1, e.g. {DEFAULT_ORDER!r}"
            )
    gtp = {"gtp_remat": layout.gtp_remat, "expert_gtp_remat": layout.expert_gtp_remat}
    big = {name: size for name, size in gtp.items() if size > 1}
    if big and order != order.lower():
        # Megatron-core 0.19 places gtp_remat by matching 'tp'/'ep'/'gtp_remat' case-sensitively:
        # it would build other groups than this order read in lowercase.
        sizes = ", ".join(f"{name}={size}" for name, size in big.items())
        raise LayoutError(
            f"order={order!r} with {sizes}: megatron-core 0.19 places gtp_remat by the lowercase "
            f"tokens only (in this order it would put it first); write the order in lowercase, "
            f"e.g. {order.lower()!r}"
        )
    if tokens[-1] != "pp" and layout.pipeline > 1 and expert_data != data:
        raise LayoutError(
            f"order={order!r} does not end with 'pp', so the expert-data size ({expert_data}) "
            f"must equal the data size ({data}); put 'pp' last or change the expert sizes"
        )


def _check_pipelines_coincide(layout: Layout) -> None:
    """Raise LayoutError when the expert grid puts the pipeline stages elsewhere (see :func:`plan`)."""
    if layout.pipeline > 1 and layout._dense.signature(("pp",)) != layout._expert.signature(("pp",)):
        raise LayoutError(
            f"with order={layout.order!r} the expert grid (expert_tensor={layout._etp}, "
            f"expert={layout.expert}, expert_data={layout.expert_data}) puts the pipeline stages on "
            f"other ranks than the dense grid (tensor={layout.tensor}, context={layout.context}, "
            f"data={layout.data}); make the axes before 'pp' multiply to the same size in both grids, "
            f"or put 'pp' last"
        )
