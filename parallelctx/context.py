"""The parallel context: the state behind ``gpc`` and every query model code makes.

Queries answer from plain dicts and attributes filled once at launch, so a call such as
``gpc.get_local_rank(ParallelMode.TENSOR)`` never calls into torch.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .args import LaunchArgumentError, validate_launch_args
from .config import DEFAULT_TIMEOUT, Config, check_init_method_env, load_config
from .groups import create_groups
from .layout import Layout, ParallelMode
from .rendezvous import Arrival, RendezvousError, connect_store, exchange
from .seed import STREAMS, RNGSnapshot, RNGStreams, Stream, mode_seed, parse_stream

__all__ = ["ModeView", "NotLaunchedError", "ParallelContext", "RNGState", "gpc"]

logger = logging.getLogger("parallelctx")

_LAUNCH_HINT = (
    "call parallelctx.launch_from_torch(config) (or launch, launch_from_env, launch_from_slurm, "
    "launch_from_openmpi, spawn) first"
)


_CPU_BACKENDS = frozenset({"gloo", "mpi", "fake"})


class NotLaunchedError(RuntimeError):
    """A query was made before the context was launched, or after ``destroy()``."""


@dataclass(frozen=True, slots=True)
class ModeView:
    """This rank's place in one mode, e.g. ``gpc.tensor``.

    ``rank`` is the local rank in the mode, ``size`` the group size, ``ranks`` the ascending
    global ranks of the group, ``group``/``cpu_group`` the process groups (a one-rank group of
    this rank for a mode of size 1, never None),
    ``next_rank``/``prev_rank`` the global ranks after and before this one in ring order.
    """

    mode: ParallelMode
    rank: int
    size: int
    ranks: Sequence[int]
    group: Any
    cpu_group: Any
    next_rank: int
    prev_rank: int

    @property
    def is_first(self) -> bool:
        """True on the group's first rank."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """True on the group's last rank."""
        return self.rank == self.size - 1


@dataclass(frozen=True)
class RNGState:
    """Every RNG stream of one rank, from :meth:`ParallelContext.get_rng_state`; picklable.

    ``rank``, ``world_size`` and ``layout`` (the layout's description) say where it was taken;
    :meth:`ParallelContext.set_rng_state` refuses it anywhere else.
    """

    rank: int
    world_size: int
    layout: str
    seed: int
    python: Any
    numpy: Any
    streams: RNGSnapshot


class _ModeTable(dict[Any, Any]):
    """A per-mode answer table; a lookup that misses raises the context's clear error."""

    __slots__ = ("_miss",)

    def __init__(self, miss: Callable[[Any], Exception]) -> None:
        super().__init__()
        self._miss = miss

    def __missing__(self, mode: Any) -> Any:
        raise self._miss(mode)


class _Unlaunched:
    """Stands in for a :class:`ModeView` before launch; every attribute raises."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise NotLaunchedError(f"gpc.{self._name}.{attr} is not available yet: {_LAUNCH_HINT}")

    def __repr__(self) -> str:
        return f"<gpc.{self._name}: not launched>"


# Attribute name of each mode's view on the context: gpc.tensor, gpc.world, ...
VIEW_NAMES: dict[ParallelMode, str] = {
    mode: ("world" if mode is ParallelMode.GLOBAL else mode.value) for mode in ParallelMode
}


class ParallelContext:
    """The parallel context of this process. Use the one instance, ``parallelctx.gpc``.

    Lifecycle: :meth:`launch` (what every ``launch*`` function ends in) calls, in this order,
    :meth:`load_config`, :meth:`init_global_dist`, :meth:`init_parallel_groups`,
    :meth:`detect_num_processes_on_current_node`, :meth:`set_device`, :meth:`set_seed`, and
    :meth:`destroy` when any of them fails; :meth:`destroy` undoes all.
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

    def __init__(self) -> None:
        # Names of the groups made on a default group parallelctx adopted; kept across destroy()
        # so that relaunching on the same default group cannot reuse them (see groups._claim_name).
        self._adopted_names: tuple[Any, set[tuple[Sequence[int], int]]] = (None, set())
        # Rendezvous stores by URL, kept across destroy() so that a relaunch on the same host
        # and port reuses rank 0's store server; each launch meets under its own key prefix.
        self._stores: dict[tuple[str, int, int], Any] = {}
        self._launches = 0
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
        self._local_ranks = _ModeTable(lambda m: self._bad_mode(m, "get_local_rank()"))
        self._world_sizes = _ModeTable(lambda m: self._bad_mode(m, "get_world_size()"))
        self._groups = _ModeTable(lambda m: self._bad_mode(m, "get_group()"))
        self._cpu_groups = _ModeTable(lambda m: self._bad_mode(m, "get_cpu_group()"))
        # Hot path: these four queries are closures over their tables, stored on the instance, so a
        # call costs one Python frame and one dict lookup (no bound-method object, no self lookup).
        # The methods of the same names below carry the documentation and the signatures (the
        # same keyword, ``mode``); a miss raises the same clear errors.
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

        self.get_local_rank = get_local_rank  # type: ignore[method-assign]
        self.get_world_size = get_world_size  # type: ignore[method-assign]
        self.get_group = get_group  # type: ignore[method-assign]
        self.get_cpu_group = get_cpu_group  # type: ignore[method-assign]
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
        for name in VIEW_NAMES.values():
            setattr(self, name, _Unlaunched(name))

    def _not_launched(self, what: str) -> NotLaunchedError:
        return NotLaunchedError(f"{what} is not available yet: {_LAUNCH_HINT}")

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
    ) -> ParallelContext:
        """Set up this context: config, default group, parallel groups, processes per node,
        device and seeds; on any failure, tear down what was made and re-raise.

        The arguments are checked first (:func:`parallelctx.args.validate_launch_args`).
        ``backend``, ``seed``, ``timeout`` and ``init_method`` left at None take the config's
        ``dist`` and ``seed`` values (resolved here, nowhere else). ``local_world_size``, when
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
        if self._global_rank >= 0:
            raise RuntimeError("parallelctx is already launched in this process; call gpc.destroy() first")
        # Local checks first. A rank whose checks fail but that can still reach the others (its
        # rank, world size and address are valid) tells them at the rendezvous, so that every
        # rank stops at once instead of waiting for it until the timeout.
        refused: BaseException | None = None
        cfg: Config | None = None
        try:
            cfg = self.load_config(config)
        except (ValueError, TypeError) as exc:
            refused = exc
        method = init_method or (cfg.dist.init_method if cfg is not None else None)
        need_address = not dist.is_initialized()  # an existing default group is adopted
        try:
            args = validate_launch_args(
                rank=rank,
                world_size=world_size,
                host=host,
                port=port,
                local_rank=local_rank,
                local_world_size=local_world_size,
                timeout=timeout,
                seed=seed,
                backend=backend,
                init_method=method,
                need_address=need_address,
            )
        except LaunchArgumentError as exc:
            args = self._reachable_args(rank, world_size, host, port, timeout, method, need_address, exc)
            refused = refused or exc
        layout: Layout | None = None
        if refused is None and cfg is not None:
            try:
                layout = cfg.parallel.to_layout(args.world_size)
            except (ValueError, TypeError) as exc:
                refused = exc
        wait = args.timeout or (cfg.dist.timeout if cfg is not None else DEFAULT_TIMEOUT)
        use_seed = args.seed if args.seed is not None else (cfg.seed if cfg is not None else None)
        if refused is not None or cfg is None or layout is None:
            refused = refused or RuntimeError("the config did not load")
            arrival = Arrival(args.rank, socket.gethostname(), error=f"{type(refused).__name__}: {refused}")
        else:
            values = _agreed_values(cfg, layout, args.world_size, args.backend, wait, use_seed)
            arrival = Arrival(args.rank, socket.gethostname(), values)
        try:
            self._local_rank = args.local_rank
            check_init_method_env(args.init_method)
            if cfg is None or layout is None:
                self._announce_refusal(args, wait, arrival)
                raise refused or RuntimeError("the config did not load")
            self.init_global_dist(
                args.rank,
                args.world_size,
                backend=args.backend or cfg.dist.backend,
                host=args.host,
                port=args.port,
                timeout=wait,
                init_method=args.init_method,
                arrival=arrival,
            )
            self.init_parallel_groups()
            on_node = self.detect_num_processes_on_current_node()
            self.set_device()
            self.set_seed(use_seed)
        except BaseException:
            self.destroy()
            raise
        if args.local_world_size is not None and args.local_world_size != on_node:
            logger.warning(
                "the launcher says %d processes run on this node, but %d ranks share host %r; "
                "check the launcher's host list and the per-node process count",
                args.local_world_size,
                on_node,
                socket.gethostname(),
            )
        if self.is_rank_for_log():
            logger.info(self.summary())
        return self

    @staticmethod
    def _reachable_args(
        rank: Any,
        world_size: Any,
        host: Any,
        port: Any,
        timeout: Any,
        method: Any,
        need_address: bool,
        refused: LaunchArgumentError,
    ) -> Any:
        """The arguments this rank needs to reach the others although another argument was bad;
        raises ``refused`` when even these are bad (the rank cannot tell anyone)."""
        for wait in (timeout, None):
            try:
                return validate_launch_args(
                    rank=rank,
                    world_size=world_size,
                    host=host,
                    port=port,
                    timeout=wait,
                    init_method=method,
                    need_address=need_address,
                )
            except LaunchArgumentError:
                continue
        raise refused

    def _announce_refusal(self, args: Any, timeout: timedelta, arrival: Arrival) -> None:
        """Post this rank's failed checks at the rendezvous so that every other rank stops at
        once; a rendezvous that fails too is only logged (the caller raises the first cause)."""
        if args.world_size == 1 or dist.is_initialized():
            return
        url = _url(args.init_method, args.host, args.port)
        try:
            store = self._launch_store(
                url, args.rank, args.world_size, timeout, time.monotonic() + timeout.total_seconds()
            )
            exchange(store, arrival, args.world_size, timeout, _shown_url(url))
        except (RendezvousError, RuntimeError) as exc:
            logger.warning(
                "parallelctx: could not tell the other ranks that rank %d refused to launch: %s",
                args.rank,
                exc,
            )

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

        Relaunching in the same processes works: the rendezvous store of a URL is kept across
        :meth:`destroy` (under torchrun it is the launcher's own store) and every launch meets
        under its own key prefix, ``parallelctx/launch-<n>``, where ``n`` counts this process's
        launches. Every rank must therefore launch the same number of times.

        Before the default group is made, every rank meets every other on the store in one
        round trip (:func:`parallelctx.rendezvous.exchange`): each posts ``arrival`` (its host
        name and the values all ranks must agree on; :meth:`launch` passes them) and reads the
        others'. A rank that does not arrive within ``timeout`` is named, and so are ranks that
        disagree. The host names serve :meth:`detect_num_processes_on_current_node`.

        Raises:
            ValueError: a bad rank, world size, backend or port (the message names the value).
            RuntimeError: torch.distributed is initialised with another rank or world size.
            RendezvousError: (a RuntimeError) a rank did not arrive within ``timeout``, the
                store did not answer or its port is taken, or the ranks disagree; the message
                names the ranks, host:port and the differing keys.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        backend = resolve_backend(backend)
        timeout = timeout or (self._config.dist.timeout if self._config else DEFAULT_TIMEOUT)
        if dist.is_initialized():
            if dist.get_rank() != rank or dist.get_world_size() != world_size:
                raise RuntimeError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, not rank {rank} of {world_size}; call "
                    "torch.distributed.destroy_process_group() or launch with matching values"
                )
            self._owns_default_group = False
            backend = dist.get_backend()
            if arrival is not None and world_size > 1:
                self._meet(
                    self._adopted_store(),
                    arrival,
                    world_size,
                    timeout,
                    "the default group's store",
                    time.monotonic() + timeout.total_seconds(),
                )
        else:
            deadline = time.monotonic() + timeout.total_seconds()
            if world_size == 1 and init_method is None:
                store: Any = dist.HashStore()
                if arrival is not None:
                    self._hostnames = (arrival.host,)
            else:
                if init_method is None:
                    if port is None or not 0 < int(port) < 65536:
                        raise ValueError(
                            f"port={port!r} must be an integer in 1..65535 for a world of {world_size}"
                        )
                    if not host:
                        raise ValueError("host must name the rank-0 machine (e.g. '127.0.0.1')")
                    init_method = _url(None, host, int(port))
                store = self._launch_store(init_method, rank, world_size, timeout, deadline)
                if arrival is not None:
                    self._meet(store, arrival, world_size, timeout, _shown_url(init_method), deadline)
            dist.init_process_group(
                backend=backend, rank=rank, world_size=world_size, timeout=timeout, store=store
            )
            self._owns_default_group = True
        self._global_rank = rank
        self._world_size = world_size
        self._backend = backend
        self._timeout = timeout
        self._local_ranks[ParallelMode.GLOBAL] = rank
        self._world_sizes[ParallelMode.GLOBAL] = world_size

    def _meet(
        self, store: Any, arrival: Arrival, world_size: int, timeout: timedelta, where: str, deadline: float
    ) -> None:
        """The one exchange of the launch: every rank's host name and agreed values."""
        arrivals = exchange(store, arrival, world_size, timeout, where, deadline)
        self._hostnames = tuple(a.host for a in arrivals)

    def _adopted_store(self) -> Any:
        """The adopted default group's store, under a prefix new for this launch."""
        from torch.distributed.distributed_c10d import _get_default_store

        self._launches += 1
        return dist.PrefixStore(f"parallelctx/launch-{self._launches}", _get_default_store())

    def _launch_store(
        self, url: str, rank: int, world_size: int, timeout: timedelta, deadline: float | None = None
    ) -> Any:
        """The store this launch meets on: the URL's store (rank 0 serves a ``tcp://`` one, made
        on first use with a bounded, interruptible wait and kept after), under a prefix that is
        new for every launch of this process."""
        key = (url, rank, world_size)
        base = self._stores.get(key)
        if base is None:
            base = connect_store(url, rank, world_size, timeout, deadline)
            self._stores[key] = base
        base.set_timeout(timeout)
        self._launches += 1
        return dist.PrefixStore(f"parallelctx/launch-{self._launches}", base)

    def init_parallel_groups(self) -> Layout:
        """Build the layout from the config's sizes and create this rank's process groups.

        Returns:
            The :class:`Layout`.

        Raises:
            NotLaunchedError: :meth:`init_global_dist` has not run.
            LayoutError: the configured sizes do not fit the world size.
        """
        if self._world_size == 0:
            raise self._not_launched("init_parallel_groups()")
        layout = self.config.parallel.to_layout(self._world_size)
        # Accelerator backends get a gloo group beside each group; CPU backends serve both.
        cpu_backend = None if self._backend in _CPU_BACKENDS else "gloo"
        timeout = self._timeout or self.config.dist.timeout
        used = None
        if not self._owns_default_group:
            if self._adopted_names[0] is not dist.group.WORLD:
                self._adopted_names = (dist.group.WORLD, set())
            used = self._adopted_names[1]
        groups, calls = create_groups(
            layout,
            self._global_rank,
            timeout,
            cpu_backend,
            used_names=used,
            gloo_lazy_init=self.config.dist.gloo_lazy_init,
        )
        self._layout = layout
        self._group_calls = calls
        for mode, g in groups.items():
            local = g.ranks.index(self._global_rank)
            size = len(g.ranks)
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
        pipe = self._views[ParallelMode.PIPELINE]
        self._first_stage, self._last_stage = pipe.is_first, pipe.is_last
        return layout

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
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            if self._local_rank is None:
                raise ValueError(
                    "set_device needs the launcher's local rank (the global rank would pick the "
                    "wrong GPU on every node but the first); pass local_rank"
                )
            index = self._local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self._device = torch.device("cuda", index)
        else:
            self._device = torch.device("cpu")
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
        host = socket.gethostname()
        if len(self._hostnames) == self._world_size:  # gathered by the launch rendezvous
            names = list(self._hostnames)
        elif self._world_size == 1:
            names = [host]
        else:
            names = [""] * self._world_size
            dist.all_gather_object(names, host, group=self._cpu_groups[ParallelMode.GLOBAL])
        self._hostnames = tuple(names)
        same = [r for r, name in enumerate(names) if name == host]
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
        try:
            if dist.is_initialized():
                if self._owns_default_group:
                    dist.destroy_process_group()
                else:
                    seen: set[int] = set()
                    for g in list(self._groups.values()) + list(self._cpu_groups.values()):
                        if g is not None and g is not dist.group.WORLD and id(g) not in seen:
                            seen.add(id(g))
                            dist.destroy_process_group(g)
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
        """Return this rank's process group of ``mode``; None for a mode of size 1.

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._groups[mode]

    def get_cpu_group(self, mode: ParallelMode | str) -> Any:
        """Return the CPU (gloo) group beside ``mode``'s group; the group itself with gloo,
        None for a mode of size 1.

        Raises:
            NotLaunchedError: before launch, or a mode this rank has no group of.
            LayoutError: ``mode`` is not a parallel mode.
        """
        return self._cpu_groups[mode]

    def _view(self, mode: ParallelMode | str, what: str) -> ModeView:
        try:
            return self._views[mode]  # type: ignore[index]  # a plain name finds its mode: equal hashes
        except KeyError:
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
        if mode == ParallelMode.GLOBAL:
            return self._global_rank >= 0
        ParallelMode.parse(mode)
        return False

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
            from .mesh import build_device_mesh

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
        streams = self.rng_streams
        return RNGState(
            rank=self._global_rank,
            world_size=self._world_size,
            layout=self.layout.describe(),
            seed=self._seed if self._seed is not None else -1,
            python=random.getstate(),
            numpy=np.random.get_state(),
            streams=streams.snapshot(),
        )

    def set_rng_state(self, state: RNGState) -> None:
        """Restore every stream from ``state`` (see :meth:`get_rng_state`); may be called
        inside ``with gpc.seed(...)`` blocks, which keep running on their own stream.

        Raises:
            NotLaunchedError: before :meth:`set_seed`.
            TypeError: ``state`` is not an :class:`RNGState`.
            ValueError: ``state`` was taken on another rank, world size or layout, or with CUDA
                state where this rank has none (or the reverse); the message says which.
        """
        streams = self.rng_streams
        if not isinstance(state, RNGState):
            raise TypeError(
                f"set_rng_state takes what gpc.get_rng_state() returned, not {type(state).__name__}"
            )
        where = [
            (name, theirs, mine)
            for name, theirs, mine in (
                ("rank", state.rank, self._global_rank),
                ("world_size", state.world_size, self._world_size),
                ("layout", state.layout, self.layout.describe()),
            )
            if theirs != mine
        ]
        if where:
            diffs = "; ".join(f"{name} {theirs!r} there, {mine!r} here" for name, theirs, mine in where)
            raise ValueError(
                f"this RNG state was taken elsewhere ({diffs}); restore each rank's own state "
                "(save one per global rank) under the same layout"
            )
        has_cuda = next(iter(state.streams.states.values()))[1] is not None
        if has_cuda != streams.cuda:
            raise ValueError(
                f"this RNG state {'has' if has_cuda else 'has no'} CUDA generator states but this "
                f"rank {'uses' if streams.cuda else 'does not use'} CUDA; restore it on the same kind of device"
            )
        streams.restore(state.streams)
        random.setstate(state.python)
        np.random.set_state(state.numpy)

    def summary(self) -> str:
        """Return the one-line launch summary."""
        return (
            f"parallelctx: {self.layout.describe()} backend={self._backend} "
            f"nodes={self.num_nodes} procs/node={self.num_processes_on_current_node} "
            f"seed={self.config.seed} groups made on this rank={self._group_calls}"
        )


def _url(init_method: str | None, host: str | None, port: int | None) -> str:
    """``init_method``, else ``tcp://host:port`` (IPv6 hosts bracketed)."""
    if init_method is not None:
        return init_method
    h = f"[{host}]" if host and ":" in host and not host.startswith("[") else host
    return f"tcp://{h}:{port}"


