"""The launch sequence behind ``gpc.launch``: checks, the agreement record, the refusal path,
the default group and the order in which this rank's groups are made.

:func:`launch` runs the steps on a :class:`~parallelctx.context.ParallelContext`, which keeps
the results (state and queries live there, the sequence lives here). :class:`Meetings` is the
part that outlives ``destroy()``: the rendezvous stores by URL, the launch counter behind every
launch's key prefix, and the names of the groups made on an adopted default group.
"""

from __future__ import annotations

import atexit
import logging
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..config import DEFAULT_TIMEOUT, Config, ConfigError, check_init_method_env
from ..config.args import LaunchArgs, LaunchArgumentError, validate_launch_args
from ..guard.abort import AbortableStore, LaunchAborted, socket_inodes
from ..planning.layout import Layout, LayoutError, ParallelMode
from .groups import ModeGroup, Sockets, create_groups
from .rendezvous import Arrival, agree_launch, connect_store, exchange, rank_list

if TYPE_CHECKING:
    from ..context import ParallelContext

__all__ = [
    "DefaultGroup",
    "Meetings",
    "agreed_values",
    "host_names",
    "init_default_group",
    "launch",
    "make_groups",
    "pick_device",
    "resolve_backend",
    "tear_down",
]

logger = logging.getLogger("parallelctx")

CPU_BACKENDS = frozenset({"gloo", "mpi", "fake"})
"""Backends whose groups also serve as the CPU groups (no gloo twin is made)."""

REFUSAL_GRACE_S = 15.0
"""How long (at most; never longer than ``dist.timeout``) a rank whose own checks failed keeps
telling the other ranks so, in the background, after it has raised its error: a relaunch in the
same process and the process's exit wait for that, never the error itself."""


