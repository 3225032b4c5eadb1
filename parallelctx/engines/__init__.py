"""gpc under the engines that own the process group (Accelerate, Lightning Fabric, Ray Train):
the engines' own calls that would be wrong under gpc's model parallelism made right or refused
(:mod:`parallelctx.engines.guard`), and :func:`save` / :func:`load`, checkpoints that keep every
shard (:mod:`parallelctx.engines.shards`, imported on first use: it loads
``torch.distributed.checkpoint``). docs/engines.md has each engine's recipe.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .guard import EngineGuard, EngineMisuseError

if TYPE_CHECKING:
    from .shards import load, save, shard_key

__all__ = ["EngineGuard", "EngineMisuseError", "guard_engines", "load", "save", "shard_key"]


def __getattr__(name: str) -> Any:
    """``save``, ``load`` and ``shard_key`` from :mod:`parallelctx.engines.shards`, imported on
    first use. Raises AttributeError for any other name."""
    if name in ("load", "save", "shard_key"):
        return getattr(importlib.import_module(".shards", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def guard_engines(ctx: Any) -> EngineGuard | None:
    """Guard the engines imported now for the launched context ``ctx`` (the ``launch*``
    functions call it after each launch): the replaced methods are put back by
    ``ctx.destroy()`` and replaced again after ``ctx.reform()``.

    Returns:
        The guard, or None when no engine is imported (nothing replaced).
    """
    guard = EngineGuard()
    guard.install(ctx)
    if not guard:
        return None
    ctx.add_destroy_hook(guard.restore, on_reform=lambda: guard_engines(ctx))
    return guard
