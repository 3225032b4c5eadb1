"""MPI launchers: Open MPI, MVAPICH and PMI launchers (MPICH, Intel MPI's Hydra,
``srun --mpi=pmi2``), and the rendezvous hook that finds the master address MPI does not give
(rank 0 broadcasts it with mpi4py)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from .base import LaunchEnv, LaunchEnvError, _check, _master, _Reader
from .ports import free_port

MPI_HINT = (
    "start the script with mpirun / mpiexec (e.g. mpirun -np 8 python train.py) so that every rank "
    "gets OMPI_COMM_WORLD_* (Open MPI), PMI_RANK/PMI_SIZE (MPICH, Intel MPI) or MV2_COMM_WORLD_* "
    "(MVAPICH)"
)

# launcher: (rank, size, local rank, local size) variable names
_MPI_VARS = {
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "mvapich": (
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


def _check_other_mpi(rd: _Reader, launcher: str, rank: int, world: int) -> None:
    """Raise LaunchEnvError when another MPI family's rank variables are set and disagree."""
    rank_var, size_var = _MPI_VARS[launcher][:2]
    for other, (other_rank_var, other_size_var, _, _) in _MPI_VARS.items():
        if other == launcher or other_rank_var not in rd.env:
            continue
        other_rank = rd.req_int(other_rank_var)
        other_world = rd.opt_int(other_size_var)
        if other_rank != rank or other_world not in (None, world):
            raise LaunchEnvError(
                f"{rank_var}={rank}, {size_var}={world} ({launcher}) disagree with "
                f"{other_rank_var}={other_rank}, {other_size_var}={other_world} ({other}): two MPI "
                f"launchers left their variables in this environment, so the rank is ambiguous; "
                f"unset the stale {other} variables (e.g. a job started inside another MPI job), or "
                f"start the script with one launcher"
            )


def from_mpi(env: Mapping[str, str] | None = None, required: bool = False) -> LaunchEnv | None:
    """Read an MPI launcher's variables: Open MPI (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE),
    MVAPICH (MV2_COMM_WORLD_*), or a PMI launcher (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID,
    MPI_LOCALNRANKS: MPICH and Intel MPI's Hydra, ``srun --mpi=pmi2``). MASTER_ADDR and
    MASTER_PORT are taken when set; MPI itself gives no rendezvous address.

    Returns:
        The :class:`LaunchEnv`, or None when no MPI rank variable is set (unless ``required``).
        ``local_rank`` is None where the launcher gives none (``srun --mpi=pmi2``).

    When the variables of two MPI families are set (e.g. OMPI_COMM_WORLD_RANK and PMI_RANK), the
    first in the order above is used and the other must agree with it on rank and world size.

    Raises:
        LaunchEnvError: a variable is missing, not an integer or out of range; two MPI families
            whose rank or world size disagree; Hydra started
            with ``-pmi-port`` (PMI_ID without PMI_RANK/PMI_SIZE); or ``required`` and no MPI
            variables at all.
    """
    env = os.environ if env is None else env
    for launcher, (rank_var, size_var, local_var, local_size_var) in _MPI_VARS.items():
        if rank_var not in env:
            continue
        rd = _Reader(env, MPI_HINT)
        rank, world = rd.req_int(rank_var), rd.req_int(size_var)
        local, local_world = rd.opt_int(local_var), rd.opt_int(local_size_var)
        addr, port = _master(rd)
        _check(
            launcher,
            rank,
            world,
            local,
            local_world,
            None,
            None,
            (rank_var, size_var, local_var, local_size_var, "-", "-"),
        )
        _check_other_mpi(rd, launcher, rank, world)
        return LaunchEnv(
            launcher=launcher,
            rank=rank,
            world_size=world,
            local_rank=local,
            local_world_size=local_world,
            master_addr=addr,
            master_port=port,
            variables=rd.variables(),
        )
    if "PMI_ID" in env and "PMI_PORT" in env:
        raise LaunchEnvError(
            f"PMI_ID={env['PMI_ID']!r} and PMI_PORT are set but not PMI_RANK/PMI_SIZE: mpiexec was "
            "started with -pmi-port, which keeps the rank and world size out of the environment; "
            "start it without -pmi-port"
        )
    if required:
        raise LaunchEnvError(f"no MPI rank variable is set; {MPI_HINT}")
    return None


# --------------------------------------------------------------------------- rendezvous hook


def _mpi4py_master(found: LaunchEnv) -> tuple[str, int] | None:
    """Rank 0's host name and a free port of it, broadcast with mpi4py; None without mpi4py."""
    try:
        from mpi4py import MPI  # optional dependency
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != found.world_size or comm.Get_rank() != found.rank:
        raise LaunchEnvError(
            f"mpi4py sees rank {comm.Get_rank()} of {comm.Get_size()} but the launcher says rank "
            f"{found.rank} of {found.world_size}: mpi4py is built against another MPI than the one "
            "that started this job; export MASTER_ADDR and MASTER_PORT instead"
        )
    mine = (socket.gethostname(), free_port("")) if found.rank == 0 else None
    host, port = comm.bcast(mine, root=0)
    return str(host), int(port)
