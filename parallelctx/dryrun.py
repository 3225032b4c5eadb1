"""Dry runs: this process acts as one rank of a world of any size, on torch's ``fake`` backend.

``gpc.launch(config, simulate=dict(world_size=16384, rank=12345))`` (and ``parallelctx dry-run``,
which arms the same for a script that calls ``launch_from_torch``) makes the default group on
torch's ``fake`` backend with its in-process ``FakeStore``: no store server, no other process.
Every subgroup, ``gpc.device_mesh``, the Megatron and torchtitan bridges and DTensor sharding on
meta or CPU tensors then run as on the real rank; collectives return at once and their results
are not real (the first one of each kind logs that once). See docs/dry_run.md.

A :class:`DryRun` (``gpc.dry_run``) records the rank's report: coordinates, groups and seeds at
the end of launch, every ``torch.distributed.new_group`` call of the run (members, local
synchronization, call site), the collectives called, and the values the script registers with
:func:`record` (with an optional "same across MODE" declaration that sweeps check).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from .planning.layout import ParallelMode

if TYPE_CHECKING:
    from .context import ParallelContext

__all__ = [
    "COLLECTIVES",
    "NOT_FORWARDED",
    "DryRun",
    "GroupCall",
    "SimulatedHosts",
    "Simulation",
    "fake_default_group",
    "install_recorders",
    "launch_simulated",
    "parse_simulate",
    "record",
    "torchrun_environment",
]

logger = logging.getLogger("parallelctx")

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
)
"""The ``torch.distributed`` collectives a dry run logs (once per kind) and counts."""

NOT_FORWARDED = ("broadcast_object_list", "monitored_barrier", "recv_object_list", "scatter_object_list")
"""Collectives a dry run does not hand to torch: on a receiving rank torch reads the objects'
sizes from a tensor the fake backend leaves uninitialised and allocates that many bytes (tebibytes,
or garbage to unpickle), and ``monitored_barrier`` refuses any backend but gloo. A dry run leaves
their output list as it was (``recv_object_list`` returns ``src``)."""

_THIS_FILE = os.path.normcase(os.path.abspath(__file__)).removesuffix("c")


@dataclass(frozen=True)
class Simulation:
    """Which rank of which world this process plays: ``world_size``, ``rank`` and the ranks per
    node, ``nproc_per_node`` (node = rank // nproc_per_node, as torchrun places them)."""

    world_size: int
    rank: int
    nproc_per_node: int

    @property
    def local_rank(self) -> int:
        """This rank's index on its node."""
        return self.rank % self.nproc_per_node

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.rank // self.nproc_per_node


def parse_simulate(value: Any) -> Simulation:
    """Check ``simulate=`` (a mapping with ``world_size``, ``rank`` and optionally
    ``nproc_per_node``, default 8 where 8 divides the world, else 1) or a :class:`Simulation`.

    Returns:
        The :class:`Simulation`.

    Raises:
        ValueError: a missing or unknown key, or a value out of range (the message names it).
    """
    from .planning.limits import MAX_WORLD_SIZE

    if isinstance(value, Simulation):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"simulate={value!r} must be a dict such as dict(world_size=16384, rank=12345)")
    unknown = sorted(set(value) - {"world_size", "rank", "nproc_per_node"})
    if unknown:
        raise ValueError(
            f"simulate= got unknown keys {unknown}; it takes world_size, rank and nproc_per_node"
        )

    def whole(name: str, default: int | None = None) -> int:
        got = value.get(name, default)
        if got is None:
            raise ValueError(f"simulate= needs {name}=<int>, e.g. simulate=dict(world_size=16384, rank=0)")
        if isinstance(got, bool) or not isinstance(got, int):
            raise ValueError(f"simulate {name}={got!r} must be an integer")
        return got

    world = whole("world_size")
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise ValueError(f"simulate world_size={world} must lie in [1, {MAX_WORLD_SIZE}]")
    rank = whole("rank")
    if not 0 <= rank < world:
        raise ValueError(f"simulate rank={rank} must lie in [0, world_size={world})")
    per_node = whole("nproc_per_node", 8 if world % 8 == 0 else 1)
    if per_node < 1 or world % per_node:
        raise ValueError(
            f"simulate nproc_per_node={per_node} must be a positive divisor of world_size={world}"
        )
    return Simulation(world, rank, per_node)


