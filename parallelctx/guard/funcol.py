"""Torch's functional collectives, made visible to the dry run, the hang report and the plugin.

``torch.distributed._functional_collectives`` (``funcol.all_reduce``, ``all_gather_single``,
...), DTensor's redistributions and the backward passes of both call the ops of the
``torch.ops._c10d_functional`` namespace. Those ops reach the process group in C++: neither
``torch.distributed``'s functions nor ``ProcessGroup``'s Python methods see them. Every Python
caller looks the op up on the namespace at call time (``torch.ops._c10d_functional.all_reduce``),
so :func:`watch_functional` replaces those attributes (in a
:class:`~parallelctx.guard.patch.Patches`, restored with it) by callables that run the op and
then hand a :class:`FunctionalCall` to the caller's ``seen``; the op's overloads
(``.default``) stay reachable and are not watched.

Not seen: code compiled by ``torch.compile`` (while Dynamo traces, the wrapper steps aside so
the graph has the op itself), callers that hold an overload (``...all_reduce.default``) and C++
callers (DTensor's ``shard_dim_alltoall`` on accelerators). Functional point-to-point ops
(``isend``, ``irecv``, ``batch_p2p_ops``) are not watched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple, TypeVar

import torch

from .patch import Patches

__all__ = ["FUNCTIONAL_OPS", "FunctionalCall", "TensorShape", "watch_functional"]

FUNCTIONAL_OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_reduce_coalesced_": "all_reduce_coalesced",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "all_gather_into_tensor_out": "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_out": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "all_to_all_single": "all_to_all_single",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
"""``torch.ops._c10d_functional`` op -> the ``torch.distributed`` function that makes the same
collective (a functional all-reduce and ``dist.all_reduce`` on one group match each other)."""


class FunctionalCall:
    """One functional collective, as the op returned it. Its group is read at once; what the
    consumers word is made only when asked (:meth:`given`, :meth:`shapes`), so a call on a
    group nobody watches costs a lookup.

    Attributes:
        op: the ``torch.distributed`` function it matches (:data:`FUNCTIONAL_OPS`).
        group: the ``ProcessGroup`` it ran on.
        outputs: the tensors it returned (the functional op's results, to be waited for).
    """

    __slots__ = ("_args", "_kwargs", "_name", "group", "op", "outputs")

    def __init__(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], result: Any) -> None:
        """Read the call of the op ``name`` (``args``, ``kwargs``) that returned ``result``.

        Raises:
            Exception: the group named by the call is not known to torch (the op itself would
                have refused it first).
        """
        import torch.distributed.distributed_c10d as c10d

        self._name, self._args, self._kwargs = name, args, kwargs
        self.op = FUNCTIONAL_OPS[name]
        group = kwargs.get("group_name", args[-1] if args else None)
        self.group = c10d._resolve_process_group(c10d.GroupName(group)) if isinstance(group, str) else group
        outputs = list(result) if isinstance(result, (list, tuple)) else [result]
        self.outputs: list[torch.Tensor] = [t for t in outputs if isinstance(t, torch.Tensor)]

    def _parts(self) -> tuple[dict[str, Any], tuple[Any, ...]]:
        value, reduce_op, src, out_splits, in_splits = _arguments(self._name, self._args, self._kwargs)
        outs = self.outputs
        out: Any = outs[0] if len(outs) == 1 else outs
        op = self.op
        given: dict[str, Any] = {"group": self.group}
        pg_args: tuple[Any, ...]
        if op in ("all_reduce", "all_reduce_coalesced"):
            given.update(tensor=value, op=str(reduce_op or "sum").upper())
            pg_args = (value if isinstance(value, list) else [value],)
        elif op == "broadcast":
            given.update(tensor=value, group_src=int(src or 0))
            pg_args = ([value], SimpleNamespace(rootRank=int(src or 0)))
        elif op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
            given.update(output_tensor=out, input_tensor=value)
            pg_args = (out, value)
        elif op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
            given.update(output=out, input=value, op=str(reduce_op or "sum").upper())
            pg_args = (out, value)
        else:  # all_to_all_single
            given.update(output=out, input=value, output_split_sizes=out_splits, input_split_sizes=in_splits)
            pg_args = (out, value, list(out_splits or []), list(in_splits or []))
        return given, pg_args

    def given(self) -> dict[str, Any]:
        """Its arguments under the names the matching ``torch.distributed`` function takes
        (``tensor``, ``op``, ``input``/``output``, ``input_tensor``/``output_tensor``, split
        sizes, ``group_src``, ``group``), for the dry run's ledger."""
        return self._parts()[0]

    def shapes(self) -> tuple[Any, ...]:
        """Its tensors' :class:`TensorShape` in the order of the ``ProcessGroup`` method the
        matching function calls (a root as an object with ``rootRank``), for the hang report's
        wording, which must not keep the tensors alive."""
        return tuple(_shape_of(a) for a in self._parts()[1])


def _arguments(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """``(input, reduce_op, src, output_splits, input_splits)`` of one op call."""
    given = list(args)
    value = given[0] if given else kwargs.get("input", kwargs.get("inputs"))
    reduce_op = src = out_splits = in_splits = None
    if name.startswith(("all_reduce", "reduce_scatter")):
        reduce_op = given[1] if len(given) > 1 else kwargs.get("reduce_op")
    elif name.startswith("broadcast"):
        src = given[1] if len(given) > 1 else kwargs.get("src")
    elif name == "all_to_all_single":
        out_splits = given[1] if len(given) > 1 else kwargs.get("output_split_sizes")
        in_splits = given[2] if len(given) > 2 else kwargs.get("input_split_sizes")
    return value, reduce_op, src, out_splits, in_splits


class TensorShape(NamedTuple):
    """A tensor's dtype and shape, kept instead of the tensor (which the caller may free)."""

    dtype: Any
    shape: tuple[int, ...]


def _shape_of(value: Any) -> Any:
    """``value`` with each tensor (in a list too) replaced by its :class:`TensorShape`."""
    if isinstance(value, torch.Tensor):
        return TensorShape(value.dtype, tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return [_shape_of(v) for v in value]
    return value


def _copy(cls: type[_P], packet: Any) -> _P:
    """An object of ``cls`` (an ``OpOverloadPacket`` subclass) standing for ``packet``: the same
    state and the same overload objects (``.default`` is ``packet.default``), so that code that
    takes the namespace's attribute for the packet (Inductor's lowerings, Dynamo, ``is``
    checks on overloads) finds the same op."""
    for overload in packet.overloads():
        getattr(packet, overload)  # made once on the packet, then shared by the copy
    copy = object.__new__(cls)
    copy.__dict__.update(vars(packet))
    return copy


_P = TypeVar("_P", bound="torch._ops.OpOverloadPacket")


class _Watched(torch._ops.OpOverloadPacket):
    """A collective op of the namespace that hands each call to ``seen`` once it returned."""

    _fc_name: str
    _fc_seen: Callable[[FunctionalCall], None]

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        result = self._op(*args, **kwargs)
        if torch.compiler.is_compiling():
            return result
        try:
            call = FunctionalCall(self._fc_name, args, kwargs, result)
        except Exception:  # a call the guard cannot read is left unseen, never failed
            return result
        self._fc_seen(call)
        return result


class _Waiting(torch._ops.OpOverloadPacket):
    """``wait_tensor``, telling ``waiting(tensor, True)`` as it starts to wait and
    ``waiting(tensor, False)`` once the wait returned (or raised)."""

    _fc_waiting: Callable[[torch.Tensor, bool], None]

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        tensor = args[0] if args else kwargs.get("tensor")
        if not isinstance(tensor, torch.Tensor) or torch.compiler.is_compiling():
            return self._op(*args, **kwargs)
        self._fc_waiting(tensor, True)
        try:
            return self._op(*args, **kwargs)
        finally:
            self._fc_waiting(tensor, False)


def _watched(name: str, packet: Any, seen: Callable[[FunctionalCall], None]) -> _Watched:
    watched = _copy(_Watched, packet)
    watched._fc_name, watched._fc_seen = name, seen
    return watched


def _waiting(packet: Any, waiting: Callable[[torch.Tensor, bool], None]) -> _Waiting:
    wrapper = _copy(_Waiting, packet)
    wrapper._fc_waiting = waiting
    return wrapper


def watch_functional(
    patches: Patches,
    seen: Callable[[FunctionalCall], None],
    waiting: Callable[[torch.Tensor, bool], None] | None = None,
) -> None:
    """Replace the collective ops of ``torch.ops._c10d_functional`` (:data:`FUNCTIONAL_OPS`,
    those this torch has) in ``patches`` so that each call, once the op returned, is handed to
    ``seen`` as a :class:`FunctionalCall`; with ``waiting``, ``wait_tensor`` too, calling
    ``waiting(tensor, True)`` as a wait for ``tensor`` starts and ``waiting(tensor, False)`` as
    it ends. The replacements are ``OpOverloadPacket`` objects with the ops' own overloads. ``seen``
    and ``waiting`` run in the calling thread and must not raise.

    Returns:
        None. ``patches.restore()`` puts the ops back.
    """
    namespace = torch.ops._c10d_functional
    for name in FUNCTIONAL_OPS:
        try:
            getattr(namespace, name)
        except (AttributeError, RuntimeError):  # not in this torch
            continue
        patches.replace(namespace, name, functools.partial(_watched, name, seen=seen))
    if waiting is not None:
        patches.replace(namespace, "wait_tensor", functools.partial(_waiting, waiting=waiting))