class Meetings:
    """Where launches meet, kept by the context across ``destroy()`` so that a relaunch works:
    the rendezvous store of each URL (rank 0 serves a ``tcp://`` one and keeps it), and the
    names of the groups made on a default group that parallelctx adopted (torch names those by
    count; see ``groups._claim_name``). Every launch meets under a key prefix that all ranks
    agree no earlier launch on the store used (:func:`parallelctx.rendezvous.agree_launch`), so
    a relaunch works also when some processes are new (a torchrun restart, a replaced rank)."""

    def __init__(self) -> None:
        self._stores: dict[tuple[str, int, int], Any] = {}
        self._adopted: tuple[Any, set[tuple[Any, int]]] = (None, set())
        # Set by gpc.abort(): the launch under way stops at its next store call; cleared when a
        # launch starts (:func:`launch`).
        self.aborted = threading.Event()
        self._kv: Any = None  # this launch's AbortableStore (torch does not keep it alive)
        self._plain: dict[int, Any] = {}  # id(abortable prefix store) -> the same keys, plain
        self._refusal: threading.Thread | None = None
        self._exit_hook = False

    def announce_refusal(self, args: LaunchArgs, timeout: timedelta, arrival: Arrival) -> None:
        """Tell the other ranks, in a background thread, that this rank refused to launch
        (``arrival.error``), so that they stop at once instead of waiting for it; returns at
        once. The telling lasts at most ``min(timeout, REFUSAL_GRACE_S)``; the next launch in
        this process and the process's exit wait for it (within that bound)."""
        self.settle()
        if args.world_size == 1 or dist.is_initialized():
            return
        grace = timedelta(seconds=min(timeout.total_seconds(), REFUSAL_GRACE_S))
        self._refusal = threading.Thread(
            target=_announce_refusal,
            args=(self, args, timeout, time.monotonic() + grace.total_seconds(), arrival),
            name="parallelctx-refusal",
            daemon=True,
        )
        self._refusal.start()
        if not self._exit_hook:
            atexit.register(self._settle_at_exit)
            self._exit_hook = True

    def settle(self) -> None:
        """Wait until this process's last refusal has been told (bounded: see
        :meth:`announce_refusal`); returns None."""
        thread, self._refusal = self._refusal, None
        if thread is not None:
            thread.join(REFUSAL_GRACE_S + 5.0)

    def _settle_at_exit(self) -> None:
        thread = self._refusal
        if thread is not None:
            thread.join(3.0)  # told at once when the other ranks are there: no note
        if thread is None or not thread.is_alive():
            return
        if sys.stderr is not None and sys.stderr.isatty():  # for a person waiting at a terminal
            sys.stderr.write(
                f"parallelctx: telling the other ranks that this rank refused to launch (at most "
                f"{REFUSAL_GRACE_S:g} s; Ctrl-C skips)\n"
            )
        try:
            self.settle()
        except KeyboardInterrupt:
            pass

    def store(self, url: str, rank: int, world_size: int, timeout: timedelta, deadline: float) -> Any:
        """Return the store this launch meets on: ``url``'s store (reached once with a bounded,
        interruptible wait, then kept) under the prefix the ranks agreed is new.

        Raises:
            RendezvousError: the store did not answer before ``deadline``, its port is taken, or
                a rank did not take part in the agreement in time.
        """
        key = (url, rank, world_size)
        base = self._stores.get(key)
        if base is None:
            base = connect_store(url, rank, world_size, timeout, deadline, self.aborted)
            self._stores[key] = base
        base.set_timeout(timeout)
        kv = self._kv = AbortableStore(base, self.aborted)
        prefix = agree_launch(kv, rank, world_size, timeout, _shown_url(url), deadline)
        meeting = dist.PrefixStore(prefix, kv)
        self._plain = {id(meeting): dist.PrefixStore(prefix, base)}
        return meeting

    def plain(self, store: Any) -> Any:
        """Return the store torch's groups get for ``store`` (from :meth:`store`): the same keys
        without the refusal after ``gpc.abort()``, so that torch's own threads never call into
        Python. Any other store is returned as it is."""
        return self._plain.get(id(store), store)

    def adopted_store(self, rank: int, world_size: int, timeout: timedelta, deadline: float) -> Any:
        """Return the adopted default group's store under the prefix the ranks agreed is new.

        Raises:
            RendezvousError: a rank did not take part in the agreement in time.
        """
        from torch.distributed.distributed_c10d import _get_default_store

        kv = self._kv = AbortableStore(_get_default_store(), self.aborted)
        prefix = agree_launch(kv, rank, world_size, timeout, "the default group's store", deadline)
        return dist.PrefixStore(prefix, kv)

    def adopted_names(self) -> set[tuple[Any, int]]:
        """Return the set of group names already used on the current adopted default group
        (a new, empty set when the default group changed)."""
        if self._adopted[0] is not dist.group.WORLD:
            self._adopted = (dist.group.WORLD, set())
        return self._adopted[1]


@dataclass(frozen=True)
class DefaultGroup:
    """What :func:`init_default_group` made or adopted: the backend, whether parallelctx owns
    (and so destroys) the group, the timeout, every rank's host name when the rendezvous
    gathered them (empty otherwise), the launch's store under its agreed prefix (None for a
    world of one) and the inodes of every socket this process held before any group was made
    (:func:`parallelctx.abort.socket_inodes`): the listeners not among them are the launch's,
    for ``abort()``."""

    backend: str
    owned: bool
    timeout: timedelta
    hostnames: tuple[str, ...]
    store: Any = None
    listening: frozenset[int] = frozenset()


