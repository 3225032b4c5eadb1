"""parallelctx: one parallel context for distributed PyTorch training.

``from parallelctx import gpc, ParallelMode`` anywhere in model code; start the job with one of
the ``launch*`` functions or :func:`spawn`.

The config, the layout maths and launcher detection import without torch (so ``parallelctx
plan`` runs on a login node); ``gpc``, the launch functions, ``spawn`` and ``checkpoint`` load
torch on first use (PEP 562 module attributes).

PYTEST_DONT_REWRITE: the pytest plugin's rank processes import this package before their pytest
session starts; the marker keeps pytest from warning (an error under ``filterwarnings = error``)
that it cannot rewrite asserts here, and the package has none to rewrite.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

from .config import Config, ConfigError, ConfigValidationError, load_config
from .env import LaunchEnv, LaunchEnvError
from .planning.layout import Layout, LayoutError, ParallelMode, plan
from .runtime.mesh import MeshError

if TYPE_CHECKING:
    from .checkpoint import checkpoint, rng_context_fn
    from .clip import clip_grad_norm_, grad_norm
    from .context import ModeView, NotLaunchedError, ParallelContext, RNGState, gpc
    from .guard.hang import HangReport
    from .launch import (
        init_dist,
        launch,
        launch_from_env,
        launch_from_openmpi,
        launch_from_slurm,
        launch_from_torch,
    )
    from .runtime.seed import REPLICA
    from .spawn import SpawnError, spawn

__version__ = "0.1.0"

# Names that load torch, and the module each comes from.
_LAZY = {
    "checkpoint": "checkpoint",
    "rng_context_fn": "checkpoint",
    "clip_grad_norm_": "clip",
    "grad_norm": "clip",
    "HangReport": "guard.hang",
    "ModeView": "context",
    "NotLaunchedError": "context",
    "ParallelContext": "context",
    "RNGState": "context",
    "gpc": "context",
    "init_dist": "launch",
    "launch": "launch",
    "launch_from_env": "launch",
    "launch_from_openmpi": "launch",
    "launch_from_slurm": "launch",
    "launch_from_torch": "launch",
    "LocalRankError": "local",
    "run_local": "local",
    "REPLICA": "runtime.seed",
    "ReformError": "runtime.reform",
    "Reformed": "runtime.reform",
    "SpawnError": "spawn",
    "spawn": "spawn",
}


def __getattr__(name: str) -> Any:
    """Load a torch-backed name on first use (PEP 562).

    Raises:
        AttributeError: ``name`` is not a name of parallelctx.
    """
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'parallelctx' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """The package module: importing the submodule ``parallelctx.launch`` (or ``spawn``,
    ``checkpoint``) must not replace the function of the same name on the package."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == name:
            return  # the submodule stays in sys.modules; the package name means the function
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

# Modules that moved into the layers (docs/internals.md) -> where they live now. The old name
# imports the same module object, so ``import parallelctx.abort``, ``from parallelctx.seed import
# mode_seed``, ``monkeypatch.setattr(parallelctx.abort, ...)`` and pickles that name an old path
# keep working.
MOVED = {
    "_fastenum": "planning._fastenum",
    "limits": "planning.limits",
    "layout": "planning.layout",
    "views": "planning.views",
    "args": "config.args",
    "hostlist": "env.hostlist",
    "abort": "guard.abort",
    "hang": "guard.hang",
    "rendezvous": "runtime.rendezvous",
    "groups": "runtime.groups",
    "startup": "runtime.startup",
    "mesh": "runtime.mesh",
    "seed": "runtime.seed",
    "rngstate": "runtime.rngstate",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``parallelctx.<old name>`` for every module of :data:`MOVED` and gives the module at
    its new place (imported then), not a copy."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        """Return a spec for an old name of :data:`MOVED`, else None (other finders look)."""
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        """Import and return the module at its new place (its own spec kept in ``spec``)."""
        module = importlib.import_module(f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Give the module back its own spec (the import system set the old name's on it)."""
        if module.__spec__ is not None and module.__spec__.loader_state is not None:
            module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


__all__ = [
    "REPLICA",
    "Config",
    "ConfigError",
    "ConfigValidationError",
    "HangReport",
    "LaunchEnv",
    "LaunchEnvError",
    "Layout",
    "LayoutError",
    "LocalRankError",
    "MeshError",
    "ModeView",
    "NotLaunchedError",
    "ParallelContext",
    "ParallelMode",
    "RNGState",
    "ReformError",
    "Reformed",
    "SpawnError",
    "checkpoint",
    "clip_grad_norm_",
    "gpc",
    "grad_norm",
    "init_dist",
    "launch",
    "launch_from_env",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "load_config",
    "plan",
    "rng_context_fn",
    "run_local",
    "spawn",
]
