"""The dry run's recorder: what one simulated rank does, for its report.

A :class:`DryRun` (``gpc.dry_run``) holds the rank's report: coordinates, groups and seeds at the
end of launch, every ``torch.distributed.new_group`` call of the run (members, local
synchronization, call site), the collectives called, and the values the script registers with
:func:`parallelctx.dryrun.record`. :func:`install_recorders` wraps ``torch.distributed`` for it
(:class:`~parallelctx.guard.patch.Patches`); the world it plays is
:class:`~parallelctx.planning.simulation.Simulation`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ..planning.simulation import Simulation
from .ledger import P2P_KINDS, CallLedger, describe, p2p_async, tensor_text
from .patch import Patches

__all__ = ["COLLECTIVES", "NOT_FORWARDED", "DryRun", "GroupCall", "install_recorders", "rank_runs"]

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
_OWN_FILES = tuple(
    os.path.join(os.path.dirname(_THIS_FILE), f) for f in ("recorder.py", "patch.py", "funcol.py")
)


@functools.lru_cache(maxsize=64)
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature(fn)``, once per function (torch's collectives, wrapped once)."""
    return inspect.signature(fn)


@functools.lru_cache(maxsize=4096)
def _absolute(name: str) -> str:
    """``name`` (a code object's file name) made absolute and case-normalised, once per name."""
    return os.path.normcase(os.path.abspath(name))


@functools.cache
def _torch_dir() -> str:
    """torch's package directory, ending in a separator."""
    import torch

    return os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__))) + os.sep


