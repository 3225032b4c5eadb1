"""The start-up: functions of values that make this rank's world and return it as one frozen
:class:`Launched`.

:func:`start` runs the steps in order (every step is also a function of its own, which the
InternLM-style step methods of ``gpc`` call one at a time): the checks a rank can make alone,
before any waiting (a rank that fails them tells the others at the rendezvous, in the
background, and raises); the meeting (:func:`parallelctx.runtime.meetings.init_default_group`: the
rendezvous store, the one round trip that agrees the launch's key prefix and checks every rank's
values, the default group; or, for a dry run, :func:`parallelctx.runtime.simulate.meet`); this rank's groups
(:func:`parallelctx.runtime.groups.create_groups`); the processes per node; the device; the
seeds. Every group is held by the guard from the moment it exists. When a step fails, what the
start-up made is destroyed before the error leaves. Nothing here reads or writes the context:
``gpc.launch()`` adopts what :func:`start` returns.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import socket
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..config import DEFAULT_TIMEOUT, Config, ConfigError, ConfigLike, check_init_method_env, load_config
from ..config.args import LaunchArgs, LaunchArgumentError, validate_launch_args
from ..guard.abort import LaunchAborted
from ..guard.core import Guard, Held
from ..guard.recorder import DryRun
from ..planning.layout import Layout, LayoutError, ParallelMode
from ..planning.modules import ModulePlan
from ..planning.simulation import parse_simulate
from . import rendezvous
from .groups import GroupMaker, ModeGroup, create_groups, create_module_groups, gloo_lazy_env
from .meetings import DefaultGroup, Meetings, init_default_group
from .mesh import build_device_mesh
from .rendezvous import Arrival
from .rngstate import RNGState, capture, restore
from .seed import STREAMS, RNGStreams, parse_stream, seed_at
from .simulate import meet

__all__ = [
    "ALREADY_LAUNCHED",
    "CPU_BACKENDS",
    "Launched",
    "agreed_values",
    "arm",
    "begin_launch",
    "dry_run_for",
    "end",
    "host_names",
    "layout_of",
    "local_rank_of",
    "make_streams",
    "pick_device",
    "resolve_backend",
    "start",
    "tear_down",
]

logger = logging.getLogger("parallelctx")

ALREADY_LAUNCHED = (
    "parallelctx is already launched in this process; launch once per process: under "
    "parallelctx.spawn (and @pytest.mark.parallel) each worker is launched before your "
    "function runs, so drop the launch call from it and pass the config as "
    "spawn(..., config=...); to launch again after your own launch, call gpc.destroy() first"
)
"""What a second launch in the same process raises (a RuntimeError)."""

CPU_BACKENDS = frozenset({"gloo", "mpi", "fake", "local"})
"""Backends whose groups also serve as the CPU groups (no gloo twin is made)."""


@dataclass(frozen=True)
class Launched:
    """This rank's world, as one value: the validated config, rank and world size, the local
    rank, the default group's backend and timeout, whether parallelctx owns the default group,
    the launch's store under its agreed prefix (None for a world of one and a dry run), every
    rank's host name, the layout, this rank's groups by mode and the ``new_group`` calls made,
    the device, the RNG streams and their base seed, the groups the guard noted, and the dry run
    (None for a real launch). The defaults stand for "not made yet". With ``parallel.modules``
    it also holds the :class:`~parallelctx.planning.modules.ModulePlan`, this rank's groups of
    every module it belongs to, and the module it answers for (its primary one;
    :meth:`for_module` gives the value of another).

    Each step of the start-up is a method that returns the next value: :meth:`met`,
    :meth:`with_groups`, :meth:`with_hosts`, :meth:`with_device`, :meth:`with_streams`;
    :func:`start` runs them in order, ``gpc``'s InternLM step methods one at a time.
    """

    config: Config | None = None
    rank: int = -1
    world_size: int = 0
    local_rank: int | None = None
    backend: str | None = None
    timeout: timedelta | None = None
    owns_default_group: bool = False
    store: Any = None
    hostnames: Sequence[str] = ()
    layout: Layout | None = None
    groups: Mapping[ParallelMode, ModeGroup] = field(default_factory=dict)
    group_calls: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    streams: RNGStreams | None = None
    seed: int | None = None
    notes: tuple[Held, ...] = ()
    dry_run: DryRun | None = None
    eager: bool = False  # the default group connected as it was made (no settle since)
    # parallel.modules: every module's layout, this rank's groups of each module it belongs to,
    # and which module this value answers for (layout and groups above are that module's)
    plan: ModulePlan | None = None
    module: str | None = None
    module_groups: Mapping[str, Mapping[ParallelMode, ModeGroup]] = field(default_factory=dict)
    world_group: ModeGroup | None = None  # the job's world and its CPU twin (with modules)
    absent: str | None = None  # why a launched rank has no part here (outside, below)
    kept: tuple[Any, ...] = ()  # groups no mode answers with, destroyed with the launch
    meshes: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def replace(self, **changes: Any) -> Launched:
        """Return this value with ``changes`` (fields by name), keeping the device meshes built
        so far while the layout, the groups and the device type stay: ``gpc.device_mesh`` stays
        the one mesh across ``gpc.set_seed()`` (the pytest plugin's kept launches) and the other
        step methods.

        Raises:
            TypeError: a name that is no field.
        """
        new = dataclasses.replace(self, **changes)
        same = new.layout is self.layout and new.groups is self.groups
        if same and new.device.type == self.device.type:
            new.meshes.update(self.meshes)
        return new

    def device_mesh(self, grid: str = "dense") -> Any:
        """Return the ``DeviceMesh`` of ``grid`` (``"dense"``: ``pp``, ``dp``, ``cp``, ``tp``;
        ``"expert"``: ``pp``, ``edp``, ``ep``, ``etp``) over this world's groups, built once
        (:func:`parallelctx.mesh.build_device_mesh`).

        Raises:
            ValueError: no groups yet.
            MeshError: the groups cannot make that mesh.
        """
        if self.layout is None:
            raise ValueError("the device mesh needs the groups: make them first")
        if grid not in self.meshes:
            groups = {mode: g.group for mode, g in self.groups.items()}
            self.meshes[grid] = build_device_mesh(self.layout, self.rank, groups, self.device.type, grid)
        return self.meshes[grid]

    def rng_state(self) -> RNGState:
        """Return every RNG stream of this rank now, labelled with where it was taken.

        Raises:
            ValueError: no streams yet.
        """
        if self.streams is None or self.layout is None:
            raise ValueError("the RNG state needs the streams: seed first")
        seed = self.seed if self.seed is not None else -1
        return capture(self.streams, self.rank, self.world_size, self.layout.describe(), seed)

    def restore_rng(self, state: RNGState) -> None:
        """Restore every stream from ``state`` (see :func:`parallelctx.rngstate.restore`); returns None.

        Raises:
            ValueError: no streams yet, or ``state`` was taken elsewhere.
            TypeError: ``state`` is not an :class:`RNGState`.
        """
        if self.streams is None or self.layout is None:
            raise ValueError("restoring the RNG state needs the streams: seed first")
        restore(state, self.streams, self.rank, self.world_size, self.layout.describe())

    def met(self, rank: int, world_size: int, default: DefaultGroup) -> Launched:
        """Return this value with the meeting's result: rank ``rank`` of ``world_size`` on
        ``default`` (its host names kept unless it gathered none)."""
        return self.replace(
            rank=rank, world_size=world_size, backend=default.backend, timeout=default.timeout,
            owns_default_group=default.owned, store=default.store, hostnames=default.hostnames or self.hostnames,
            eager=default.eager,
        )  # fmt: skip

    def group_maker(self, guard: Guard, meetings: Meetings | None = None) -> GroupMaker:
        """Return a maker of groups for this world, as its own groups are made: the timeout,
        ``dist.gloo_lazy_init``, name claims on an adopted default group, held by ``guard``."""
        used = None if self.owns_default_group or meetings is None else meetings.adopted_names()
        lazy = self.config.dist.gloo_lazy_init if self.config is not None else True
        wait = self.timeout or DEFAULT_TIMEOUT
        settle = None
        if self.store is not None and self.world_size > 1:
            settle = functools.partial(
                rendezvous.settle,
                self.store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=wait,
                where="the launch's store",
            )
        return GroupMaker(guard, wait, lazy, used, self.world_size, settle)

    def with_groups(self, maker: GroupMaker, layout: Layout | ModulePlan | None = None) -> Launched:
        """Return this value with this rank's groups, made by ``maker`` for ``layout`` (default:
        the config's sizes on this world; a :class:`~parallelctx.planning.modules.ModulePlan`
        for ``parallel.modules``: every module this rank belongs to). When the default group or one of these connected as
        it was made, every rank settles here first (:meth:`GroupMaker.settle
        <parallelctx.runtime.groups.GroupMaker.settle>`): no rank goes on, and perhaps tears a
        group down, while a peer is still connecting to it (issue 34).

        Raises:
            ValueError: no config yet.
            LayoutError: the config's sizes do not fit the world size.
            RuntimeError: from torch, when a peer does not arrive within the timeout.
            RendezvousError: a rank did not settle within the timeout.
        """
        if self.config is None:
            raise ValueError("the groups need the config: load it first")
        if layout is None:
            layout = self.config.parallel.layout_or_plan(self.world_size)
        cpu_backend = None if self.backend in CPU_BACKENDS else "gloo"
        maker.eager = maker.eager or self.eager
        if isinstance(layout, ModulePlan):
            return self._with_modules(maker, layout, cpu_backend)
        groups = create_groups(layout, self.rank, maker, cpu_backend)
        maker.settle("launch")
        notes = (*self.notes, *maker.made)
        return self.replace(layout=layout, groups=groups, group_calls=maker.calls, notes=notes, eager=False)

    def _with_modules(self, maker: GroupMaker, plan: ModulePlan, cpu_backend: str | None) -> Launched:
        """This value with the groups of every module this rank belongs to; it answers for the
        rank's primary module (:meth:`ModulePlan.primary <parallelctx.planning.modules.ModulePlan.primary>`)."""
        mine = plan.of_rank(self.rank)
        made = create_module_groups(
            [plan.layouts[n] for n in mine], self.rank, maker, cpu_backend, self.world_size
        )
        maker.settle("launch")
        notes = (*self.notes, *maker.made)
        primary = plan.primary(self.rank)
        groups = dict(zip(mine, made.modules))
        return self.replace(
            layout=plan.layouts[primary], groups=groups[primary], group_calls=maker.calls, notes=notes,
            eager=False, plan=plan, module=primary, module_groups=groups, world_group=made.world, kept=made.extra,
        )  # fmt: skip

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules this rank belongs to, in the config's order (``()`` without modules)."""
        return tuple(self.module_groups)

    def for_module(self, name: str) -> Launched:
        """Return this value answering for module ``name`` (its layout, groups and streams).

        Raises:
            LayoutError: no module of that name, or this rank is not in it (the message names
                its ranks and this rank's modules).
        """
        if self.plan is None:
            raise LayoutError(
                f"gpc.module({name!r}): this job has no parallel.modules; its one layout is gpc's own"
            )
        layout = self.plan.layouts[self.plan._known(name)]
        if name not in self.module_groups:
            raise LayoutError(
                f"global rank {self.rank} is not in module {name!r} (ranks {layout.offset}-"
                f"{layout.offset + layout.world_size - 1}); this rank's modules: {', '.join(self.modules)}"
            )
        if name == self.module:
            return self
        return self.replace(layout=layout, groups=self.module_groups[name], module=name)

    def outside(self, name: str) -> Launched:
        """Return the value a context of module ``name`` adopts where this rank has no part in
        it: not launched, and where this value is launched, carrying why (the
        :meth:`for_module` error, raised by every query of that context)."""
        if self.rank >= 0:
            try:
                self.for_module(name)
            except LayoutError as exc:
                return Launched(absent=str(exc))
        return Launched()

    def stream_key(self, stream: Any) -> Any:
        """Return the key of ``stream`` (a mode or ``"replica"``) in :attr:`streams` for the
        module this value answers for: the plain key for the rank's primary module (and a job
        without modules), ``(module, key)`` for another.

        Raises:
            LayoutError: ``stream`` names no stream.
        """
        key = parse_stream(stream)
        if self.plan is None or self.module == self.plan.primary(self.rank):
            return key
        return (self.module, key)

    def with_hosts(self) -> Launched:
        """Return this value with every rank's host name (the meeting's, else one all-gather over
        the CPU group of the world) and, when the launcher gave none, the local rank.

        Raises:
            RuntimeError: a peer did not answer within the timeout.
        """
        world = self.world_group or self.groups[ParallelMode.GLOBAL]  # the job's, with modules
        hostnames = host_names(self.hostnames, self.world_size, world.cpu_group)
        local = local_rank_of(hostnames, self.rank)[0] if self.local_rank is None else self.local_rank
        return self.replace(hostnames=hostnames, local_rank=local)

    def with_device(self, local_rank: int | None = None) -> Launched:
        """Return this value with the device :func:`pick_device` picks for ``local_rank``
        (default: this value's).

        Raises:
            ValueError: CUDA is available but no local rank is known.
        """
        local = self.local_rank if local_rank is None else local_rank
        return self.replace(local_rank=local, device=pick_device(local))

    def with_streams(self, seed: Any = None) -> Launched:
        """Return this value with seeded RNG streams (``seed``: the config's by default;
        :func:`make_streams`).

        Raises:
            ValueError: a seed outside ``[0, 2**32)``, or no layout or config yet.
        """
        if self.layout is None or self.config is None:
            raise ValueError("the seeds need the layout: make the groups first")
        base = self.config.seed if seed is None else seed
        if self.plan is not None:
            mine: dict[str | None, tuple[int, Layout]] = {}
            for name in self.modules:  # the module this value answers for has the plain keys
                mine[None if name == self.module else name] = (self.plan.index(name), self.plan.layouts[name])
            streams = make_streams(self.layout, self.rank, base, self.device, mine)
            return self.replace(streams=streams, seed=base)
        return self.replace(streams=make_streams(self.layout, self.rank, base, self.device), seed=base)


