"""parallelctx: one parallel context for distributed PyTorch training.

``from parallelctx import gpc, ParallelMode`` anywhere in model code; start the job with one of
the ``launch*`` functions or :func:`spawn`.
"""

from .config import Config, ConfigError, load_config
from .checkpoint import checkpoint, rng_context_fn
from .context import ModeView, NotLaunchedError, ParallelContext, RNGState, gpc
from .env import LaunchEnv, LaunchEnvError
from .launch import (
    SpawnError,
    init_dist,
    launch,
    launch_from_env,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
    spawn,
)
from .layout import Layout, LayoutError, ParallelMode, plan
from .mesh import MeshError
from .seed import REPLICA

__version__ = "0.1.0"

__all__ = [
    "Config",
    "ConfigError",
    "LaunchEnv",
    "LaunchEnvError",
    "Layout",
    "LayoutError",
    "MeshError",
    "ModeView",
    "NotLaunchedError",
    "ParallelContext",
    "ParallelMode",
    "REPLICA",
    "RNGState",
    "SpawnError",
    "checkpoint",
    "gpc",
    "init_dist",
    "launch",
    "launch_from_env",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
    "load_config",
    "plan",
    "rng_context_fn",
    "spawn",
]
