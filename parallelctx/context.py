"""The parallel context: the state behind ``gpc`` and every query model code makes.

Queries answer from plain dicts and attributes filled once at launch, so a call such as
``gpc.get_local_rank(ParallelMode.TENSOR)`` never calls into torch. The launch sequence that
fills them lives in :mod:`parallelctx.startup`; the tables and views in :mod:`parallelctx.views`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .config import DEFAULT_TIMEOUT, Config, load_config
from .guard import abort as _abort
from .guard import hang as _hang
from .planning.layout import Layout, LayoutError, ParallelMode
from .planning.views import LAUNCH_HINT, VIEW_NAMES, ModeTable, ModeView, NotLaunchedError, Unlaunched
from .runtime import startup
from .runtime.groups import ModeGroup
from .runtime.rendezvous import Arrival
from .runtime.rngstate import RNGState, capture, restore
from .runtime.seed import STREAMS, RNGStreams, Stream, mode_seed, parse_stream
from .runtime.startup import resolve_backend

__all__ = ["ModeView", "NotLaunchedError", "ParallelContext", "RNGState", "gpc", "resolve_backend"]

logger = logging.getLogger("parallelctx")

# The four hottest queries are closures stored on the instance (see ParallelContext._reset); these
# names are given the documentation and signature of the methods of the same names.
_FAST_QUERIES = ("get_local_rank", "get_world_size", "get_group", "get_cpu_group")


class ParallelContext:
    """The parallel context of this process. Use the one instance, ``parallelctx.gpc``.

    Lifecycle: :meth:`launch` (what every ``launch*`` function ends in) calls, in this order,
    :meth:`load_config`, :meth:`init_global_dist`, :meth:`init_parallel_groups`,
    :meth:`detect_num_processes_on_current_node`, :meth:`set_device`, :meth:`set_seed`, and
    :meth:`destroy` when any of them fails; :meth:`destroy` undoes all. The sequence itself is
    :func:`parallelctx.startup.launch`.

    A mode may be given as a :class:`ParallelMode`, its name in any case (``"tensor"``), or an
    alias (``"tp"``, ``"pp"``, ``"dp"``, ``"cp"``, ``"ep"``; :data:`parallelctx.layout.MODE_ALIASES`).
    """

    # Readable views, one per mode, set at launch (declared for type checkers).
    world: ModeView
    tensor: ModeView
    pipeline: ModeView
    data: ModeView
    context: ModeView
    model: ModeView
    data_context: ModeView
    embedding: ModeView
    expert: ModeView
    expert_tensor: ModeView
    expert_data: ModeView
    expert_tensor_and_expert: ModeView
    expert_model: ModeView
    data_shard: ModeView
    data_replicate: ModeView
    data_shard_context: ModeView
    expert_data_shard: ModeView
    expert_data_replicate: ModeView
    gtp_remat: ModeView
    expert_gtp_remat: ModeView

    def __init__(self) -> None:
        # Stores, launch counter and adopted group names: kept across destroy() for relaunches.
        self._meetings = startup.Meetings()
        # The dry run this process plays (parallelctx.dryrun), kept across destroy() for its report.
        self._dry_run: Any = None
        # gpc.on_hang handlers: kept across destroy() (an in-process restart keeps its watchdog).
        self._hang_handlers: list[Callable[[_hang.HangReport], Any]] = []
        # abort() and destroy()'s teardown never overlap (an abort from a watchdog may still be
        # shutting down connections when the main thread, its collective ended, destroys).
        self._abort_lock = threading.RLock()
        self._reset()

    # ------------------------------------------------------------------ state
    def _reset(self) -> None:
        self._config: Config | None = None
        self._layout: Layout | None = None
        self._global_rank = -1
        self._world_size = 0
        self._local_rank: int | None = None
        self._backend: str | None = None
        self._timeout: timedelta | None = None
        self._owns_default_group = False
        self._local_ranks = ModeTable(lambda m: self._bad_mode(m, "get_local_rank()"))
        self._world_sizes = ModeTable(lambda m: self._bad_mode(m, "get_world_size()"))
        self._groups = ModeTable(lambda m: self._bad_mode(m, "get_group()"))
        self._cpu_groups = ModeTable(lambda m: self._bad_mode(m, "get_cpu_group()"))
        # Hot path: these four queries are closures over their tables, stored on the instance, so a
        # call costs one Python frame and one dict lookup (no bound-method object, no self lookup).
        # They carry the documentation and signature of the methods of the same names below; a
        # miss resolves an alias or raises the same clear errors (views.ModeTable).
        local_ranks, world_sizes, groups, cpu_groups = (
            self._local_ranks,
            self._world_sizes,
            self._groups,
            self._cpu_groups,
        )

        def get_local_rank(mode: ParallelMode | str) -> int:
            return local_ranks[mode]  # type: ignore[no-any-return,unused-ignore]

        def get_world_size(mode: ParallelMode | str) -> int:
            return world_sizes[mode]  # type: ignore[no-any-return,unused-ignore]

        def get_group(mode: ParallelMode | str) -> Any:
            return groups[mode]

        def get_cpu_group(mode: ParallelMode | str) -> Any:
            return cpu_groups[mode]

        for fast in (get_local_rank, get_world_size, get_group, get_cpu_group):
            documented = getattr(ParallelContext, fast.__name__)
            fast.__doc__ = documented.__doc__
            fast.__qualname__ = documented.__qualname__
            fast.__module__ = documented.__module__
            setattr(self, fast.__name__, fast)
        self._first_stage: bool | None = None
        self._last_stage: bool | None = None
        self._views: dict[ParallelMode, ModeView] = {}
        self._group_calls = 0
        self._hostnames: tuple[str, ...] = ()
        self._streams: RNGStreams | None = None
        self._seed: int | None = None
        self._device = torch.device("cpu")
        self._device_meshes: dict[str, Any] = {}
        self._destroy_hooks: list[Callable[[], None]] = []
        # For abort(): the launch's store (under its agreed prefix), this process's TCP listeners
        # before the groups were made, and the gloo listeners the launch added.
        self._launch_kv: Any = None
        self._listen_before: frozenset[int] | None = None
        # Groups parallelctx made after launch (the Megatron bridge's): abort() covers them too.
        self._later_groups: list[Any] = []
        self._listeners: list[_abort.Endpoint] = []
        # Socket inode -> (rank in group, group size) of each gloo group's listener, for abort().
        self._sockets: dict[int, tuple[int, int]] = {}
        # Socket inodes seen when the last group was noted (or when the bridge began making
        # groups, _start_notes): a later group's listener is one not among them, so a user's
        # server opened after launch and before install() is not taken for one.
        self._noted: frozenset[int] = frozenset()
        self._hang: _hang.HangWatch | None = None  # dist.hang_report, while launched
        for name in VIEW_NAMES.values():
            setattr(self, name, Unlaunched(name))

    def _not_launched(self, what: str) -> NotLaunchedError:
        return NotLaunchedError(f"{what} is not available yet: {LAUNCH_HINT}")

    def _bad_mode(self, mode: Any, what: str) -> Exception:
        if not self._views and self._layout is None:
            return self._not_launched(what)
        parsed = ParallelMode.parse(mode)  # raises for an unknown mode
        if self._layout is not None and parsed not in self._views and self._views:
            return NotLaunchedError(
                f"global rank {self._global_rank} belongs to no {parsed.value} group "
                f"(only the first and last of {self._layout.pipeline} pipeline stages do)"
            )
        return self._not_launched(what)

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
        """Set up this context: config, default group, parallel groups, processes per node,
        device and seeds; on any failure, tear down what was made and re-raise
        (the sequence: :func:`parallelctx.startup.launch`).

        ``simulate=dict(world_size=W, rank=R[, nproc_per_node=G])`` makes this process a dry
        run of rank R of a W-rank job on torch's ``fake`` backend (no other process, no store;
        collectives return at once, their results are not real; ``rank``, ``world_size``,
        ``host`` and ``port`` are then ignored): see :mod:`parallelctx.dryrun`.

        The arguments are checked first (:func:`parallelctx.args.validate_launch_args`).
        ``backend``, ``seed``, ``timeout`` and ``init_method`` left at None take the config's
        ``dist`` and ``seed`` values (resolved there, nowhere else). ``local_world_size``, when
        the launcher gives it, is checked against the processes counted on this host; a
        mismatch is logged as a warning. Logs one summary line on the rank
        :meth:`is_rank_for_log` picks.

        Returns:
            This context.

        Raises:
            RuntimeError: already launched (call :meth:`destroy` first).
            RendezvousError: (a RuntimeError, :mod:`parallelctx.rendezvous`) a rank did not
                arrive within the timeout, the store did not answer or its port is taken, another
                rank refused to launch, or the ranks were launched with different settings; raised
                on every rank, naming the ranks, host:port and the keys that differ.
            LaunchArgumentError: a bad argument (a ValueError and a TypeError; the message
                names it).
            ValueError: a bad config value (ConfigError, LayoutError and pydantic's
                ValidationError are ValueErrors).
        """
        return startup.launch(
            self, config, rank, world_size, host, port, backend, local_rank, seed, timeout, init_method,
            local_world_size, simulate,
        )  # fmt: skip

    def load_config(self, config: Config | Mapping[str, Any] | str | Path | None) -> Config:
        """Validate and store the config (a Config, a dict, a file path, or None).

        Returns:
            The stored :class:`Config`.

        Raises:
            ConfigError, pydantic.ValidationError: see :func:`parallelctx.config.load_config`.
        """
        self._config = load_config(config)
        return self._config

    @property
    def config(self) -> Config:
        """The validated config. Raises NotLaunchedError before :meth:`load_config`."""
        if self._config is None:
            raise self._not_launched("gpc.config")
        return self._config

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
        """Initialise (or adopt) the default process group.

        ``backend="auto"`` picks nccl where CUDA is available, else gloo. Ranks meet at
        ``init_method`` when given (``tcp://``, ``env://``, ``file://``), else at
        ``tcp://host:port``; a world of one needs neither. If torch.distributed is already
        initialised with the same rank and world size, that group is adopted and left alone by
        :meth:`destroy`.

        Every rank first meets every other on the store and exchanges ``arrival`` (host name and
        the values all ranks must agree on); relaunching in the same processes works. How:
        :func:`parallelctx.startup.init_default_group`.

        Raises:
            ValueError: a bad rank, world size, backend or port (the message names the value).
            RuntimeError: torch.distributed is initialised with another rank or world size.
            RendezvousError: (a RuntimeError) a rank did not arrive within ``timeout``, the
                store did not answer or its port is taken, or the ranks disagree; the message
                names the ranks, host:port and the differing keys.
        """
        timeout = timeout or (self._config.dist.timeout if self._config else DEFAULT_TIMEOUT)
        made = startup.init_default_group(
            self._meetings, rank, world_size, backend, host, port, timeout, init_method, arrival
        )
        self._owns_default_group = made.owned
        self._launch_kv, self._listen_before = made.store, made.listening
        if made.owned and world_size > 1:  # the default group's listener, for abort()
            self._sockets.update((inode, (rank, world_size)) for inode in _abort.listening(made.listening))
        self._hostnames = made.hostnames or self._hostnames
        self._global_rank = rank
        self._world_size = world_size
        self._backend = made.backend
        self._timeout = made.timeout
        self._local_ranks[ParallelMode.GLOBAL] = rank
        self._world_sizes[ParallelMode.GLOBAL] = world_size

    def init_parallel_groups(self) -> Layout:
        """Build the layout from the config's sizes and create this rank's process groups
        (:func:`parallelctx.startup.make_groups`), then fill the query tables and views.

        Returns:
            The :class:`Layout`.

        Raises:
            NotLaunchedError: :meth:`init_global_dist` has not run.
            LayoutError: the configured sizes do not fit the world size.
        """
        if self._world_size == 0 or self._backend is None:
            raise self._not_launched("init_parallel_groups()")
        layout = self.config.parallel.to_layout(self._world_size)
        default = startup.DefaultGroup(
            self._backend, self._owns_default_group, self._timeout or self.config.dist.timeout, ()
        )
        groups, self._group_calls = startup.make_groups(
            self._meetings,
            layout,
            self._global_rank,
            default,
            self.config.dist.gloo_lazy_init,
            sockets=self._sockets,
        )
        self._layout = layout
        for mode, g in groups.items():
            self._install(mode, g)
        pipe = self._views[ParallelMode.PIPELINE]
        self._first_stage, self._last_stage = pipe.is_first, pipe.is_last
        return layout

    def _install(self, mode: ParallelMode, g: ModeGroup) -> None:
        """Answer ``mode``'s queries from group ``g``."""
        local, size = g.ranks.index(self._global_rank), len(g.ranks)
        view = ModeView(
            mode=mode,
            rank=local,
            size=size,
            ranks=g.ranks,
            group=g.group,
            cpu_group=g.cpu_group,
            next_rank=g.ranks[(local + 1) % size],
            prev_rank=g.ranks[(local - 1) % size],
        )
        self._views[mode] = view
        self._local_ranks[mode] = local
        self._world_sizes[mode] = size
        self._groups[mode] = g.group
        self._cpu_groups[mode] = g.cpu_group
        setattr(self, VIEW_NAMES[mode], view)

    def set_device(self, local_rank: int | None = None) -> torch.device:
        """Pick this process's device: ``cuda:(local_rank % device_count)`` where CUDA is
        available, else the CPU. ``local_rank`` defaults to the launcher's local rank.

        Returns:
            The chosen :class:`torch.device`.

        Raises:
            ValueError: CUDA is available but no local rank is known.
        """
        if local_rank is not None:
            self._local_rank = local_rank
        self._device = startup.pick_device(self._local_rank)
        return self._device

    def detect_num_processes_on_current_node(self) -> int:
        """Count the ranks that share this rank's host name: the names the launch rendezvous
        gathered, else one all-gather over the CPU group.

        Also fills :attr:`num_nodes`, :attr:`node_rank` and, when the launcher gave none,
        the local rank.

        Returns:
            The number of processes on this node.

        Raises:
            NotLaunchedError: before :meth:`init_parallel_groups`.
            RuntimeError: a peer does not answer within the timeout.
        """
        if ParallelMode.GLOBAL not in self._views:
            raise self._not_launched("detect_num_processes_on_current_node()")
        self._hostnames = startup.host_names(
            self._hostnames, self._world_size, self._cpu_groups[ParallelMode.GLOBAL]
        )
        host = self._hostnames[self._global_rank]
        same = [r for r, name in enumerate(self._hostnames) if name == host]
        if self._local_rank is None:
            self._local_rank = same.index(self._global_rank)
        return len(same)

    def set_seed(self, seed: int | None = None) -> None:
        """Seed Python, numpy and torch and register one RNG stream per mode, and the
        ``"replica"`` stream (different across data-parallel replicas).

        ``seed`` defaults to the config's. The per-mode formula is in :mod:`parallelctx.seed`.

        Raises:
            NotLaunchedError: before :meth:`init_parallel_groups`.
            ValueError: ``seed`` outside ``[0, 2**32)``.
        """
        if self._layout is None:
            raise self._not_launched("set_seed()")
        base = self.config.seed if seed is None else seed
        if isinstance(base, bool) or not isinstance(base, int) or not 0 <= base < 2**32:
            raise ValueError(f"seed={base!r} must be an integer in [0, 2**32)")
        seeds = {key: mode_seed(self._layout, self._global_rank, key, base) for key in STREAMS}
        self._streams = RNGStreams(seeds, cuda=self._device.type == "cuda")
        self._seed = base

    def on_hang(self, handler: Callable[[_hang.HangReport], Any]) -> Callable[[_hang.HangReport], Any]:
        """Call ``handler(report)`` when a collective on one of gpc's groups has waited longer
        than ``dist.hang_report.after`` (config ``dist.hang_report=dict(after=SECONDS)``; off
        by default, when nothing is watched). ``report`` is a :class:`parallelctx.HangReport`:
        ``.mode``, ``.op``, ``.call``, ``.missing`` (sorted global ranks that never entered the
        call), ``.mismatched`` (ranks that entered another call). Every waiting rank calls its
        handlers once per hung call, in the watching thread; a handler may call :meth:`abort`.
        Handlers are kept across :meth:`destroy` and relaunches; one handler is kept once.

        Returns:
            ``handler`` (so that it can serve as a decorator).

        Raises:
            TypeError: ``handler`` is not callable.
        """
        if not callable(handler):
            raise TypeError(f"on_hang takes a function of one argument (the report), not {handler!r}")
        if handler not in self._hang_handlers:
            self._hang_handlers.append(handler)
        return handler

    def _start_hang_watch(self) -> None:
        """Start the hang report of this launch when ``dist.hang_report`` asks for it (and the
        world has more than one rank and a store); returns None."""
        settings = self._config.dist.hang_report if self._config is not None else None
        if settings is None or self._world_size < 2 or self._launch_kv is None or self._hang is not None:
            return
        watched: dict[int, tuple[Any, list[ParallelMode], bool, tuple[int, ...]]] = {}
        for mode, view in self._views.items():
            for group, cpu in ((view.group, False), (view.cpu_group, True)):
                if id(group) in watched:
                    if mode not in watched[id(group)][1]:
                        watched[id(group)][1].append(mode)
                else:
                    watched[id(group)] = (
                        group,
                        [mode],
                        cpu and view.cpu_group is not view.group,
                        tuple(view.ranks),
                    )
        try:
            store = self._launch_kv.clone()
        except Exception:
            store = self._launch_kv
        watch: _hang.HangWatch | None = None

        def abort_this_launch() -> int:
            with self._abort_lock:
                return self.abort() if watch is not None and self._hang is watch else 0

        watch = self._hang = _hang.HangWatch(
            settings.after,
            self._global_rank,
            store,
            [
                (g, tuple(sorted(m, key=list(ParallelMode).index)), cpu, r)
                for g, m, cpu, r in watched.values()
            ],
            self._hang_handlers,
            log=settings.log,
            aborter=abort_this_launch,
        )
        watch.start()

    def add_destroy_hook(self, hook: Callable[[], None]) -> None:
        """Have :meth:`destroy` call ``hook()`` first, while the groups still exist (hooks run
        last-added first; one hook is kept once however often it is added). The hooks are
        forgotten by that destroy: add them again after the next launch.

        Raises:
            TypeError: ``hook`` is not callable.
        """
        if not callable(hook):
            raise TypeError(f"add_destroy_hook takes a function of no arguments, not {hook!r}")
        if hook not in self._destroy_hooks:
            self._destroy_hooks.append(hook)

    def _post_listeners(self, mine: dict[int, _abort.Endpoint] | None = None) -> None:
        """Note the gloo listeners this launch added (``mine``: already read) and post them on
        the launch's store, where :meth:`abort` on the other ranks finds them (one store write,
        no wait)."""
        if self._listen_before is None or self._world_size < 2:
            return
        if mine is None:
            mine = _abort.listening(self._listen_before)
        self._listeners = sorted(mine.values())
        if self._launch_kv is not None:
            _abort.post_listeners(self._launch_kv, self._global_rank, self._listeners)

    def _start_notes(self) -> None:
        """Note every socket held now, before parallelctx makes groups after launch (the
        Megatron bridge's): :meth:`_note_group` takes only listeners opened since for a group's."""
        if self._listen_before is not None:
            self._noted = _abort.socket_inodes()

    def _note_group(self, group: Any) -> None:
        """Have :meth:`abort` cover ``group``, made by parallelctx after launch (the Megatron
        bridge's groups): its gloo listener is posted for the other ranks at once."""
        self._later_groups.append(group)
        if self._listen_before is None:
            return
        mine = _abort.listening(self._listen_before)  # one scan: this group's listener, and all
        if isinstance(group, torch.distributed.ProcessGroup) and group.size() > 1:
            # Only listeners opened since the last group was noted (or since _start_notes): not
            # a user's server opened after launch, which wake() must not connect to.
            for inode in mine.keys() - self._noted - self._sockets.keys():
                self._sockets[inode] = (group.rank(), group.size())
        self._noted = self._noted | mine.keys()
        self._post_listeners(mine)

    def abort(self, timeout: float = 2.0) -> int:
        """Abort every process group this context made, from any thread (a watchdog), without
        waiting on a collective that hangs: NCCL groups through ``ProcessGroup.abort()``, gloo
        groups (which do not implement it) by shutting down their TCP connections
        (:mod:`parallelctx.abort`). A collective pending in another thread then raises a
        ``RuntimeError`` from torch within milliseconds, and so do the peers' collectives on the
        other end of those connections. Then call :meth:`destroy` (in the thread that ran the
        collective) and launch again: the relaunch meets under a new key prefix, with the same
        processes or with some of them replaced.

        ``timeout`` (seconds) bounds the read of the other ranks' gloo listeners from the
        launch's store; when it does not answer in time, only this rank's listeners are used.
        During a launch (from another thread), the launch stops at its next call to the
        rendezvous store (within 0.25 s) and raises :class:`parallelctx.abort.LaunchAborted`.
        Before launch or after :meth:`destroy` it finds nothing else to do; a second call is
        harmless.

        Returns:
            The number of gloo connections shut down.

        Raises:
            Nothing: a group that fails to abort is logged and the others are still aborted.
        """
        with self._abort_lock:
            self._meetings.aborted.set()  # a launch under way stops at its next store call
            groups = [*self._groups.values(), *self._cpu_groups.values(), *self._later_groups]
            if not any(g is not None for g in groups):
                return 0
            return self._abort_groups(groups, timeout)

    def _abort_groups(self, groups: list[Any], timeout: float) -> int:
        """The work of :meth:`abort` once groups exist; returns the connections shut down."""
        _abort.abort_groups(groups, self._owns_default_group)
        # This rank's own listeners first (no store needed): wake the pairs that wait for a peer
        # that never connected, and shut down the connections made; then the peers' listeners.
        mine = _abort.listening()
        if self._listen_before is not None:  # groups made later included
            self._listeners = sorted(e for i, e in mine.items() if i not in self._listen_before)
        woken = {mine[i]: where for i, where in self._sockets.items() if i in mine}
        _abort.wake(woken)
        shut = _abort.shut_down(self._listeners)
        peers: list[_abort.Endpoint] | None = []
        if self._launch_kv is not None:
            peers = _abort.read_listeners(self._launch_kv, self._global_rank, self._world_size, timeout)
        if peers is None:
            logger.warning(
                "parallelctx: abort could not read the other ranks' gloo listeners from the launch's "
                "store (no answer within %g s, or a store that cannot be cloned); only the "
                "connections to this rank's listeners are shut down",
                timeout,
            )
        return shut + _abort.shut_down([*self._listeners, *(peers or [])])

    def destroy(self) -> None:
        """Run the destroy hooks (:meth:`add_destroy_hook`), tear down every group parallelctx
        made (and the default group when it made that), and reset every cached rank, size, seed
        and the config. ``launch`` works again after. Safe to call twice or before launch.

        Raises:
            The first exception a hook raised, after the teardown has finished.
        """
        failed: BaseException | None = None
        for hook in reversed(self._destroy_hooks):
            try:
                hook()
            except BaseException as exc:  # every hook runs, and the teardown still happens
                logger.exception("parallelctx: destroy hook %r failed", hook)
                failed = failed or exc
        self._destroy_hooks = []
        watch, self._hang = self._hang, None
        if watch is not None:
            watch.stop()
        with self._abort_lock:
            try:
                startup.tear_down(
                    self._owns_default_group, [*self._groups.values(), *self._cpu_groups.values()]
                )
            finally:
                self._reset()
        if failed is not None:
            raise failed

    # ------------------------------------------------------------------ queries (hot path)
    def get_global_rank(self) -> int:
        """Return this process's global rank. Raises NotLaunchedError before launch."""
        if self._global_rank < 0:
            raise self._not_launched("get_global_rank()")
        return self._global_rank

    def get_local_rank(self, mode: ParallelMode | str) -> int:
        """Return this rank's index in its group of ``mode`` (0 for a mode of size 1).

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._local_ranks[mode]

    def get_world_size(self, mode: ParallelMode | str) -> int:
        """Return the size of this rank's group of ``mode`` (1 for an unused axis).

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._world_sizes[mode]

    def get_group(self, mode: ParallelMode | str) -> Any:
        """Return this rank's process group of ``mode`` (for a mode of size 1, a one-rank group
        of this rank, never None, which torch would read as the whole world).

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._groups[mode]

    def get_cpu_group(self, mode: ParallelMode | str) -> Any:
        """Return the CPU (gloo) group beside ``mode``'s group; the group itself with gloo (a
        one-rank group for a mode of size 1).

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._cpu_groups[mode]

    def _view(self, mode: ParallelMode | str, what: str) -> ModeView:
        try:
            return self._views[mode]  # type: ignore[index]  # a plain name finds its mode: equal hashes
        except KeyError:
            pass
        try:  # an alias or another case ("tp", "TENSOR")
            return self._views[ParallelMode.parse(mode)]
        except (KeyError, LayoutError):
            raise self._bad_mode(mode, what) from None

    def get_ranks_in_group(self, mode: ParallelMode | str) -> list[int]:
        """Return the ascending global ranks of this rank's group of ``mode`` (a new list).

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return list(self._view(mode, "get_ranks_in_group()").ranks)

    def is_initialized(self, mode: ParallelMode | str) -> bool:
        """Return True when this rank has a (possibly size-1) group of ``mode``.

        Raises:
            LayoutError: ``mode`` is not a parallel mode.
        """
        if mode in self._views:
            return True
        parsed = ParallelMode.parse(mode)
        if parsed is ParallelMode.GLOBAL:
            return self._global_rank >= 0
        return parsed in self._views

    def is_first_rank(self, mode: ParallelMode | str) -> bool:
        """Return True when this rank is first (local rank 0) in its group of ``mode``."""
        return self._view(mode, "is_first_rank()").rank == 0

    def is_last_rank(self, mode: ParallelMode | str) -> bool:
        """Return True when this rank is last in its group of ``mode``."""
        view = self._view(mode, "is_last_rank()")
        return view.rank == view.size - 1

    def is_pipeline_first_stage(self) -> bool:
        """Return True on the first pipeline stage. Raises NotLaunchedError before launch."""
        if self._first_stage is None:
            raise self._not_launched("is_pipeline_first_stage()")
        return self._first_stage

    def is_pipeline_last_stage(self) -> bool:
        """Return True on the last pipeline stage. Raises NotLaunchedError before launch."""
        if self._last_stage is None:
            raise self._not_launched("is_pipeline_last_stage()")
        return self._last_stage

    def get_next_global_rank(self, mode: ParallelMode | str) -> int:
        """Return the global rank after this one in its group of ``mode``, wrapping around."""
        return self._view(mode, "get_next_global_rank()").next_rank

    def get_prev_global_rank(self, mode: ParallelMode | str) -> int:
        """Return the global rank before this one in its group of ``mode``, wrapping around."""
        return self._view(mode, "get_prev_global_rank()").prev_rank

    def is_rank_for_log(self) -> bool:
        """Return True on the one rank that logs: first in its tensor, context and data groups,
        on the last pipeline stage (where the loss is)."""
        return (
            self.is_first_rank(ParallelMode.TENSOR)
            and self.is_first_rank(ParallelMode.CONTEXT)
            and self.is_first_rank(ParallelMode.DATA)
            and self.is_pipeline_last_stage()
        )

    # ------------------------------------------------------------------ node, device, seeds
    @property
    def num_processes_on_current_node(self) -> int:
        """Ranks on this rank's host. Raises NotLaunchedError before detection."""
        if not self._hostnames:
            raise self._not_launched("gpc.num_processes_on_current_node")
        host = self._hostnames[self._global_rank]
        return sum(1 for name in self._hostnames if name == host)

    @property
    def num_nodes(self) -> int:
        """Distinct hosts in the job. Raises NotLaunchedError before detection."""
        if not self._hostnames:
            raise self._not_launched("gpc.num_nodes")
        return len(set(self._hostnames))

    @property
    def node_rank(self) -> int:
        """Index of this host among the job's hosts, ordered by their lowest global rank."""
        if not self._hostnames:
            raise self._not_launched("gpc.node_rank")
        order = list(dict.fromkeys(self._hostnames))
        return order.index(self._hostnames[self._global_rank])

    @property
    def hostnames(self) -> tuple[str, ...]:
        """The host name of every global rank, in rank order."""
        if not self._hostnames:
            raise self._not_launched("gpc.hostnames")
        return self._hostnames

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (the launcher's, else derived from host names)."""
        if self._local_rank is None:
            raise self._not_launched("gpc.local_rank")
        return self._local_rank

    @property
    def device(self) -> torch.device:
        """The device :meth:`set_device` picked (the CPU until then)."""
        return self._device

    @property
    def backend(self) -> str:
        """The default group's backend, e.g. ``"gloo"`` or ``"nccl"``."""
        if self._backend is None:
            raise self._not_launched("gpc.backend")
        return self._backend

    @property
    def layout(self) -> Layout:
        """The rank :class:`Layout` of this world."""
        if self._layout is None:
            raise self._not_launched("gpc.layout")
        return self._layout

    @property
    def dry_run(self) -> Any:
        """The :class:`parallelctx.dryrun.DryRun` this process records when it is a dry run
        (``launch(simulate=...)`` or ``parallelctx dry-run``), else None. It outlives
        :meth:`destroy`, so the report is complete at exit, until the next real launch (which
        sets it to None); each ``simulate=`` launch starts a new one."""
        return self._dry_run

    @property
    def group_creations(self) -> int:
        """How many ``new_group`` calls this rank made in :meth:`init_parallel_groups`."""
        return self._group_calls

    @property
    def device_mesh(self) -> Any:
        """A ``torch.distributed.device_mesh.DeviceMesh`` over the dense axes (``pp``, ``dp``,
        ``cp``, ``tp``, size 1 included), built once from the process groups parallelctx
        already made (see :mod:`parallelctx.mesh`).

        Raises:
            NotLaunchedError: before launch.
        """
        return self._mesh("dense")

    @property
    def expert_device_mesh(self) -> Any:
        """The ``DeviceMesh`` of the expert grid (``pp``, ``edp``, ``ep``, ``etp``), built once
        from the expert groups.

        Raises:
            NotLaunchedError: before launch.
        """
        return self._mesh("expert")

    def _mesh(self, grid: str) -> Any:
        if self._layout is None:
            raise self._not_launched("gpc.device_mesh" if grid == "dense" else "gpc.expert_device_mesh")
        if grid not in self._device_meshes:
            from .runtime.mesh import build_device_mesh

            self._device_meshes[grid] = build_device_mesh(
                self._layout, self._global_rank, self._groups, self._device.type, grid
            )
        return self._device_meshes[grid]

    def get_seed(self, mode: Stream) -> int:
        """Return the seed of ``mode``'s RNG stream on this rank (``mode`` may also be
        ``"replica"``).

        Raises:
            NotLaunchedError: before :meth:`set_seed`.
            LayoutError: ``mode`` names no stream.
        """
        if self._streams is None:
            raise self._not_launched("get_seed()")
        return self._streams.seeds[parse_stream(mode)]

    @contextlib.contextmanager
    def seed(self, mode: Stream) -> Iterator[None]:
        """``with gpc.seed(mode):`` runs the body on ``mode``'s RNG stream (CPU and CUDA
        generators) and switches back after; the stream resumes where it stopped.
        ``gpc.seed("replica")`` enters the stream that differs across data-parallel replicas.

        Raises:
            NotLaunchedError: before :meth:`set_seed`.
            LayoutError: ``mode`` names no stream.
        """
        if self._streams is None:
            raise self._not_launched("gpc.seed()")
        with self._streams.fork(parse_stream(mode)):
            yield

    @property
    def rng_streams(self) -> RNGStreams:
        """The per-mode :class:`~parallelctx.seed.RNGStreams` (what :func:`parallelctx.checkpoint`
        saves and restores). Raises NotLaunchedError before :meth:`set_seed`."""
        if self._streams is None:
            raise self._not_launched("gpc.rng_streams")
        return self._streams

    def get_rng_state(self) -> RNGState:
        """Return every RNG stream of this rank: Python's ``random``, numpy's global generator,
        the default torch generators (CPU, and CUDA where used) and each mode's stream.

        The result pickles; save it with a training checkpoint (one per rank) and give it to
        :meth:`set_rng_state` to resume with the same dropout masks.

        Returns:
            An :class:`RNGState`.

        Raises:
            NotLaunchedError: before :meth:`set_seed`.
        """
        seed = self._seed if self._seed is not None else -1
        return capture(self.rng_streams, self._global_rank, self._world_size, self.layout.describe(), seed)

    def set_rng_state(self, state: RNGState) -> None:
        """Restore every stream from ``state`` (see :meth:`get_rng_state`); may be called
        inside ``with gpc.seed(...)`` blocks, which keep running on their own stream.

        Raises:
            NotLaunchedError: before :meth:`set_seed`.
            TypeError: ``state`` is not an :class:`RNGState`.
            ValueError: ``state`` was taken on another rank, world size or layout, or with CUDA
                state where this rank has none (or the reverse); the message says which.
        """
        restore(state, self.rng_streams, self._global_rank, self._world_size, self.layout.describe())

    def summary(self) -> str:
        """Return the one-line launch summary."""
        return (
            f"parallelctx: {self.layout.describe()} backend={self._backend} "
            f"nodes={self.num_nodes} procs/node={self.num_processes_on_current_node} "
            f"seed={self.config.seed} groups made on this rank={self._group_calls}"
        )


gpc: ParallelContext = ParallelContext()
"""The global parallel context: the one instance of :class:`ParallelContext`."""