# ------------------------------------------------------------------------------ the steps
def resolve_backend(backend: str | None) -> str:
    """Return the backend to use: ``"auto"`` (or None) means nccl with CUDA, else gloo.

    Raises:
        ValueError: an unknown backend (a value no check has seen), or nccl without CUDA.
    """
    if backend not in (None, "auto", "nccl", "gloo"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'nccl' or 'gloo'")
    if backend in (None, "auto"):
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, which is not available here; use 'gloo' or 'auto'")
    return backend


def agreed_values(
    cfg: Config,
    layout: Layout | ModulePlan,
    world_size: int,
    backend: str | None,
    timeout: timedelta,
    seed: int | None,
) -> dict[str, Any]:
    """Return what every rank must launch with, as flat dotted keys: the config's parallel and
    dist sections (init_method aside: ranks may name rank 0's host differently), the seed, the
    layout, the world size, ``TORCH_GLOO_LAZY_INIT`` as torch reads it (:func:`gloo_lazy_env`)
    and the versions of parallelctx and torch (the running modules' own ``__version__``: reading
    the installed metadata cost milliseconds per launch)."""
    values: dict[str, Any] = {}

    def flat(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                flat(f"{prefix}.{key}", item)
        else:
            values[prefix] = value

    flat("parallel", cfg.parallel.model_dump(mode="json"))
    flat("dist", cfg.dist.model_dump(mode="json"))
    values.pop("dist.init_method", None)
    values["dist.backend"] = backend or cfg.dist.backend
    values["dist.timeout"] = timeout.total_seconds()
    values["seed"] = seed
    values["layout"] = layout.describe()
    values["world_size"] = world_size
    # Whether gloo groups connect as made or at their first collective: ranks that differ never
    # meet (torch 2.13 crashed with SIGSEGV in the eager ranks), so it is agreed like the config.
    values["env.TORCH_GLOO_LAZY_INIT"] = gloo_lazy_env()
    # The package module is imported before any of its modules; its version is read, not imported.
    values["parallelctx_version"] = sys.modules[__name__.partition(".")[0]].__version__
    values["torch_version"] = torch.__version__
    return values


def host_names(known: Sequence[str], world_size: int, cpu_group: Any) -> Sequence[str]:
    """Return every rank's host name in rank order: ``known`` when the meeting gathered them,
    else one all-gather over ``cpu_group`` (bounded by its timeout).

    Raises:
        RuntimeError: a peer did not answer within the group's timeout.
    """
    if len(known) == world_size:
        return known
    if world_size == 1:
        return (socket.gethostname(),)
    names = [""] * world_size
    dist.all_gather_object(names, socket.gethostname(), group=cpu_group)
    return tuple(names)


def local_rank_of(hostnames: Sequence[str], rank: int) -> tuple[int, int]:
    """Return ``(this rank's index among the ranks on its host, how many ranks that host has)``."""
    host = hostnames[rank]
    same = [r for r, name in enumerate(hostnames) if name == host]
    return same.index(rank), len(same)


def pick_device(local_rank: int | None) -> torch.device:
    """Select and return this process's device: ``cuda:(local_rank % device_count)`` where CUDA
    is available (made current with ``torch.cuda.set_device``), else the CPU.

    Raises:
        ValueError: CUDA is available but ``local_rank`` is None.
    """
    if not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        return torch.device("cpu")
    if local_rank is None:
        raise ValueError(
            "set_device needs the launcher's local rank (the global rank would pick the "
            "wrong GPU on every node but the first); pass local_rank"
        )
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def make_streams(
    layout: Layout,
    rank: int,
    seed: Any,
    device: torch.device,
    modules: Mapping[str | None, tuple[int, Layout]] | None = None,
) -> RNGStreams:
    """Seed Python, numpy and torch from ``seed`` and return one RNG stream per mode and the
    ``"replica"`` stream (the formula: :mod:`parallelctx.seed`), on the CPU and, on a CUDA
    ``device``, CUDA generators. ``modules`` (``parallel.modules``): ``{name: (module number,
    layout)}`` of this rank's modules, the one it answers for under the name None; its streams
    have the plain keys and the others' ``(name, key)``.

    Raises:
        ValueError: ``seed`` is not an integer in ``[0, 2**32)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} must be an integer in [0, 2**32)")
    seeds: dict[Any, int] = {}
    for name, (number, lay) in (modules or {None: (0, layout)}).items():
        coords = lay.coords(rank)
        for key in STREAMS:
            seeds[key if name is None else (name, key)] = seed_at(lay, coords, key, seed, number)
    return RNGStreams(seeds, cuda=device.type == "cuda")


def tear_down(owns_default: bool, groups: Iterable[Any], guard: Guard) -> None:
    """Destroy the default group when parallelctx made it (which destroys every group), else
    each of ``groups`` once, never the adopted default group; the guard stops holding them.
    Returns None."""
    groups = [g for g in groups if g is not None]
    guard.release(None if owns_default else groups)
    if not dist.is_initialized():
        return
    if owns_default:
        dist.destroy_process_group()
        return
    seen: set[int] = set()
    for g in groups:
        if g is not dist.group.WORLD and id(g) not in seen and g in dist.distributed_c10d._world.pg_map:
            seen.add(id(g))
            dist.destroy_process_group(g)


def dry_run_for(simulate: Mapping[str, int] | None, current: DryRun | None) -> DryRun | None:
    """The dry run a launch plays: none for a real launch; the armed one (``parallelctx dry-run``)
    when ``simulate`` is None or names its rank; else a new one for ``simulate``.

    Raises:
        ValueError: a bad ``simulate`` (the message names the key).
    """
    armed = current if current is not None and current.armed else None
    if simulate is None:
        return armed
    sim = parse_simulate(simulate)
    return armed if armed is not None and armed.sim == sim else DryRun(sim)


# ------------------------------------------------------------------------------ the sequence
def begin_launch(meetings: Meetings, guard: Guard) -> None:
    """A launch begins in this process: an earlier refusal of it is told first, the launch is
    counted (its generation pairs it with the other ranks' launch of the same number) and an
    abort from now on stops it. Returns None."""
    meetings.finish_refusal()
    meetings.begin()
    guard.begin()


def start(
    config: ConfigLike,
    raw: Mapping[str, Any],
    meetings: Meetings,
    guard: Guard,
    dry: DryRun | None = None,
) -> Launched:
    """Make this rank's world: checks, meeting, groups, processes per node, device, seeds.

    ``raw`` holds ``launch()``'s arguments as given (``rank``, ``world_size``, ``host``,
    ``port``, ``local_rank``, ``local_world_size``, ``timeout``, ``seed``, ``backend``,
    ``init_method``; None takes the config's), checked once here
    (:func:`parallelctx.config.args.validate_launch_args`). With ``dry`` this process plays one rank of
    a simulated world instead (its config serves when ``config`` is None), and ``raw`` gives only
    ``timeout``, ``seed`` and ``local_rank``.

    Returns:
        A :class:`Launched`, complete.

    Raises:
        RendezvousError: (a RuntimeError) a rank did not arrive within the timeout, the store did
            not answer or its port is taken, another rank refused to launch, or the ranks were
            launched with different settings; raised on every rank.
        LaunchArgumentError: a bad argument (a ValueError and a TypeError).
        ValueError: a bad config value (ConfigError, LayoutError, pydantic's ValidationError).
        LaunchAborted: ``gpc.abort()`` was called while the launch ran.
        RuntimeError: torch.distributed is initialised with another rank or world size (a dry
            run: at all).
    """
    if dry is not None:
        return _start_dry(config, raw, dry, guard)
    begin_launch(meetings, guard)
    cfg, args, layout = _checked(config, raw, meetings)
    wait = args.timeout or cfg.dist.timeout
    seed = args.seed if args.seed is not None else cfg.seed
    values = agreed_values(cfg, layout, args.world_size, args.backend, wait, seed)
    check_init_method_env(args.init_method)
    backend = resolve_backend(args.backend or cfg.dist.backend)
    arrival = Arrival(args.rank, socket.gethostname(), values)
    while True:
        launched = Launched(config=cfg, local_rank=args.local_rank)
        maker: GroupMaker | None = None
        try:
            default = init_default_group(meetings, guard, args, backend, wait, arrival)
            launched = launched.met(args.rank, args.world_size, default)
            maker = launched.group_maker(guard, meetings)
            launched = launched.with_groups(maker, layout).with_hosts().with_device().with_streams(seed)
            if guard.aborted.is_set():  # abort() came while torch made the groups
                raise LaunchAborted(
                    f"rank {args.rank}: the launch was aborted by gpc.abort() while it made the groups"
                )
            heard = meetings.settled()
            if heard is None:
                meetings.launched()
                break
            raise _PeerAbandoned(heard.words())
        except BaseException as exc:
            _undo(launched, maker, guard)
            heard = meetings.settled()
            if heard is not None and not guard.aborted.is_set() and not isinstance(exc, KeyboardInterrupt):
                # A peer abandoned this attempt (its own abort, or an error there): meet again.
                logger.warning(
                    "parallelctx: %s; rank %d meets the other ranks again", heard.words(), args.rank
                )
                continue
            meetings.abandon()
            if guard.aborted.is_set() and not isinstance(exc, (KeyboardInterrupt, LaunchAborted)):
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise LaunchAborted(
                    f"rank {args.rank}: the launch was aborted by gpc.abort() while it waited "
                    f"({type(exc).__name__}: {first})"
                ) from exc
            raise
    on_node = local_rank_of(launched.hostnames, args.rank)[1]
    if args.local_world_size is not None and args.local_world_size != on_node:
        logger.warning(
            "the launcher says %d processes run on this node, but %d ranks share host %r; "
            "check the launcher's host list and the per-node process count",
            args.local_world_size,
            on_node,
            socket.gethostname(),
        )
    return launched


class _PeerAbandoned(RuntimeError):
    """A peer abandoned this rank's launch attempt after this rank had made its groups."""


def layout_of(cfg: Config, world_size: int) -> Layout | ModulePlan:
    """Return the config's layout on ``world_size`` ranks, or with ``parallel.modules`` its
    :class:`~parallelctx.planning.modules.ModulePlan`.

    Raises:
        LayoutError: the sizes (or the modules) do not fit ``world_size``.
    """
    return cfg.parallel.layout_or_plan(world_size)


def _checked(
    config: ConfigLike, raw: Mapping[str, Any], meetings: Meetings
) -> tuple[Config, LaunchArgs, Layout | ModulePlan]:
    """The config, the arguments and the layout, checked before any waiting. A rank whose
    checks fail raises at once; when it can still reach the others (its rank, world size and
    address are valid) it also tells them at the rendezvous in the background, so that every
    rank stops at once instead of waiting for it until the timeout."""
    refused: BaseException | None = None
    cfg: Config | None = None
    try:
        cfg = load_config(config)
    except (ValueError, TypeError) as exc:
        refused = exc
    given = dict(raw)
    given["init_method"] = given.get("init_method") or (cfg.dist.init_method if cfg is not None else None)
    need_address = not dist.is_initialized()  # an existing default group is adopted
    try:
        args = validate_launch_args(**given, need_address=need_address)
    except LaunchArgumentError as exc:
        args = _reachable(given, need_address, exc)
        refused = refused or exc
    layout: Layout | ModulePlan | None = None
    if refused is None and cfg is not None:
        try:
            layout = layout_of(cfg, args.world_size)
        except (ValueError, TypeError) as exc:
            refused = exc
    if refused is None and cfg is not None and layout is not None:
        return cfg, args, layout
    refused = refused or RuntimeError("parallelctx: the launch checks failed without a cause")
    wait = args.timeout or (cfg.dist.timeout if cfg is not None else DEFAULT_TIMEOUT)
    error = f"{type(refused).__name__}: {refused}"
    meetings.announce_refusal(args, wait, Arrival(args.rank, socket.gethostname(), error=error))
    if isinstance(refused, (ConfigError, LayoutError, LaunchArgumentError)):
        refused = refused.with_traceback(None)  # the message is the whole story
    raise refused


def _reachable(given: Mapping[str, Any], need_address: bool, refused: LaunchArgumentError) -> LaunchArgs:
    """The arguments this rank needs to reach the others although another argument was bad;
    raises ``refused`` when even these are bad (the rank cannot tell anyone)."""
    keep = {key: given.get(key) for key in ("rank", "world_size", "host", "port", "init_method")}
    for wait in (given.get("timeout"), None):
        try:
            return validate_launch_args(**keep, timeout=wait, need_address=need_address)
        except LaunchArgumentError:
            continue
    raise refused


def end(launched: Launched, guard: Guard) -> None:
    """Undo ``launched``: stop its dry run's recording (unless ``parallelctx dry-run`` armed it
    for the whole script) and tear down its groups (:func:`tear_down`); returns None."""
    if launched.dry_run is not None and not launched.dry_run.armed:
        launched.dry_run.stop_recording()
    every = [*launched.module_groups.values()] if launched.module_groups else [launched.groups]
    if launched.world_group is not None:
        every.append({ParallelMode.GLOBAL: launched.world_group})
    mine = [g for groups in every for mg in groups.values() for g in (mg.group, mg.cpu_group)]
    mine += launched.kept
    tear_down(launched.owns_default_group, mine, guard)


def arm(guard: Guard, launched: Launched) -> None:
    """Start ``launched``'s hang report in ``guard`` when its config asks for one
    (``dist.hang_report``) and the world has more than one rank and a store; returns None."""
    hang = launched.config.dist.hang_report if launched.config is not None else None
    if hang is not None and launched.world_size > 1 and launched.store is not None:
        where = launched.layout.where if launched.layout is not None else None
        groups: Any = launched.groups
        if launched.plan is not None:  # every module's groups; a rank's place in its modules
            where = launched.plan.where
            groups = [pair for mine in launched.module_groups.values() for pair in mine.items()]
        guard.watch(hang.after, hang.log, launched.rank, launched.store, groups, where, hang.store_wait)


def _undo(launched: Launched, maker: GroupMaker | None, guard: Guard) -> None:
    """Destroy what a failed start-up made: the default group when it made it (every group
    goes with it), else each group the maker made."""
    made = [h.group for h in maker.made] if maker is not None else []
    tear_down(launched.owns_default_group, made, guard)


def _start_dry(config: ConfigLike, raw: Mapping[str, Any], dry: DryRun, guard: Guard) -> Launched:
    """The start-up of a dry run: the simulated meeting, then the same steps as a real launch;
    ``dry`` records from here (until ``destroy()`` unless ``parallelctx dry-run`` armed it) and
    notes the launch in its report."""
    from ..config import to_timedelta
    from ..guard.recorder import rank_runs

    begin = time.perf_counter()
    cfg = load_config(config if config is not None else dry.config)
    timeout = raw.get("timeout")
    wait = to_timedelta(timeout, "timeout") if timeout is not None else cfg.dist.timeout
    seed = raw["seed"] if raw.get("seed") is not None else cfg.seed
    sim = dry.sim
    layout = layout_of(cfg, sim.world_size)  # LayoutError before any group
    started = not dry.recording
    if started:
        dry.start_recording()
    local = sim.local_rank if raw.get("local_rank") is None else raw["local_rank"]
    launched = Launched(config=cfg, local_rank=local, dry_run=dry)
    maker: GroupMaker | None = None
    try:
        launched = launched.met(sim.rank, sim.world_size, meet(sim, wait))
        maker = launched.group_maker(guard)
        launched = launched.with_groups(maker, layout).with_hosts().with_device().with_streams(seed)
    except BaseException:
        _undo(launched, maker, guard)
        if started:
            dry.stop_recording()
        raise
    seconds = time.perf_counter() - begin
    seeds = launched.streams.seeds if launched.streams is not None else {}

    def coords_of(groups: Mapping[ParallelMode, ModeGroup]) -> dict[str, int]:
        return {mode.value: g.ranks.index(sim.rank) for mode, g in groups.items()}

    def groups_of(groups: Mapping[ParallelMode, ModeGroup]) -> dict[str, list[int]]:
        return {mode.value: list(g.ranks) for mode, g in groups.items() if mode is not ParallelMode.GLOBAL}

    def seeds_of(module: str | None) -> dict[str, int]:
        # the module plain gpc answers for (and a job without modules) has the plain keys, the
        # rank's other modules (module, key)
        own = [(k, v) for k, v in seeds.items() if not isinstance(k, tuple)] if module is None else [
            (k[1], v) for k, v in seeds.items() if isinstance(k, tuple) and k[0] == module
        ]  # fmt: skip
        return {str(getattr(k, "value", k)): int(v) for k, v in own}

    modules: dict[str, dict[str, Any]] | None = None
    if isinstance(layout, ModulePlan):
        modules = {
            name: {
                "ranks": rank_runs(groups[ParallelMode.GLOBAL].ranks),
                "layout": layout.layouts[name].describe(),
                "coords": coords_of(groups),
                "groups": groups_of(groups),
                "seeds": seeds_of(None if name == launched.module else name),
            }
            for name, groups in launched.module_groups.items()
        }
    dry.note_launch(
        coords=coords_of(launched.groups),
        groups=groups_of(launched.groups),
        seeds=seeds_of(None),
        seconds=seconds,
        calls=launched.group_calls,
        layout=layout.describe(),
        # with modules only the keys given: the sizes' defaults beside modules would not load
        parallel=cfg.parallel.model_dump(mode="json", exclude_unset=modules is not None),
        module=launched.module,
        modules=modules,
    )
    logger.info(
        "parallelctx dry run: rank %d of %d (%s) on the fake backend, %d new_group calls, launch %.3f s",
        sim.rank,
        sim.world_size,
        layout.describe(),
        launched.group_calls,
        seconds,
    )
    return launched