def rank_runs(ranks: Iterable[int]) -> list[list[int]]:
    """Return ``ranks`` (ascending) as runs of consecutive ranks, ``[[first, last], ...]``: a
    module's ranks 2048-16383 are ``[[2048, 16383]]``, however many they are. Raises nothing."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = int(rank)
        else:
            runs.append([int(rank), int(rank)])
    return runs


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

    def __init__(
        self, sim: Simulation, config: Any = None, armed: bool = False, record_calls: bool = True
    ) -> None:
        self.sim = sim
        #: The config the launch uses when the script passes none (``parallelctx dry-run --config``).
        self.config = config
        #: True when every launch of this process is this dry run (``parallelctx dry-run``), not
        #: only a launch given ``simulate=``.
        self.armed = armed
        self.calls: list[GroupCall] = []
        self.collectives: dict[str, int] = {}
        #: Every collective and point-to-point call in order (None: not recorded, ``--no-record-calls``).
        self.ledger: CallLedger | None = CallLedger() if record_calls else None
        self.values: dict[str, Any] = {}
        self.same_across: dict[str, str] = {}
        self.launched: dict[str, Any] = {}
        self.launches = 0
        self._patches = Patches()

    @property
    def recording(self) -> bool:
        """True while ``torch.distributed`` is wrapped for this dry run (:meth:`start_recording`)."""
        return bool(self._patches)

    def start_recording(self) -> None:
        """Wrap ``torch.distributed`` for this dry run (:func:`install_recorders`); a no-op when
        it already is."""
        if not self._patches:
            install_recorders(self, self._patches)

    def stop_recording(self) -> None:
        """Restore ``torch.distributed``'s own functions; a no-op when not recording."""
        self._patches.restore()

    def note_launch(
        self,
        coords: Mapping[str, int],
        groups: Mapping[str, list[int]],
        seeds: Mapping[str, int],
        seconds: float,
        calls: int,
        layout: str,
        parallel: Mapping[str, Any],
        module: str | None = None,
        modules: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Keep what a launch of ``seconds`` gave this rank: its coordinates (mode -> local
        rank), groups (mode -> global ranks, the world's aside), seeds (stream -> seed), the
        ``new_group`` calls it made, the layout's description and the config's parallel section;
        a later launch in the same run replaces them. With ``parallel.modules``: ``module``, the
        module plain ``gpc`` answers for (whose coordinates, groups and seeds those are), and
        ``modules``, every module this rank belongs to (name -> ``ranks``, the module's ranks as
        ``[first, last]`` runs, ``layout``, ``coords``, ``groups`` and ``seeds`` as above).
        Returns None."""
        self.launches += 1
        self.launched = {
            "coords": dict(coords),
            "groups": dict(groups),
            "seeds": dict(seeds),
            "launch_s": seconds,
            "launch_new_group_calls": calls,
            "layout": layout,
            "parallel": dict(parallel),
        }
        if modules is not None:
            self.launched["module"] = module
            self.launched["modules"] = {name: dict(entry) for name, entry in modules.items()}

    def report(self) -> dict[str, Any]:
        """Return the rank's report as a JSON-ready dict: ``world_size``, ``rank``,
        ``nproc_per_node``, ``coords`` {mode: local rank}, ``groups`` {mode: global ranks of its
        group; the world left out}, ``seeds`` {stream: seed}, ``new_group_calls`` (every
        ``new_group`` call of the run, gpc's included), ``launch_s``, ``values`` and
        ``same_across`` (what :func:`record` registered), ``collectives`` {kind: calls}, ``calls``
        (the :class:`~parallelctx.guard.ledger.CallLedger`, None when not recorded),
        ``new_groups`` (each call: ranks, local, desc, where) and ``launches``; with
        ``parallel.modules`` also ``module`` (the module ``coords``, ``groups`` and ``seeds``
        are of) and ``modules`` (each module of this rank: its ``ranks``, ``layout``,
        ``coords``, ``groups`` and ``seeds``; :meth:`note_launch`)."""
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
            "calls": self.ledger.to_json() if self.ledger is not None else None,
            "new_groups": [c.to_json() for c in self.calls],
            "launches": self.launches,
        }


def _call_site() -> str:
    """``file:line`` of the nearest caller outside parallelctx's recorder and torch (a
    DTensor's redistribution, or a functional collective's backward, is named by the user's
    line that led to it: ``model(x)``, ``loss.backward()``)."""
    frame: FrameType | None = sys._getframe(2)
    torch_dir = _torch_dir()
    while frame is not None:
        name = frame.f_code.co_filename
        here = _absolute(name)
        if here not in _OWN_FILES and not here.startswith(torch_dir):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def install_recorders(dry: DryRun, patches: Patches | None = None) -> Callable[[], None]:
    """Wrap ``torch.distributed.new_group`` (each call recorded in ``dry.calls``; a ``backend=``
    it names is dropped, so every group is on the dry run's fake backend) and the
    collectives of :data:`COLLECTIVES` (counted in ``dry.collectives``; the first of each kind
    logs that a dry run's results are not real), in ``patches`` (a new one when None). Code that
    looks the functions up on ``torch.distributed`` at call time (``dist.all_reduce``) is seen;
    torch's functional collectives (``torch.ops._c10d_functional``: ``funcol.*``, DTensor's
    redistributions and their backward passes) are put in the ledger and counted under the
    ``torch.distributed`` function they match (:mod:`parallelctx.guard.funcol`), as asynchronous
    calls. The collectives of :data:`NOT_FORWARDED` are not handed to torch at all.

    Returns:
        A function that restores the originals (``patches.restore``).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from .funcol import FunctionalCall, watch_functional

    patches = Patches() if patches is None else patches

    def recording_new_group(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def new_group(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)  # torch's own error for a bad call
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
            return original(*bound.args, **bound.kwargs)

        return new_group

    nested: list[str] = []  # the recorded calls running now (the ledger notes the outermost)

    def counting(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            names = list(inspect.signature(fn).parameters)

            def collective(*args: Any, **kwargs: Any) -> Any:
                if nested:  # torch's own call inside a recorded one (send's isend): not counted again
                    return fn(*args, **kwargs)
                if dry.ledger is not None and len(args) <= len(names):
                    given = dict(zip(names, args))  # the arguments by name (defaults left out)
                    given.update(kwargs)
                    _note_call(dry.ledger, dry.sim.rank, kind, given, _call_site())
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
                nested.append(kind)  # batch_isend_irecv calls the ops it was given: noted once
                try:
                    if kind == "recv" and _from_any(fn, args, kwargs):
                        return _recv_from_any(fn, args, kwargs)
                    if kind == "all_gather":
                        args, kwargs = _even_gather(fn, args, kwargs)
                    return fn(*args, **kwargs)
                finally:
                    nested.pop()

            collective.__name__ = kind
            return collective

        return wrap

    held: set[int] = set()  # the storages of the results of the functional call held back

    def functional(call: FunctionalCall) -> None:
        if nested:
            return
        if dry.ledger is not None:
            given = {**call.given(), "async_op": True}
            _note_call(dry.ledger, dry.sim.rank, call.op, given, _call_site(), hold=True)
            held.clear()
            held.update(t.untyped_storage().data_ptr() for t in call.outputs)
        dry.collectives[call.op] = dry.collectives.get(call.op, 0) + 1

    def waiting(tensor: Any, start: bool) -> None:
        # a functional call waited for before anything else blocks its rank, as DTensor's do
        if start and dry.ledger is not None and held and tensor.untyped_storage().data_ptr() in held:
            held.clear()
            dry.ledger.release(blocking=True)

    patches.replace(dist, "new_group", recording_new_group)
    watch_functional(patches, functional, waiting)
    wrapped: dict[Any, Any] = {}
    for kind in COLLECTIVES:
        if getattr(dist, kind, None) is not None:
            original = getattr(dist, kind)
            wrapped[original] = patches.replace(dist, kind, counting(kind))
    _accept_wrapped_p2p(c10d, patches, wrapped)
    _rebind_imported(patches, wrapped)
    return patches.restore


def _rebind_imported(patches: Patches, wrapped: Mapping[Any, Any]) -> None:
    """Point the modules of ``torch.distributed`` that hold a collective by name at its wrapper
    too: those that imported it before the dry run (DTensor's ``distribute_tensor`` calls
    ``scatter`` and ``broadcast`` that way) and ``distributed_c10d`` itself, from which a module
    imported later takes it (a collective torch calls inside a recorded one is not counted
    again)."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed."):
            continue
        try:
            found = [
                (attr, value) for attr, value in vars(module).items() if callable(value) and value in wrapped
            ]
        except Exception:  # a module whose namespace cannot be read (a lazy stub)
            continue
        for attr, value in found:
            patches.replace(module, attr, _returning(wrapped[value]))


def _accept_wrapped_p2p(c10d: Any, patches: Patches, wrapped: Mapping[Any, Any]) -> None:
    """Let ``P2POp`` and ``batch_isend_irecv`` take the wrapped ``isend``/``irecv``: torch checks
    ``op in [isend, irecv]`` and ``op is isend`` against its module's own functions, so those
    become the wrappers too, and a ``P2POp`` given an original (imported before the dry run
    began) holds its wrapper instead."""
    pairs = [(name, getattr(c10d, name, None)) for name in ("isend", "irecv")]
    if any(fn not in wrapped for _, fn in pairs):
        return
    for name, fn in pairs:
        patches.replace(c10d, name, _returning(wrapped[fn]))
    if getattr(c10d, "_check_op", None) is not None:

        def check(original: Callable[[Any], None]) -> Callable[[Any], None]:
            return lambda op: original(wrapped.get(op, op))

        patches.replace(c10d, "_check_op", check)
    p2p_op = getattr(c10d, "P2POp", None)
    if p2p_op is None:
        return

    def init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, op: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
            original(self, wrapped.get(op, op), *args, **kwargs)

        return __init__

    patches.replace(p2p_op, "__init__", init)


def _even_gather(fn: Callable[..., Any], args: Any, kwargs: Any) -> tuple[Any, Any]:
    """An uneven ``all_gather`` (a list of outputs shaped by rank) for the fake backend, which
    copies the rank's tensor into every output and fails on another shape: handed outputs shaped
    like the rank's tensor instead (the list the script gave is left as it was)."""
    try:
        bound = _signature(fn).bind(*args, **kwargs)
    except TypeError:
        return args, kwargs
    outs, mine = bound.arguments.get("tensor_list"), bound.arguments.get("tensor")
    shape = getattr(mine, "shape", None)
    if (
        mine is None
        or not isinstance(outs, list)
        or shape is None
        or all(getattr(t, "shape", None) == shape for t in outs)
    ):
        return args, kwargs
    bound.arguments["tensor_list"] = [mine.new_empty(shape) for _ in outs]
    return bound.args, bound.kwargs


def _returning(value: Any) -> Callable[[Any], Any]:
    """A :meth:`Patches.replace` maker that replaces with ``value``."""
    return lambda _: value


def _from_any(fn: Callable[..., Any], args: Any, kwargs: Any) -> bool:
    """True for a ``recv`` call given neither ``src`` nor ``group_src``."""
    if kwargs.get("src") is not None or kwargs.get("group_src") is not None:
        return False
    if len(args) > 1 and args[1] is not None:  # recv(tensor, src, ...)
        return False
    try:
        given = _signature(fn).bind(*args, **kwargs).arguments
    except TypeError:
        return False
    return given.get("src") is None and given.get("group_src") is None


def _recv_from_any(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """A ``recv`` from any source on the fake backend, whose work cannot say the sender
    (``sourceRank()`` raises): received from the group's lowest other rank, which it returns
    (the rank itself in a group of one)."""
    import torch.distributed as dist

    bound = _signature(fn).bind(*args, **kwargs)
    group = bound.arguments.get("group")
    ranks = _members(group)
    ranks = list(range(dist.get_world_size())) if ranks is None else ranks
    me = dist.get_rank()
    src = next((r for r in ranks if r != me), me)
    bound.arguments["src"] = src
    if src == me:
        return src
    fn(*bound.args, **bound.kwargs)
    return src


def _members(group: Any) -> list[int] | None:
    """The global ranks of ``group``; None for the default group (or None)."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return None
    return list(dist.get_process_group_ranks(group))


def _note_call(
    ledger: CallLedger, rank: int, kind: str, given: Mapping[str, Any], where: str, hold: bool = False
) -> None:
    """Put one call of ``kind`` (its bound arguments ``given``) made by global ``rank`` into
    ``ledger`` (``hold``: held back, :meth:`CallLedger.hold`); a ``batch_isend_irecv`` is put in
    as its operations."""
    if kind == "batch_isend_irecv":
        for op in given.get("p2p_op_list") or []:
            name = getattr(getattr(op, "op", None), "__name__", "isend")
            bound = {"tensor": op.tensor, "group": op.group, "tag": op.tag}
            bound["group_dst" if name == "isend" else "group_src"] = op.group_peer
            bound["dst" if name == "isend" else "src"] = op.peer
            _note_call(ledger, rank, name, bound, where)
        return
    group = given.get("group")
    key = ledger.group_key(group, _members)
    members = ledger.groups[key]

    def group_rank(global_rank: int | None) -> int | None:
        wanted = rank if global_rank is None else global_rank
        if members is None:
            return wanted
        return members.index(wanted) if wanted in members else None

    direction = P2P_KINDS.get(kind)
    entry: dict[str, Any] = {"kind": kind, "group": key, "where": where}
    if direction is not None:
        side = "dst" if direction == "send" else "src"
        peer = given.get(side)
        local = given.get(f"group_{side}")
        if peer is None and local is not None:
            peer = members[local] if members is not None else local
        value = given.get("tensor", given.get("object_list"))
        agree = f"{len(value)} objects" if isinstance(value, list) else tensor_text(value)
        words = (
            f"to rank {peer}"
            if direction == "send"
            else ("from any rank" if peer is None else f"from rank {peer}")
        )
        entry.update(agree=agree, shown=f"{kind}({agree} {words})", peer=peer, tag=int(given.get("tag") or 0))
        if p2p_async(kind):
            entry["async"] = True
    else:
        entry["agree"], entry["shown"] = describe(kind, given, group_rank)
        if given.get("async_op"):
            entry["async"] = True
    if hold:
        ledger.hold(entry)
    else:
        ledger.note(entry)
