"""The facade: ``gpc``, the one :class:`ParallelContext` of the process, and every query.

``launch()`` checks, runs the start-up (one frozen :class:`~parallelctx.runtime.startup.Launched`),
adopts it (``_adopt``: the only writer of the launch state) and arms the
:class:`~parallelctx.guard.core.Guard`; each InternLM step method adopts one step's result. The
per-mode queries answer from tables filled at adoption (:class:`parallelctx.views.Answers`), the
launch's values, seeds and summary from the adopted value
(:class:`~parallelctx.runtime.queries.LaunchQueries`); never from torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .config import DEFAULT_TIMEOUT, Config, load_config
from .config.args import validate_launch_args
from .guard.core import Guard
from .guard.hang import HangReport
from .guard.recorder import DryRun
from .planning.layout import Layout, ParallelMode
from .planning.views import (
    VIEW_NAMES,
    Answers,
    ModeView,
    ModeViews,
    NotLaunchedError,
    Unlaunched,
    not_launched,
)
from .runtime import startup
from .runtime.groups import GroupMaker
from .runtime.meetings import Meetings, init_default_group
from .runtime.queries import LaunchQueries
from .runtime.reform import Reformed, prepare
from .runtime.rendezvous import Arrival
from .runtime.rngstate import RNGState
from .runtime.startup import Launched, resolve_backend

__all__ = ["ModeView", "NotLaunchedError", "ParallelContext", "RNGState", "gpc", "resolve_backend"]

logger = logging.getLogger("parallelctx")
M = ParallelMode


class ParallelContext(ModeViews, LaunchQueries):
    """The parallel context of this process; use the one instance, ``parallelctx.gpc``.
    :meth:`launch` makes this rank's world (the InternLM steps, :meth:`load_config` to
    :meth:`set_seed`, one step at a time); :meth:`destroy` undoes it. A mode may be a
    :class:`ParallelMode`, its name in any case, or an alias (:data:`parallelctx.layout.MODE_ALIASES`)."""

    def __init__(self) -> None:
        # Kept across destroy(): the guard, where launches meet, the dry run (its report).
        self._guard = Guard()
        self._meetings = Meetings(self._guard.aborted)
        self._dry_run: DryRun | None = None
        self._modules: dict[str, ModuleContext] = {}
        self._answer()
        self._reset()

    # ------------------------------------------------------------------ state
    def _answer(self) -> None:
        self._answers = Answers()  # once per context: a launch refills it (Answers.bind)
        self._answers.bind(self, ParallelContext)
        self._groups, self._cpu_groups = self._answers.groups, self._answers.cpu_groups

    def _reset(self) -> None:
        self._destroy_hooks: list[Callable[[], None]] = []
        self._reform_hooks: list[Callable[[], None]] = []
        self._adopt(Launched())

    def _adopt(self, value: Launched) -> None:
        """Make ``value`` this context's launch state: the one writer of it (and of the module
        contexts' states, :meth:`module`)."""
        self._launched = value
        self._layout, self._timeout = value.layout, value.timeout
        self._answers.fill(value.rank, value.world_size, value.groups, value.layout, value.absent)
        for mode, name in VIEW_NAMES.items():
            setattr(self, name, self._answers.views.get(mode) or Unlaunched(name))
        for name, ctx in getattr(self, "_modules", {}).items():
            ctx._adopt(value.for_module(name) if name in value.modules else value.outside(name))

    # ------------------------------------------------------------------ modules
    @property
    def modules(self) -> tuple[str, ...]:
        """The modules of ``parallel.modules`` this rank belongs to, in the config's order (``()``
        for a job without modules, or before launch)."""
        return self._launched.modules

    def module(self, name: str) -> ParallelContext:
        """Return the context of module ``name`` (``parallel.modules``; docs/modules.md): every
        query of gpc (ranks, groups, views, seeds, ``device_mesh``, the bridges' ``ctx=``)
        answered for that module's layout on its ranks; its ``world`` is the module's ranks.
        The same object for the same name; it follows gpc's launches and raises
        NotLaunchedError once gpc is destroyed. Plain ``gpc`` answers for the rank's primary
        module (the language module where the rank has it, else its first).

        Raises:
            NotLaunchedError: before launch.
            LayoutError: the job has no modules, no module of that name, or this rank is not in
                it (the message names its ranks and this rank's modules).
        """
        if self._launched.layout is None:
            raise not_launched(f"gpc.module({name!r})")
        value = self._launched.for_module(name)  # raises for a name this rank has no part in
        if name not in self._modules:
            self._modules[name] = ModuleContext(self, name)
            self._modules[name]._adopt(value)
        return self._modules[name]

    # ------------------------------------------------------------------ lifecycle
    def launch(
        self,
        config: Config | Mapping[str, Any] | str | Path | None = None,
        rank: int = 0,
        world_size: int = 1,
        host: str | None = "127.0.0.1",
        port: int | None = None,
        backend: str | None = None,
        local_rank: int | None = None,
        seed: int | None = None,
        timeout: int | float | timedelta | None = None,
        init_method: str | None = None,
        local_world_size: int | None = None,
        simulate: Mapping[str, int] | None = None,
    ) -> ParallelContext:
        """Make this rank's world (:func:`parallelctx.runtime.startup.start`: config, default
        group, groups, processes per node, device, seeds; undone when a step fails), adopt it and
        arm the guard (``dist.hang_report``); log a summary on the rank :meth:`is_rank_for_log`
        picks. ``simulate=dict(world_size=W, rank=R[, nproc_per_node=G])``: a dry run of rank R
        of W on torch's ``fake`` backend (:mod:`parallelctx.dryrun`). None takes the config's.

        Returns:
            This context.

        Raises:
            RuntimeError: already launched (call :meth:`destroy` first).
            RendezvousError: (a RuntimeError) a rank did not arrive in time, the store did not
                answer, a rank refused, or the ranks disagree; on every rank, naming them.
            LaunchArgumentError: a bad argument (a ValueError and a TypeError).
            ValueError: a bad config value (ConfigError, LayoutError, pydantic's ValidationError).
            LaunchAborted: :meth:`abort` was called while the launch ran.
        """
        if self.is_initialized(M.GLOBAL):
            raise RuntimeError(startup.ALREADY_LAUNCHED)
        self._dry_run = dry = startup.dry_run_for(simulate, self._dry_run)
        raw: dict[str, Any] = dict(rank=rank, world_size=world_size, host=host, port=port, seed=seed)
        raw.update(local_rank=local_rank, local_world_size=local_world_size, timeout=timeout)
        raw.update(backend=backend, init_method=init_method)
        self._adopt(startup.start(config, raw, self._meetings, self._guard, dry))
        startup.arm(self._guard, self._launched)
        if self.is_rank_for_log():
            logger.info(self.summary())
        return self

    def load_config(self, config: Config | Mapping[str, Any] | str | Path | None) -> Config:
        """Validate and keep the config (a Config, a dict, a file path, or None); return it.
        Raises ConfigError or pydantic's ValidationError (:func:`parallelctx.config.load_config`)."""
        cfg = load_config(config)
        self._adopt(self._launched.replace(config=cfg))
        return cfg

    def init_global_dist(
        self,
        rank: int,
        world_size: int,
        backend: str = "auto",
        host: str | None = "127.0.0.1",
        port: int | None = None,
        timeout: timedelta | None = None,
        init_method: str | None = None,
        arrival: Arrival | None = None,
    ) -> None:
        """Make (or adopt) the default group, after meeting every rank at ``init_method`` or
        ``tcp://host:port`` (:func:`parallelctx.runtime.meetings.init_default_group`;
        ``backend="auto"``: nccl with CUDA, else gloo); a no-op when gpc made it already. Raises
        LaunchArgumentError (a ValueError) for a bad argument, RuntimeError when torch.distributed
        has another rank or world size, RendezvousError when a rank did not arrive in time or the
        ranks disagree."""
        given = dict(rank=rank, world_size=world_size, host=host, port=port, timeout=timeout, backend=backend)
        args = validate_launch_args(**given, init_method=init_method, need_address=not dist.is_initialized())
        v = self._launched
        if v.owns_default_group and dist.is_initialized() and (v.rank, v.world_size) == (rank, world_size):
            return  # called again: the default group gpc made stays gpc's (destroy() tears it down)
        wait = args.timeout or (v.config.dist.timeout if v.config is not None else DEFAULT_TIMEOUT)
        startup.begin_launch(self._meetings, self._guard)  # counted as launch() counts
        made = init_default_group(
            self._meetings, self._guard, args, resolve_backend(args.backend), wait, arrival
        )
        self._adopt(v.met(args.rank, args.world_size, made))

    def init_parallel_groups(self) -> Layout:
        """Build the layout from the config's sizes and make this rank's groups; return the
        :class:`Layout`. Raises NotLaunchedError before :meth:`init_global_dist`, LayoutError
        when the sizes do not fit the world."""
        if self._launched.backend is None:
            raise not_launched("init_parallel_groups()")
        self.config  # noqa: B018 - NotLaunchedError before load_config
        self._adopt(self._launched.with_groups(self.group_maker()))
        return self.layout

    def detect_num_processes_on_current_node(self) -> int:
        """Count and return the ranks sharing this rank's host (the meeting's host names, else
        one all-gather over the CPU group); gives the local rank when the launcher gave none.
        Raises NotLaunchedError before :meth:`init_parallel_groups`, RuntimeError when a peer
        does not answer in time."""
        if M.GLOBAL not in self._launched.groups:
            raise not_launched("detect_num_processes_on_current_node()")
        self._adopt(self._launched.with_hosts())
        return self.num_processes_on_current_node

    def set_device(self, local_rank: int | None = None) -> torch.device:
        """Pick and return this process's device: ``cuda:(local_rank % device_count)`` with CUDA,
        else the CPU (``local_rank``: the launcher's by default). Raises ValueError when CUDA is
        available but no local rank is known."""
        self._adopt(self._launched.with_device(local_rank))
        return self.device

    def set_seed(self, seed: int | None = None) -> None:
        """Seed Python, numpy and torch and make one RNG stream per mode and ``"replica"``
        (``seed``: the config's by default; :mod:`parallelctx.seed`). Raises NotLaunchedError
        before :meth:`init_parallel_groups`, ValueError for a seed outside ``[0, 2**32)``."""
        if self._launched.layout is None:
            raise not_launched("set_seed()")
        self._adopt(self._launched.with_streams(seed))

    def group_maker(self) -> GroupMaker:
        """Return a maker of process groups for this launch, as gpc's own were made (its timeout,
        ``dist.gloo_lazy_init``, name claims on an adopted default group, held by the guard so
        that :meth:`abort` reaches them), for bridges that add groups gpc has no mode for.
        Raises NotLaunchedError before :meth:`init_global_dist`."""
        if self._launched.timeout is None:
            raise not_launched("gpc.group_maker()")
        return self._launched.group_maker(self._guard, self._meetings)

    def arm_dry_run(self, dry: DryRun | None) -> None:
        """Make every launch of this process the dry run ``dry`` (``parallelctx dry-run`` arms
        ``DryRun(sim, config, armed=True)`` before it runs a script); None disarms."""
        self._dry_run = dry

    def add_destroy_hook(self, hook: Callable[[], None], on_reform: Callable[[], None] | None = None) -> None:
        """Have :meth:`destroy` call ``hook()`` first, while the groups still exist (last added
        first; kept once; forgotten by that destroy), and :meth:`reform` call ``on_reform()`` on
        every rank that stays once the smaller world is launched (a bridge rebuilds itself).
        Raises TypeError for a non-callable."""
        for given in (hook, on_reform or hook):
            if not callable(given):
                raise TypeError(f"add_destroy_hook takes a function of no arguments, not {given!r}")
        if hook not in self._destroy_hooks:
            self._destroy_hooks.append(hook)
        if on_reform is not None and on_reform not in self._reform_hooks:
            self._reform_hooks.append(on_reform)

    @property
    def destroy_hooks(self) -> tuple[Callable[[], None], ...]:
        """The hooks :meth:`destroy` will call, in the order added."""
        return tuple(self._destroy_hooks)

    def on_hang(self, handler: Callable[[HangReport], Any]) -> Callable[[HangReport], Any]:
        """Call ``handler(report)`` (a :class:`parallelctx.HangReport`), in the watching thread, once
        per collective on gpc's groups that waited past ``dist.hang_report.after``; kept across
        :meth:`destroy`. Returns ``handler``; raises TypeError for a non-callable."""
        return self._guard.on_hang(handler)

    def abort(self, timeout: float = 2.0) -> int:
        """Abort every group this context made (the bridges' too), from any thread, without
        waiting on a hung collective (:meth:`parallelctx.guard.core.Guard.abort`): a pending
        collective raises within milliseconds, here and on the peers; a launch under way raises
        :class:`parallelctx.abort.LaunchAborted`. Then :meth:`destroy` and launch again.
        ``timeout`` bounds each connection it makes (at most 0.5 s).

        Returns:
            The number of gloo connections shut down. Never raises (a failure is logged).
        """
        return self._guard.abort(timeout)

    def reform(
        self, exclude: list[int] | tuple[int, ...], timeout: int | float | timedelta | None = None
    ) -> Reformed:
        """Go on without the ranks ``exclude`` (gone for good) in the surviving processes, after
        :meth:`abort`: the ranks that stay agree on ``exclude``, the layout shrinks by
        ``parallel.reform``, and they launch again as ranks ``0..n-1`` in their old order (a fresh
        launch of the smaller layout); the reform hooks rebuild the bridges
        (:func:`parallelctx.runtime.reform.prepare`; docs/reliability.md).

        Returns:
            A :class:`Reformed` (``stays=False`` on a rank that left; gpc is then destroyed).

        Raises:
            RuntimeError, ValueError, ReformError: from :func:`~parallelctx.runtime.reform.prepare`.
            RendezvousError, LaunchAborted: from the new launch.
        """
        plan = prepare(self._launched, self._meetings, exclude, timeout)
        rebuild = list(self._reform_hooks)
        self.destroy()
        if plan.result.stays:
            self.launch(plan.config, **plan.launch_args)
            for hook in rebuild:
                hook()
        return plan.result

    def destroy(self) -> None:
        """Run the destroy hooks, tear down every group parallelctx made (the default group too when
        it made that) and reset everything; ``launch`` works again; safe twice or before launch.
        Raises the first exception a hook raised, after the teardown."""
        failed: BaseException | None = None
        for hook in reversed(self._destroy_hooks):
            try:
                hook()
            except BaseException as exc:  # every hook runs, and the teardown still happens
                logger.exception("parallelctx: destroy hook %r failed", hook)
                failed = failed or exc
        self._guard.unwatch()
        with self._guard.serial():
            launched = self._launched
            try:
                self._reset()  # the queries and views stop answering before any group goes
            finally:
                startup.end(launched, self._guard)
        if failed is not None:
            raise failed

    # ------------------------------------------------------------------ queries (hot path)
    def get_global_rank(self) -> int:
        """Return this process's global rank. Raises NotLaunchedError before launch."""
        if self._launched.rank < 0:
            raise not_launched("get_global_rank()")
        return self._launched.rank

    def get_local_rank(self, mode: ParallelMode | str) -> int:
        """Return this rank's index in its group of ``mode`` (0 for a mode of size 1).

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._answers.local_ranks[mode]

    def get_world_size(self, mode: ParallelMode | str) -> int:
        """Return the size of this rank's group of ``mode`` (1 for an unused axis).

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._answers.world_sizes[mode]

    def get_group(self, mode: ParallelMode | str) -> Any:
        """Return this rank's process group of ``mode`` (a one-rank group of this rank for a mode
        of size 1, never None, which torch would read as the whole world).

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._answers.groups[mode]

    def get_cpu_group(self, mode: ParallelMode | str) -> Any:
        """Return the CPU (gloo) group beside ``mode``'s group (the group itself with gloo).

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._answers.cpu_groups[mode]

    def get_ranks_in_group(self, mode: ParallelMode | str) -> list[int]:
        """Return the ascending global ranks of this rank's group of ``mode`` (a new list).
        Raises as :meth:`get_local_rank`."""
        return list(self._answers.view(mode, "get_ranks_in_group()").ranks)

    def is_initialized(self, mode: ParallelMode | str) -> bool:
        """Return True when this rank has a (possibly size-1) group of ``mode``. Raises
        LayoutError for a name of no mode."""
        if mode in self._answers.views:
            return True
        parsed = ParallelMode.parse(mode)
        return self._launched.rank >= 0 if parsed is M.GLOBAL else parsed in self._answers.views

    def is_first_rank(self, mode: ParallelMode | str) -> bool:
        """Return True when this rank is first (local rank 0) in its group of ``mode``."""
        return self._answers.view(mode, "is_first_rank()").is_first

    def is_last_rank(self, mode: ParallelMode | str) -> bool:
        """Return True when this rank is last in its group of ``mode``."""
        return self._answers.view(mode, "is_last_rank()").is_last

    def is_pipeline_first_stage(self) -> bool:
        """Return True on the first pipeline stage. Raises NotLaunchedError before launch."""
        return self._answers.view(M.PIPELINE, "is_pipeline_first_stage()").is_first

    def is_pipeline_last_stage(self) -> bool:
        """Return True on the last pipeline stage. Raises NotLaunchedError before launch."""
        return self._answers.view(M.PIPELINE, "is_pipeline_last_stage()").is_last

    def get_next_global_rank(self, mode: ParallelMode | str) -> int:
        """Return the global rank after this one in its group of ``mode``, wrapping around."""
        return self._answers.view(mode, "get_next_global_rank()").next_rank

    def get_prev_global_rank(self, mode: ParallelMode | str) -> int:
        """Return the global rank before this one in its group of ``mode``, wrapping around."""
        return self._answers.view(mode, "get_prev_global_rank()").prev_rank

    def is_rank_for_log(self) -> bool:
        """Return True on the one rank that logs: first in its tensor, context and data groups,
        on the last pipeline stage (where the loss is)."""
        first = all(self.is_first_rank(m) for m in (M.TENSOR, M.CONTEXT, M.DATA))
        return first and self.is_pipeline_last_stage()


