"""Megatron-core's global process-group getters, refused while model code runs.

Model code on several layouts (``parallel.modules``) must take its groups explicitly
(``pg_collection=``): ``megatron.core.parallel_state`` holds one global grid, and a layer that
reads it silently gets another module's groups, or None (which torch reads as the whole world).
Megatron's own CI ratchet (``tools/check_process_group_usage.py``, added to Megatron-LM's main
branch after core_v0.19.0) finds such reads statically, with ``ast``: a call of a
``parallel_state`` function whose name starts with ``get_`` and ends with ``_group``,
``_groups``, ``_rank``, ``_world_size`` or ``_src_rank`` (except ``get_nccl_options``,
``get_all_ranks``, ``get_global_memory_buffer`` and the two virtual-pipeline getters), through
the module (``parallel_state.``, ``mpu.``, ``ps.``) or imported by name, and any call of
``ProcessGroupCollection.use_mpu_process_groups``. :func:`forbid_globals` refuses the same set
at run time: while it is active each of those functions, wherever a loaded module holds it
(``parallel_state`` itself, and every module that imported it by name), raises
:class:`MegatronGlobalsError` naming the getter, its caller and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection

__all__ = [
    "DEPRECATED_SUFFIXES",
    "NOT_DEPRECATED",
    "MegatronGlobalsError",
    "forbid_globals",
    "forbidden_getters",
]

DEPRECATED_SUFFIXES: tuple[str, ...] = ("_group", "_groups", "_rank", "_world_size", "_src_rank")
"""The name endings of the getters refused (with the prefix ``get_``), as Megatron's ratchet."""

NOT_DEPRECATED: frozenset[str] = frozenset(
    {
        "get_nccl_options",
        "get_all_ranks",
        "get_global_memory_buffer",
        "get_virtual_pipeline_model_parallel_rank",
        "get_virtual_pipeline_model_parallel_world_size",
    }
)
"""Getters Megatron's ratchet leaves alone (no replacement yet, or no global grid read)."""

_SHIM = "use_mpu_process_groups"


class MegatronGlobalsError(RuntimeError):
    """A ``parallel_state`` getter (or ``ProcessGroupCollection.use_mpu_process_groups``) was
    called inside :func:`forbid_globals`."""


def forbidden_getters() -> list[str]:
    """Return the names of the installed ``parallel_state``'s functions that
    :func:`forbid_globals` refuses (Megatron's ratchet's rule), sorted; it also refuses
    ``ProcessGroupCollection.use_mpu_process_groups``."""
    return sorted(
        name
        for name, value in vars(ps).items()
        if callable(value)
        and getattr(value, "__module__", None) == ps.__name__
        and name.startswith("get_")
        and name.endswith(DEPRECATED_SUFFIXES)
        and name not in NOT_DEPRECATED
    )


def _caller() -> str:
    """The first frame outside parallel_state and this module: who read the global state."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in (ps.__name__, __name__):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "an unknown caller"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _refusal(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise MegatronGlobalsError(
            f"parallel_state.{name}() reads Megatron's global process groups, which "
            f"parallelctx.megatron.forbid_globals() refuses here (called from {_caller()}): pass the "
            "module's groups explicitly, pg_collection=parallelctx.megatron.process_groups(gpc.module(name)) "
            "(or its group, e.g. tp_group=pg_collection.tp), to the layer or function that read it"
        )

    refuse.__parallelctx_refuses__ = name  # type: ignore[attr-defined]
    return refuse


def _refuse_shim(cls: Any, *args: Any, **kwargs: Any) -> Any:
    raise MegatronGlobalsError(
        f"ProcessGroupCollection.{_SHIM}() reads Megatron's global process groups, which "
        f"parallelctx.megatron.forbid_globals() refuses here (called from {_caller()}): it is no "
        "replacement for explicit groups; use parallelctx.megatron.process_groups(gpc.module(name))"
    )


_lock = threading.Lock()
_depth = 0
_names: list[str] = []
_swapped: list[tuple[dict[str, Any], str, Any]] = []


def _swap_in() -> None:
    _names[:] = forbidden_getters()
    refusals = {id(fn): (fn, _refusal(name, fn)) for name in _names for fn in (getattr(ps, name),)}
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            found = refusals.get(id(value))
            if found is not None and found[0] is value:
                _swapped.append((namespace, attr, value))
                namespace[attr] = found[1]
    shim = ProcessGroupCollection.__dict__[_SHIM]
    _swapped.append((_SHIM_HOME, _SHIM, shim))
    setattr(ProcessGroupCollection, _SHIM, classmethod(_refuse_shim))


_SHIM_HOME: dict[str, Any] = {}  # marks the class attribute among the swapped names


def _swap_back() -> None:
    while _swapped:
        namespace, attr, value = _swapped.pop()
        if namespace is _SHIM_HOME:
            setattr(ProcessGroupCollection, attr, value)
        else:
            namespace[attr] = value


@contextlib.contextmanager
def forbid_globals() -> Iterator[list[str]]:
    """``with parallelctx.megatron.forbid_globals():`` runs the body with every global
    process-group getter of ``megatron.core.parallel_state`` (:func:`forbidden_getters`, the set
    Megatron's CI ratchet flags) and ``ProcessGroupCollection.use_mpu_process_groups`` raising
    :class:`MegatronGlobalsError`, wherever a loaded module holds them (the module itself and
    every ``from ...parallel_state import get_..``), and puts them back after, also when the body
    raises. Nested uses are one. Use it around model code built with ``pg_collection=`` to prove
    it reads no global state (direct reads of ``parallel_state._..`` variables are not seen).
    Process-wide: other threads see the refusals too while it is active.

    Yields:
        The refused getters' names.

    Raises:
        MegatronGlobalsError: in the body, on a call of a refused getter; the message names it,
            its caller and the fix.
    """
    global _depth
    with _lock:
        if _depth == 0:
            _swap_in()
        _depth += 1
    try:
        yield list(_names)
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _swap_back()