def _shown_url(url: str) -> str:
    """``host:port`` for a ``tcp://`` URL, the URL otherwise."""
    return url[len("tcp://") :] if url.startswith("tcp://") else url


def _agreed_values(
    cfg: Config, layout: Layout, world_size: int, backend: str | None, timeout: timedelta, seed: int | None
) -> dict[str, Any]:
    """What every rank must launch with, as flat dotted keys: the config's parallel and dist
    sections (init_method aside: ranks may name rank 0's host differently), the seed, the
    layout, the world size and the versions of parallelctx and torch."""
    from importlib.metadata import PackageNotFoundError, version

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
    try:
        values["parallelctx_version"] = version("parallelctx")
    except PackageNotFoundError:
        values["parallelctx_version"] = "unknown"
    values["torch_version"] = torch.__version__
    return values


def resolve_backend(backend: str | None) -> str:
    """Return the backend to use: ``"auto"`` (or None) means nccl with CUDA, else gloo.

    Raises:
        ValueError: an unknown backend, or nccl without CUDA.
    """
    if backend in (None, "auto"):
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'nccl' or 'gloo'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, which is not available here; use 'gloo' or 'auto'")
    return backend


gpc: ParallelContext = ParallelContext()
"""The global parallel context: the one instance of :class:`ParallelContext`."""