class ModuleContext(ParallelContext):
    """``gpc.module(name)``: gpc's queries for one module's layout and groups; launching,
    destroying, reforming and aborting stay gpc's (it shares gpc's guard and destroy hooks)."""

    def __init__(self, parent: ParallelContext, name: str) -> None:
        self._guard, self._meetings, self._dry_run, self._modules = parent._guard, parent._meetings, None, {}
        self._parent, self.name = parent, name
        self._answer()
        self._reset()

    def __repr__(self) -> str:
        return f"<gpc.module({self.name!r})>"

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"gpc.module({self.name!r}) answers queries only: launch, destroy and reform gpc itself"
        )

    launch = load_config = init_global_dist = init_parallel_groups = set_device = set_seed = _refuse
    detect_num_processes_on_current_node = reform = destroy = arm_dry_run = _refuse

    def module(self, name: str) -> ParallelContext:
        """gpc's :meth:`ParallelContext.module`; raises as it does."""
        return self._parent.module(name)

    def add_destroy_hook(self, hook: Callable[[], None], on_reform: Callable[[], None] | None = None) -> None:
        """gpc's :meth:`ParallelContext.add_destroy_hook`; raises TypeError for a non-callable."""
        self._parent.add_destroy_hook(hook, on_reform)


gpc: ParallelContext = ParallelContext()
"""The global parallel context: the one instance of :class:`ParallelContext`."""