def launch(
    ctx: ParallelContext,
    config: Config | Mapping[str, Any] | str | Path | None,
    rank: Any,
    world_size: Any,
    host: Any,
    port: Any,
    backend: Any,
    local_rank: Any,
    seed: Any,
    timeout: Any,
    init_method: Any,
    local_world_size: Any,
    simulate: Any = None,
) -> ParallelContext:
    """Run the launch sequence on ``ctx`` (see :meth:`ParallelContext.launch`, which documents
    the arguments): local checks, the rendezvous (or the refusal posted there), the default
    group, this rank's groups, processes per node, device, seeds; on failure ``ctx.destroy()``.

    Returns:
        ``ctx``.

    Raises:
        RuntimeError, RendezvousError, LaunchArgumentError, ValueError: as
        :meth:`ParallelContext.launch` documents.
    """
    if ctx.is_initialized(ParallelMode.GLOBAL):
        raise RuntimeError(
            "parallelctx is already launched in this process; launch once per process: under "
            "parallelctx.spawn (and @pytest.mark.parallel) each worker is launched before your function "
            "runs, so drop the launch call from it and pass the config as spawn(..., config=...); "
            "to launch again after your own launch, call gpc.destroy() first"
        )
    if simulate is not None or getattr(ctx._dry_run, "armed", False):  # a dry run: parallelctx.dryrun
        return _launch_dry(ctx, config, simulate, seed, timeout, local_rank)
    ctx._meetings.settle()  # an earlier refusal of this process, still being told
    ctx._dry_run = None  # a real launch: an earlier simulate= launch's report goes, record() is a no-op
    ctx._meetings.aborted.clear()  # an abort() from now on stops this launch
    # Local checks first, before any waiting. A rank whose checks fail raises at once; when it
    # can still reach the others (its rank, world size and address are valid) it tells them at
    # the rendezvous in the background, so that every rank stops at once instead of waiting
    # for it until the timeout.
    refused: BaseException | None = None
    cfg: Config | None = None
    try:
        cfg = ctx.load_config(config)
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
        args = _reachable_args(rank, world_size, host, port, timeout, method, need_address, exc)
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
        # (cfg and layout are None only when a check failed, so refused is set)
        refused = refused or RuntimeError("parallelctx: the launch checks failed without a cause")
        ctx._meetings.announce_refusal(
            args, wait, Arrival(args.rank, socket.gethostname(), error=f"{type(refused).__name__}: {refused}")
        )
        ctx.destroy()
        if isinstance(refused, (ConfigError, LayoutError, LaunchArgumentError)):
            # the message is the whole story: no frames of the library's own checks
            refused = refused.with_traceback(None)
        raise refused
    values = agreed_values(cfg, layout, args.world_size, args.backend, wait, use_seed)
    arrival = Arrival(args.rank, socket.gethostname(), values)
    try:
        ctx._local_rank = args.local_rank
        check_init_method_env(args.init_method)
        ctx.init_global_dist(
            args.rank,
            args.world_size,
            backend=args.backend or cfg.dist.backend,
            host=args.host,
            port=args.port,
            timeout=wait,
            init_method=args.init_method,
            arrival=arrival,
        )
        ctx.init_parallel_groups()
        on_node = ctx.detect_num_processes_on_current_node()
        ctx.set_device()
        ctx.set_seed(use_seed)
        ctx._post_listeners()
        if ctx._meetings.aborted.is_set():  # abort() came while torch made the groups
            raise LaunchAborted(
                f"rank {args.rank}: the launch was aborted by gpc.abort() while it made the groups"
            )
        ctx._start_hang_watch()
    except BaseException as exc:
        ctx.destroy()
        if ctx._meetings.aborted.is_set() and not isinstance(exc, (KeyboardInterrupt, LaunchAborted)):
            raise LaunchAborted(
                f"rank {args.rank}: the launch was aborted by gpc.abort() while it waited "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from exc
        raise
    if args.local_world_size is not None and args.local_world_size != on_node:
        logger.warning(
            "the launcher says %d processes run on this node, but %d ranks share host %r; "
            "check the launcher's host list and the per-node process count",
            args.local_world_size,
            on_node,
            socket.gethostname(),
        )
    if ctx.is_rank_for_log():
        logger.info(ctx.summary())
    return ctx


def _launch_dry(
    ctx: ParallelContext, config: Any, simulate: Any, seed: Any, timeout: Any, local_rank: Any
) -> ParallelContext:
    """The dry-run launch (:func:`parallelctx.dryrun.launch_simulated`): ``simulate``, else the
    simulation ``parallelctx dry-run`` armed (whose config serves when ``config`` is None)."""
    from ..config import to_timedelta
    from ..dryrun import launch_simulated, parse_simulate

    armed = ctx._dry_run if getattr(ctx._dry_run, "armed", False) else None
    sim = parse_simulate(simulate if simulate is not None else armed.sim)  # type: ignore[union-attr]
    if config is None and armed is not None:
        config = armed.config
    cfg = ctx.load_config(config)
    wait = to_timedelta(timeout, "timeout") if timeout is not None else cfg.dist.timeout
    try:
        launch_simulated(ctx, sim, wait, seed if seed is not None else cfg.seed, local_rank)
    except BaseException:
        ctx.destroy()
        raise
    return ctx


def _reachable_args(
    rank: Any,
    world_size: Any,
    host: Any,
    port: Any,
    timeout: Any,
    method: Any,
    need_address: bool,
    refused: LaunchArgumentError,
) -> LaunchArgs:
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


def _announce_refusal(
    meetings: Meetings, args: LaunchArgs, timeout: timedelta, deadline: float, arrival: Arrival
) -> None:
    """Post this rank's failed checks at the rendezvous, by ``deadline``, so that every other
    rank stops at once; a rendezvous that fails too is only logged (the caller has raised the
    cause). Runs in :meth:`Meetings.announce_refusal`'s thread."""
    url = _url(args.init_method, args.host, args.port)
    begin = time.monotonic()
    try:
        store = meetings.store(url, args.rank, args.world_size, timeout, deadline)
        exchange(store, arrival, args.world_size, timeout, _shown_url(url), deadline)
    except Exception as exc:
        ranks = getattr(exc, "ranks", ())
        if ranks:
            why = f"rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)} did not come to {_shown_url(url)}"
        else:
            why = str(exc).split(";", 1)[0]
        logger.warning(
            "parallelctx: rank %d refused to launch and could not tell the other ranks within %.0f s "
            "(%s); they stop at their own dist.timeout, or when the launcher stops them",
            args.rank,
            time.monotonic() - begin,
            why,
        )


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


def host_names(known: tuple[str, ...], world_size: int, cpu_group: Any) -> tuple[str, ...]:
    """Return every rank's host name in rank order: ``known`` when the launch rendezvous
    gathered them, else one all-gather over ``cpu_group`` (bounded by its timeout).

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


def tear_down(owned_default: bool, groups: list[Any]) -> None:
    """Destroy the default group when parallelctx made it (which destroys every group), else
    each of ``groups`` once, never the adopted default group; returns None."""
    if not dist.is_initialized():
        return
    if owned_default:
        dist.destroy_process_group()
        return
    seen: set[int] = set()
    for g in groups:
        if g is not None and g is not dist.group.WORLD and id(g) not in seen:
            seen.add(id(g))
            dist.destroy_process_group(g)


def init_default_group(
    meetings: Meetings,
    rank: int,
    world_size: int,
    backend: str,
    host: str | None,
    port: int | None,
    timeout: timedelta,
    init_method: str | None,
    arrival: Arrival | None,
) -> DefaultGroup:
    """Meet every rank (one exchange of ``arrival`` on this launch's store) and make the
    default group, or adopt an initialised one with the same rank and world size.

    Relaunching works, in the same processes or with some of them new (a torchrun restart, a
    replaced rank): the rendezvous store of a URL is kept across ``destroy()`` by ``meetings``
    (under torchrun it is the launcher's own store, which outlives restarts) and every launch
    first agrees with every rank on a key prefix no earlier launch on that store used,
    ``parallelctx/launch-<n>/`` (:func:`parallelctx.rendezvous.agree_launch`); the exchange,
    the default group and every group made from it keep their keys under it. In the one
    round trip (:func:`parallelctx.rendezvous.exchange`) each rank posts ``arrival`` and reads
    the others'; a rank that does not arrive within ``timeout`` is named, and so are ranks that
    disagree. The host names serve ``detect_num_processes_on_current_node``.

    Returns:
        A :class:`DefaultGroup`.

    Raises:
        ValueError: a bad rank, world size, backend, host or port (the message names it).
        RuntimeError: torch.distributed is initialised with another rank or world size.
        RendezvousError: a rank did not arrive within ``timeout``, the store did not answer or
            its port is taken, or the ranks disagree.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
    if backend == "fake":  # a dry run (parallelctx.dryrun): no rendezvous, no store server
        from ..dryrun import fake_default_group

        fake_default_group(rank, world_size, timeout)
        return DefaultGroup("fake", True, timeout, ())
    backend = resolve_backend(backend)
    deadline = time.monotonic() + timeout.total_seconds()
    hostnames: tuple[str, ...] = ()
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}; call "
                "torch.distributed.destroy_process_group() or launch with matching values"
            )
        kv = None
        if arrival is not None and world_size > 1:
            kv = meetings.adopted_store(rank, world_size, timeout, deadline)
            arrivals = exchange(kv, arrival, world_size, timeout, "the default group's store", deadline)
            hostnames = tuple(a.host for a in arrivals)
        return DefaultGroup(dist.get_backend(), False, timeout, hostnames, kv, socket_inodes())
    if world_size == 1 and init_method is None:
        store: Any = dist.HashStore()
        if arrival is not None:
            hostnames = (arrival.host,)
    else:
        if init_method is None:
            if port is None or not 0 < int(port) < 65536:
                raise ValueError(f"port={port!r} must be an integer in 1..65535 for a world of {world_size}")
            if not host:
                raise ValueError("host must name the rank-0 machine (e.g. '127.0.0.1')")
            init_method = _url(None, host, int(port))
        store = meetings.store(init_method, rank, world_size, timeout, deadline)
        if arrival is not None:
            arrivals = exchange(store, arrival, world_size, timeout, _shown_url(init_method), deadline)
            hostnames = tuple(a.host for a in arrivals)
    before = socket_inodes()
    dist.init_process_group(
        backend=backend, rank=rank, world_size=world_size, timeout=timeout, store=meetings.plain(store)
    )
    return DefaultGroup(backend, True, timeout, hostnames, None if world_size == 1 else store, before)


def make_groups(
    meetings: Meetings,
    layout: Layout,
    rank: int,
    default: DefaultGroup,
    gloo_lazy_init: bool,
    sockets: Sockets | None = None,
) -> tuple[dict[ParallelMode, ModeGroup], int]:
    """Create this rank's groups of ``layout`` in the fixed, rank-independent order of
    :func:`parallelctx.groups.create_groups`, with a gloo twin beside each group of an
    accelerator backend, and the default group's timeout.

    Returns:
        ``(groups by mode, new_group calls made)``.

    Raises:
        RuntimeError: torch could not create a group (the message names it).
    """
    cpu_backend = None if default.backend in CPU_BACKENDS else "gloo"
    used = None if default.owned else meetings.adopted_names()
    return create_groups(
        layout,
        rank,
        default.timeout,
        cpu_backend,
        used_names=used,
        gloo_lazy_init=gloo_lazy_init,
        sockets=sockets,
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


def agreed_values(
    cfg: Config, layout: Layout, world_size: int, backend: str | None, timeout: timedelta, seed: int | None
) -> dict[str, Any]:
    """Return what every rank must launch with, as flat dotted keys: the config's parallel and
    dist sections (init_method aside: ranks may name rank 0's host differently), the seed, the
    layout, the world size and the versions of parallelctx and torch (the running modules'
    own ``__version__``: reading the installed metadata cost milliseconds per launch)."""
    from .. import __version__

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
    values["parallelctx_version"] = __version__
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