def torchrun_environment(sim: Simulation) -> dict[str, str]:
    """Return the variables torchrun would give ``sim``'s rank (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, TORCHELASTIC_RUN_ID); the address is never contacted in a dry run."""
    return {
        "RANK": str(sim.rank),
        "WORLD_SIZE": str(sim.world_size),
        "LOCAL_RANK": str(sim.local_rank),
        "LOCAL_WORLD_SIZE": str(sim.nproc_per_node),
        "GROUP_RANK": str(sim.node),
        "GROUP_WORLD_SIZE": str(sim.world_size // sim.nproc_per_node),
        "ROLE_RANK": str(sim.rank),
        "ROLE_WORLD_SIZE": str(sim.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "parallelctx-dry-run",
    }


class SimulatedHosts(Sequence[str]):
    """Every rank's host name in a simulated world (``node<i>``, i = rank // nproc_per_node),
    computed on demand: its memory does not grow with the world."""

    def __init__(self, world_size: int, nproc_per_node: int) -> None:
        self._world = world_size
        self._per_node = nproc_per_node

    def __len__(self) -> int:
        return self._world

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._world)))
        i = int(index)
        if i < 0:
            i += self._world
        if not 0 <= i < self._world:
            raise IndexError(f"rank {index} outside the simulated world of {self._world}")
        return f"node{i // self._per_node}"

    def __iter__(self) -> Iterator[str]:
        for node in range(self._world // self._per_node):
            name = f"node{node}"
            for _ in range(self._per_node):
                yield name


@dataclass
class GroupCall:
    """One ``torch.distributed.new_group`` call of a dry run: members (None: the whole world),
    whether it synchronised locally, its description, where it was called (``file:line``) and
    how many process groups the process held before it (torch names a locally synchronised
    group by its members and that number)."""

    ranks: list[int] | None
    local: bool
    desc: str
    where: str
    held: int = -1

    def to_json(self) -> dict[str, Any]:
        """Return the call as a JSON-ready dict."""
        return {
            "ranks": self.ranks,
            "local": self.local,
            "desc": self.desc,
            "where": self.where,
            "held": self.held,
        }


class DryRun:
    """What a dry run of one rank records; its :meth:`report` is the rank's report."""

    def __init__(self, sim: Simulation, config: Any = None, armed: bool = False) -> None:
        self.sim = sim
        #: The config the launch uses when the script passes none (``parallelctx dry-run --config``).
        self.config = config
        #: True when every launch of this process is this dry run (``parallelctx dry-run``), not
        #: only a launch given ``simulate=``.
        self.armed = armed
        self.calls: list[GroupCall] = []
        self.collectives: dict[str, int] = {}
        self.values: dict[str, Any] = {}
        self.same_across: dict[str, str] = {}
        self.launched: dict[str, Any] = {}
        self.launches = 0
        self._restore: Callable[[], None] | None = None

    @property
    def recording(self) -> bool:
        """True while ``torch.distributed`` is wrapped for this dry run (:meth:`start_recording`)."""
        return self._restore is not None

    def start_recording(self) -> None:
        """Wrap ``torch.distributed`` for this dry run (:func:`install_recorders`); a no-op when
        it already is."""
        if self._restore is None:
            self._restore = install_recorders(self)

    def stop_recording(self) -> None:
        """Restore ``torch.distributed``'s own functions; a no-op when not recording."""
        if self._restore is not None:
            restore, self._restore = self._restore, None
            restore()

    def note_launch(self, ctx: ParallelContext, seconds: float) -> None:
        """Keep the coordinates, groups (the world's aside) and seeds ``ctx`` has after a launch
        of ``seconds``; a later launch in the same run replaces them."""
        coords: dict[str, int] = {}
        groups: dict[str, list[int]] = {}
        for mode, view in ctx._views.items():
            coords[mode.value] = view.rank
            if mode is not ParallelMode.GLOBAL:
                groups[mode.value] = list(view.ranks)
        seeds = {str(getattr(k, "value", k)): int(v) for k, v in ctx.rng_streams.seeds.items()}
        self.launches += 1
        self.launched = {
            "coords": coords,
            "groups": groups,
            "seeds": seeds,
            "launch_s": seconds,
            "launch_new_group_calls": ctx.group_creations,
            "layout": ctx.layout.describe(),
            "parallel": ctx.config.parallel.model_dump(mode="json"),
        }

    def report(self) -> dict[str, Any]:
        """Return the rank's report as a JSON-ready dict: ``world_size``, ``rank``,
        ``nproc_per_node``, ``coords`` {mode: local rank}, ``groups`` {mode: global ranks of its
        group; the world left out}, ``seeds`` {stream: seed}, ``new_group_calls`` (every
        ``new_group`` call of the run, gpc's included), ``launch_s``, ``values`` and
        ``same_across`` (what :func:`record` registered), ``collectives`` {kind: calls},
        ``new_groups`` (each call: ranks, local, desc, where) and ``launches``."""
        return {
            "world_size": self.sim.world_size,
            "rank": self.sim.rank,
            "nproc_per_node": self.sim.nproc_per_node,
            "coords": {},
            "groups": {},
            "seeds": {},
            "launch_s": None,
            **self.launched,
            "new_group_calls": len(self.calls),
            "values": dict(self.values),
            "same_across": dict(self.same_across),
            "collectives": dict(self.collectives),
            "new_groups": [c.to_json() for c in self.calls],
            "launches": self.launches,
        }


def record(key: str, value: Any, same_across: ParallelMode | str | None = None) -> None:
    """Add ``key: value`` to this rank's dry-run report (a no-op outside a dry run, so scripts
    keep the call). ``value`` must be JSON-serialisable (lists, dicts, numbers, strings;
    ``list(p.shape)`` for a shape). ``same_across="tensor"`` declares that every rank of a tensor
    group must record the same value; ``parallelctx dry-run --ranks`` checks it.

    Raises:
        TypeError: ``key`` is not a string, or ``value`` does not serialise to JSON.
        LayoutError: ``same_across`` names no parallel mode.
    """
    import json

    from .context import gpc

    if not isinstance(key, str):
        raise TypeError(f"record() takes a string key, not {key!r}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"record({key!r}, ...): the value must serialise to JSON ({exc}); "
            "record list(tensor.shape), not the tensor"
        ) from None
    mode = ParallelMode.parse(same_across).value if same_across is not None else None
    dry = gpc.dry_run
    if dry is None:
        return
    dry.values[key] = value
    if mode is not None:
        dry.same_across[key] = mode


def _call_site() -> str:
    """``file:line`` of the nearest caller outside this module and torch.distributed."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if os.path.normcase(os.path.abspath(name)) != _THIS_FILE and "torch/distributed" not in name:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def install_recorders(dry: DryRun) -> Callable[[], None]:
    """Wrap ``torch.distributed.new_group`` (each call recorded in ``dry.calls``; a ``backend=``
    it names is dropped, so every group is on the dry run's fake backend) and the
    collectives of :data:`COLLECTIVES` (counted in ``dry.collectives``; the first of each kind
    logs that a dry run's results are not real). Code that looks the functions up on
    ``torch.distributed`` at call time (``dist.all_reduce``) is seen; functional collectives
    (DTensor's) are not. The collectives of :data:`NOT_FORWARDED` are not handed to torch at all.

    Returns:
        A function that restores the originals.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    originals: dict[str, Any] = {}
    original_new_group = dist.new_group
    signature = inspect.signature(original_new_group)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original_new_group(*args, **kwargs)  # torch's own error for a bad call
        given = bound.arguments
        ranks = given.get("ranks")
        members = None if ranks is None else sorted(int(r) for r in ranks)
        local = bool(given.get("use_local_synchronization", False))
        desc = str(given.get("group_desc") or "")
        names = getattr(getattr(c10d, "_world", None), "pg_names", None)
        held = len(names) if names is not None else -1
        dry.calls.append(GroupCall(members, local, desc, _call_site(), held))
        if given.get("backend") is not None:  # a gloo or nccl group: on the fake backend too
            given["backend"] = None
            given.pop("pg_options", None)
        return original_new_group(*bound.args, **bound.kwargs)

    new_group.__wrapped__ = original_new_group  # type: ignore[attr-defined]
    originals["new_group"] = original_new_group
    dist.new_group = new_group

    def wrap(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            seen = dry.collectives.get(kind, 0)
            dry.collectives[kind] = seen + 1
            if not seen:
                logger.warning(
                    "parallelctx dry run: torch.distributed.%s does no communication on the fake "
                    "backend; its results are not real (shapes, groups and seeds are; values are not)",
                    kind,
                )
            if kind in NOT_FORWARDED:
                return (
                    kwargs.get("src", args[1] if len(args) > 1 else None)
                    if kind == "recv_object_list"
                    else None
                )
            return fn(*args, **kwargs)

        collective.__wrapped__ = fn  # type: ignore[attr-defined]
        collective.__name__ = kind
        return collective

    for kind in COLLECTIVES:
        fn = getattr(dist, kind, None)
        if fn is not None:
            originals[kind] = fn
            setattr(dist, kind, wrap(kind, fn))

    def restore() -> None:
        for name, fn in originals.items():
            setattr(dist, name, fn)

    return restore


def launch_simulated(
    ctx: ParallelContext, sim: Simulation, timeout: Any, seed: int | None, local_rank: int | None
) -> None:
    """The dry-run launch of ``ctx`` (its config already loaded): the default group on the
    ``fake`` backend with a ``FakeStore`` (no rendezvous, no store server), this rank's groups,
    simulated host names (``node<i>``), the CPU as device, seeds; then the report's launch part.
    On failure the caller destroys ``ctx``.

    Raises:
        LayoutError: the config's sizes do not fit ``sim.world_size``.
        RuntimeError: torch.distributed is already initialised in this process.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "a dry run makes its own default group on the fake backend, but torch.distributed is "
            "already initialised in this process; call torch.distributed.destroy_process_group() first"
        )
    begin = time.perf_counter()
    dry = ctx._dry_run
    if dry is None or dry.sim != sim or not dry.armed:  # each simulate= launch is a new dry run
        dry = DryRun(sim)
        ctx._dry_run = dry
    ctx.config.parallel.to_layout(sim.world_size)  # LayoutError before any group
    if not dry.recording:  # the programmatic form: record from here until destroy()
        dry.start_recording()
        ctx.add_destroy_hook(dry.stop_recording)
    ctx.init_global_dist(sim.rank, sim.world_size, backend="fake", timeout=timeout)
    ctx._hostnames = SimulatedHosts(sim.world_size, sim.nproc_per_node)  # type: ignore[assignment]
    ctx._local_rank = sim.local_rank if local_rank is None else local_rank
    ctx.init_parallel_groups()
    ctx.set_seed(seed)
    dry.note_launch(ctx, time.perf_counter() - begin)
    logger.info(
        "parallelctx dry run: rank %d of %d (%s) on the fake backend, %d new_group calls, launch %.3f s",
        sim.rank,
        sim.world_size,
        ctx.layout.describe(),
        ctx.group_creations,
        dry.launched["launch_s"],
    )


def fake_default_group(rank: int, world_size: int, timeout: Any) -> None:
    """Initialise the default group on torch's ``fake`` backend with a ``FakeStore``.

    Raises:
        RuntimeError: torch refused (already initialised).
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size, timeout=timeout)
