"""Launcher detection: what the environment says about this process's place in the job.

One detector per launcher. Each reads only environment variables and returns a
:class:`LaunchEnv`, or None when its launcher did not start this process; it raises
:class:`LaunchEnvError` when the variables are there but incomplete or contradict each other.

:data:`LAUNCHERS` is the one table of launchers, in detection order: each :class:`Launcher`
has its detector, the names ``init_dist`` accepts for it, the hint its errors give, and an
optional rendezvous hook that finds the master address where the launcher gives none (MPI:
rank 0 broadcasts it with mpi4py). :func:`detect`, ``launch_from_env``, ``init_dist`` and the
``launch_from_*`` functions all read this table. Nothing in this package imports torch.

One file per launcher family; each imports only :mod:`.base` (and :mod:`.ports` / :mod:`.hostlist`
where it needs them), and this file imports them all:

- ``base.py``: what every detector shares: :class:`LaunchEnv`, :class:`LaunchEnvError`,
  :func:`is_launcher_variable` (and the variable names behind it), the variable reader and the
  range checks;
- ``torchrun.py``: :func:`from_torchrun`;
- ``mpi.py``: :func:`from_mpi` (Open MPI, MVAPICH, PMI launchers) and its rendezvous hook
  (mpi4py);
- ``slurm.py``: :func:`from_slurm` and :func:`slurm_port`;
- ``plain.py``: :func:`from_env_vars` (plain ``env://`` variables) and :func:`single_process`
  (a world of one);
- ``ports.py``: :func:`free_port`;
- ``hostlist.py``: Slurm host lists, parsed without expanding them;
- ``__init__.py``: :class:`Launcher`, :data:`LAUNCHERS`, :func:`launcher_named`, :func:`detect`.

A new launcher (PBS, LSF, ...) is one file here and one entry in :data:`LAUNCHERS` (and one docs
page).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .base import LAUNCHER_NAMES as LAUNCHER_NAMES
from .base import LAUNCHER_PREFIXES as LAUNCHER_PREFIXES
from .base import LaunchEnv, LaunchEnvError, is_launcher_variable
from .mpi import MPI_HINT, _mpi4py_master, from_mpi
from .plain import ENV_HINT, from_env_vars, single_process
from .ports import free_port
from .slurm import SLURM_HINT, SLURM_PORT_RANGE, from_slurm, slurm_port
from .torchrun import TORCHRUN_HINT, from_torchrun

__all__ = [
    "LAUNCHERS",
    "SLURM_PORT_RANGE",
    "LaunchEnv",
    "LaunchEnvError",
    "Launcher",
    "detect",
    "free_port",
    "from_env_vars",
    "from_mpi",
    "from_slurm",
    "from_torchrun",
    "is_launcher_variable",
    "launcher_named",
    "single_process",
    "slurm_port",
]


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Launcher:
    """One launcher parallelctx knows: how to detect it and how its ranks meet.

    ``name`` is the launcher's key (``init_dist`` accepts it and ``aliases``); ``kinds`` are the
    :attr:`LaunchEnv.launcher` values its detector returns; ``detect(env, required)`` is the
    detector; ``hint`` tells the user how to start the job; ``rendezvous``, when set, returns
    ``(host, port)`` (or None when it cannot) for a world whose launcher gave no master address;
    ``doc`` is its docs page.
    """

    name: str
    aliases: tuple[str, ...]
    kinds: tuple[str, ...]
    detect: Callable[[Mapping[str, str] | None, bool], LaunchEnv | None]
    hint: str
    rendezvous: Callable[[LaunchEnv], tuple[str, int] | None] | None = None
    doc: str = ""


LAUNCHERS: tuple[Launcher, ...] = (
    Launcher(
        "torchrun",
        ("pytorch", "torch"),
        ("torchrun",),
        from_torchrun,
        TORCHRUN_HINT,
        doc="launchers/torchrun.md",
    ),
    Launcher(
        "mpi",
        ("openmpi", "mpich", "mvapich"),
        ("openmpi", "mpich", "mvapich"),
        from_mpi,
        MPI_HINT,
        rendezvous=_mpi4py_master,
        doc="launchers/mpi.md",
    ),
    Launcher("slurm", (), ("slurm",), from_slurm, SLURM_HINT, doc="launchers/slurm.md"),
    Launcher("env", ("env://",), ("env",), from_env_vars, ENV_HINT, doc="launchers/README.md"),
)
"""Every launcher, in detection order (see :func:`detect`)."""


def launcher_named(name: str) -> Launcher:
    """Return the launcher called ``name`` (its name or an alias, e.g. ``"pytorch"``) or the one
    whose detector returns that :attr:`LaunchEnv.launcher` (e.g. ``"openmpi"``).

    Raises:
        ValueError: no launcher has that name; the message lists the valid names.
    """
    for launcher in LAUNCHERS:
        if name == launcher.name or name in launcher.aliases or name in launcher.kinds:
            return launcher
    names = [n for entry in LAUNCHERS for n in (entry.name, *entry.aliases)]
    valid = ", ".join(repr(n) for n in names)
    close = difflib.get_close_matches(str(name).lower(), names, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"launcher={name!r} is not one of {valid}{hint}")


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Detect which launcher started this process and what it said.

    The entries of :data:`LAUNCHERS` are tried in order, the first that applies wins:

    1. torchrun: TORCHELASTIC_RUN_ID, or RANK + WORLD_SIZE + LOCAL_RANK (so torchrun started
       inside srun or sbatch is torchrun, not Slurm);
    2. MPI: OMPI_COMM_WORLD_RANK, MV2_COMM_WORLD_RANK or PMI_RANK, inside or outside Slurm
       (``mpirun`` inside an allocation also sets SLURM_PROCID, with the wrong values);
    3. a Slurm step: SLURM_PROCID with SLURM_STEP_ID (the batch or salloc shell of a job with
       more than one task, which has no SLURM_STEP_ID, is refused: start the script with srun);
    4. plain ``env://`` variables: RANK + WORLD_SIZE without LOCAL_RANK (Kubeflow's PyTorchJob);
    5. otherwise a world of one, unless WORLD_SIZE says more (then an error: never a silent
       world of one).

    Returns:
        The :class:`LaunchEnv`.

    Raises:
        LaunchEnvError: a launcher's variables are present but incomplete or inconsistent, this
            is a Slurm batch shell of a multi-task job, or WORLD_SIZE > 1 with no launcher.
    """
    env = os.environ if env is None else env
    for launcher in LAUNCHERS:
        found = launcher.detect(env, False)
        if found is not None:
            return found
    world = env.get("WORLD_SIZE")
    if world is not None and world.strip() not in ("", "0", "1"):
        raise LaunchEnvError(
            f"WORLD_SIZE={world!r} says this process is one of several, but no launcher set its "
            f"rank (RANK is not set); {ENV_HINT}"
        )
    return single_process()
