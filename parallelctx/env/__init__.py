"""Launcher detection: what the environment says about this process's place in the job.

One detector per launcher. Each reads only environment variables and returns a
:class:`LaunchEnv`, or None when its launcher did not start this process; it raises
:class:`LaunchEnvError` when the variables are there but incomplete or contradict each other.

:data:`LAUNCHERS` is the one table of launchers, in detection order: each :class:`Launcher`
has its detector, the names ``init_dist`` accepts for it, the hint its errors give, and an
optional rendezvous hook that finds the master address where the launcher gives none (MPI:
rank 0 broadcasts it with mpi4py). :func:`detect`, ``launch_from_env``, ``init_dist`` and the
``launch_from_*`` functions all read this table; adding a launcher (PBS, LSF, ...) is one
detector, one entry and one docs page. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import os
import random
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

from ..planning.limits import MAX_WORLD_SIZE
from .hostlist import HostlistError, count_hostlist, first_host, tasks_on_node

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


LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "TORCHELASTIC_", "MPI_LOCAL")
LAUNCHER_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def is_launcher_variable(name: str) -> bool:
    """Return True for an environment variable a launcher sets (torchrun's, Slurm's, MPI's), the
    ones to strip for a process that must not look launched."""
    return name.startswith(LAUNCHER_PREFIXES) or name in LAUNCHER_NAMES


class LaunchEnvError(RuntimeError):
    """The environment is missing a variable a launcher must set, or contradicts itself."""


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """What a launcher told this process.

    ``launcher`` is ``"torchrun"``, ``"slurm"``, ``"openmpi"``, ``"mpich"`` (any PMI launcher:
    MPICH/Intel MPI Hydra, ``srun --mpi=pmi2``), ``"mvapich"`` or ``"none"`` (a world of one).
    ``local_rank`` is None only where the launcher gives no local rank (it is then derived from
    the host names at launch). ``local_world_size``, ``node_rank`` and ``num_nodes`` are None
    where the launcher does not say; ``master_addr``/``master_port`` are None where it gives no
    rendezvous address. ``variables`` lists the environment variables read, with their values.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    num_nodes: int | None = None
    variables: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    def as_dict(self) -> dict[str, object]:
        """Return the fields as a plain dict (``variables`` as a dict)."""
        out = asdict(self)
        out["variables"] = dict(self.variables)
        return out


_INTEGER = re.compile(r"-?[0-9]{1,18}")


class _Reader:
    """Reads variables from one environment and remembers which it read."""

    def __init__(self, env: Mapping[str, str], hint: str) -> None:
        self.env = env
        self.hint = hint
        self.seen: dict[str, str] = {}

    def get(self, name: str) -> str | None:
        value = self.env.get(name)
        if value is not None:
            self.seen[name] = value
        return value

    def first(self, *names: str) -> tuple[str, str] | None:
        """Return (name, value) of the first of ``names`` that is set and not empty."""
        for name in names:
            value = self.get(name)
            if value is not None and value != "":
                return name, value
        return None

    def req_int(self, *names: str) -> int:
        found = self.first(*names)
        if found is None:
            raise LaunchEnvError(f"{' / '.join(names)} is not set; {self.hint}")
        return self._parse(*found)

    def opt_int(self, *names: str) -> int | None:
        found = self.first(*names)
        return None if found is None else self._parse(*found)

    def _parse(self, name: str, value: str) -> int:
        # int() would also take '1_0', '+1', ' 1' and non-ASCII digits; launchers write plain digits
        if not _INTEGER.fullmatch(value):
            shown = value if len(value) <= 40 else value[:37] + "..."
            raise LaunchEnvError(
                f"{name}={shown!r} is not an integer; {self.hint} (launchers write plain digits "
                "0-9, at most 18 of them)"
            )
        return int(value)

    def variables(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self.seen.items()))


def _check(
    launcher: str,
    rank: int,
    world: int,
    local: int | None,
    local_world: int | None,
    node: int | None,
    nodes: int | None,
    names: tuple[str, str, str, str, str, str],
) -> None:
    """Raise LaunchEnvError when the numbers a launcher gave contradict each other."""
    r, w, lr, lw, nr, nn = names
    if world < 1:
        raise LaunchEnvError(f"{launcher}: {w}={world} must be at least 1")
    if world > MAX_WORLD_SIZE:
        raise LaunchEnvError(
            f"{launcher}: {w}={world} is larger than the largest world parallelctx supports, "
            f"MAX_WORLD_SIZE={MAX_WORLD_SIZE}; the variable is damaged or was set by hand"
        )
    if not 0 <= rank < world:
        raise LaunchEnvError(f"{launcher}: {r}={rank} must lie in [0, {w}={world})")
    if local_world is not None:
        if not 1 <= local_world <= world:
            raise LaunchEnvError(f"{launcher}: {lw}={local_world} must lie in [1, {w}={world}]")
        if local is not None and not 0 <= local < local_world:
            raise LaunchEnvError(f"{launcher}: {lr}={local} must lie in [0, {lw}={local_world})")
    if local is not None and not 0 <= local < world:
        raise LaunchEnvError(f"{launcher}: {lr}={local} must lie in [0, {w}={world})")
    if node is not None and not 0 <= node < world:
        raise LaunchEnvError(f"{launcher}: {nr}={node} must lie in [0, {w}={world})")
    if nodes is not None:
        if not 1 <= nodes <= world:
            raise LaunchEnvError(f"{launcher}: {nn}={nodes} must lie in [1, {w}={world}]")
        if node is not None and not 0 <= node < nodes:
            raise LaunchEnvError(f"{launcher}: {nr}={node} must lie in [0, {nn}={nodes})")


def _master(reader: _Reader) -> tuple[str | None, int | None]:
    addr = reader.get("MASTER_ADDR") or None
    port = reader.opt_int("MASTER_PORT")
    if port is not None and not 0 < port < 65536:
        raise LaunchEnvError(f"MASTER_PORT={port} must be a TCP port in 1..65535")
    return addr, port


# --------------------------------------------------------------------------- torchrun

TORCHRUN_HINT = "start the script with torchrun (e.g. torchrun --nproc-per-node 8 train.py)"


def from_torchrun(env: Mapping[str, str] | None = None, required: bool = False) -> LaunchEnv | None:
    """Read torchrun's (torch elastic's) variables: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK (node index), GROUP_WORLD_SIZE (nodes), MASTER_ADDR, MASTER_PORT.

    Returns:
        The :class:`LaunchEnv`, or None when neither TORCHELASTIC_RUN_ID nor RANK, WORLD_SIZE
        and LOCAL_RANK are set (unless ``required``).

    Raises:
        LaunchEnvError: a variable is missing (when ``required`` or partly set), not an integer,
            or out of range; the message names it and says to start the script with torchrun.
    """
    env = os.environ if env is None else env
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not required and "TORCHELASTIC_RUN_ID" not in env and not all(k in env for k in keys):
        return None
    rd = _Reader(env, TORCHRUN_HINT)
    rd.get("TORCHELASTIC_RUN_ID")
    rank, world, local = rd.req_int("RANK"), rd.req_int("WORLD_SIZE"), rd.req_int("LOCAL_RANK")
    local_world = rd.opt_int("LOCAL_WORLD_SIZE")
    node, nodes = rd.opt_int("GROUP_RANK"), rd.opt_int("GROUP_WORLD_SIZE")
    addr, port = _master(rd)
    if addr is None:
        raise LaunchEnvError(f"MASTER_ADDR is not set; {TORCHRUN_HINT}")
    if port is None:
        raise LaunchEnvError(f"MASTER_PORT is not set; {TORCHRUN_HINT}")
    _check(
        "torchrun",
        rank,
        world,
        local,
        local_world,
        node,
        nodes,
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"),
    )
    return LaunchEnv(
        launcher="torchrun",
        rank=rank,
        world_size=world,
        local_rank=local,
        local_world_size=local_world,
        node_rank=node,
        master_addr=addr,
        master_port=port,
        num_nodes=nodes,
        variables=rd.variables(),
    )


# --------------------------------------------------------------------------- MPI

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


# --------------------------------------------------------------------------- Slurm

SLURM_HINT = "start every task with srun (e.g. srun -N2 --ntasks-per-node=4 python train.py)"
SLURM_PORT_RANGE = (15000, 30000)
"""Ports derived from the Slurm job id lie in [15000, 30000): below Linux's ephemeral range
(32768-60999), so an OS-chosen port never takes them."""


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """Return the rendezvous port derived from a Slurm job (and step) id.

    Consecutive job ids get ports 16 apart and steps 0-15 of one job get distinct ports, so two
    jobs (or concurrent steps) sharing a node do not collide unless their ids are ~900 apart.

    Returns:
        A port in :data:`SLURM_PORT_RANGE`.
    """
    lo, hi = SLURM_PORT_RANGE
    return lo + (job_id * 16 + step_id % 16) % (hi - lo)


def _batch_shell_error(rd: _Reader, ntasks: int) -> LaunchEnvError:
    job = rd.get("SLURM_JOB_ID") or rd.get("SLURM_JOBID") or "?"
    return LaunchEnvError(
        f"this is the batch shell of Slurm job {job}, or its salloc shell (SLURM_NTASKS={ntasks}, no "
        f"SLURM_STEP_ID): one process, but the job asks for {ntasks} tasks, so the other ranks would "
        f"never come. Start the script with srun (srun python train.py, also inside the batch "
        f"script), or run it with --ntasks=1"
    )


def from_slurm(env: Mapping[str, str] | None = None, required: bool = False) -> LaunchEnv | None:
    """Read the variables of a Slurm job step (a task started by ``srun``).

    Rank SLURM_PROCID; world size SLURM_STEP_NUM_TASKS, else SLURM_NTASKS, else SLURM_NPROCS;
    local rank SLURM_LOCALID; node index SLURM_NODEID; nodes SLURM_STEP_NUM_NODES / SLURM_NNODES;
    processes on this node from SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE. Master address:
    MASTER_ADDR when set, else the first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST /
    SLURM_NODELIST (parsed in Python). Port: MASTER_PORT, else :func:`slurm_port` of the job id.

    Returns:
        The :class:`LaunchEnv`, or None outside Slurm (neither SLURM_PROCID nor SLURM_JOB_ID),
        or in the batch or salloc shell of a one-task job (a world of one) (unless ``required``).

    Raises:
        LaunchEnvError: a batch or salloc shell (no SLURM_STEP_ID) of a job with more than one
            task, where only srun can start the ranks; a variable missing, not an integer or out
            of range; a node list that does not parse or disagrees with the node count.
    """
    env = os.environ if env is None else env
    if not required and "SLURM_PROCID" not in env and "SLURM_JOB_ID" not in env and "SLURM_JOBID" not in env:
        return None
    rd = _Reader(env, SLURM_HINT)
    step = rd.first("SLURM_STEP_ID", "SLURM_STEPID")
    if step is None:
        ntasks = rd.opt_int("SLURM_NTASKS", "SLURM_NPROCS") or 1
        if ntasks > 1:
            raise _batch_shell_error(rd, ntasks)
        if not required:
            return None
        raise LaunchEnvError(f"SLURM_STEP_ID is not set: this process was not started by srun; {SLURM_HINT}")
    step_id = rd._parse(*step)
    rank = rd.req_int("SLURM_PROCID")
    world = rd.req_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    local = rd.req_int("SLURM_LOCALID")
    node = rd.opt_int("SLURM_NODEID")
    nodes = rd.opt_int("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    local_world = None
    per_node = rd.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if per_node is not None and node is not None:
        try:
            local_world = tasks_on_node(per_node[1], node)  # no expansion: the list may be huge
        except HostlistError as exc:
            raise LaunchEnvError(f"{per_node[0]}: {exc}") from None
    _check(
        "slurm",
        rank,
        world,
        local,
        local_world,
        node,
        nodes,
        (
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            per_node[0] if per_node else "-",
            "SLURM_NODEID",
            "SLURM_STEP_NUM_NODES",
        ),
    )
    addr, port = _master(rd)
    nodelist = rd.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if nodelist is not None:
        try:  # the first host and the count, without expanding the list (it may be huge)
            first, count = first_host(nodelist[1]), count_hostlist(nodelist[1])
        except HostlistError as exc:
            raise LaunchEnvError(f"{nodelist[0]}: {exc}") from None
        if nodes is not None and nodelist[0] == "SLURM_STEP_NODELIST" and count != nodes:
            shown = nodelist[1] if len(nodelist[1]) <= 60 else nodelist[1][:57] + "..."
            raise LaunchEnvError(
                f"SLURM_STEP_NODELIST={shown!r} names {count} hosts but the step has "
                f"{nodes} nodes; the environment is inconsistent (was it copied from another step?)"
            )
        addr = addr or first
    if addr is None:
        raise LaunchEnvError(
            "neither MASTER_ADDR nor SLURM_STEP_NODELIST / SLURM_JOB_NODELIST is set, so the rank-0 "
            f"host is unknown; {SLURM_HINT}, or export MASTER_ADDR"
        )
    if port is None:
        job = rd.opt_int("SLURM_JOB_ID", "SLURM_JOBID")
        if job is None:
            raise LaunchEnvError("neither MASTER_PORT nor SLURM_JOB_ID is set; export MASTER_PORT")
        port = slurm_port(job, step_id)
    return LaunchEnv(
        launcher="slurm",
        rank=rank,
        world_size=world,
        local_rank=local,
        local_world_size=local_world,
        node_rank=node,
        master_addr=addr,
        master_port=port,
        num_nodes=nodes,
        variables=rd.variables(),
    )


# --------------------------------------------------------------------------- detection


def single_process() -> LaunchEnv:
    """Return the environment of a plain ``python train.py``: a world of one."""
    return LaunchEnv(
        launcher="none", rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1
    )


# --------------------------------------------------------------------------- env:// (no LOCAL_RANK)

ENV_HINT = (
    "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT on every process (LOCAL_RANK too where "
    "known), or start the script with torchrun"
)


def from_env_vars(env: Mapping[str, str] | None = None, required: bool = False) -> LaunchEnv | None:
    """Read the plain ``env://`` variables that launchers such as Kubeflow's PyTorchJob set
    without LOCAL_RANK: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. The local rank is then
    derived at launch from the host names (as for launchers that give none).

    Returns:
        The :class:`LaunchEnv` (launcher ``"env"``), or None when RANK and WORLD_SIZE are not
        both set (unless ``required``).

    Raises:
        LaunchEnvError: a variable is missing, not an integer or out of range; the message names it.
    """
    env = os.environ if env is None else env
    if not required and not ("RANK" in env and "WORLD_SIZE" in env):
        return None
    rd = _Reader(env, ENV_HINT)
    rank, world = rd.req_int("RANK"), rd.req_int("WORLD_SIZE")
    local = rd.opt_int("LOCAL_RANK")
    addr, port = _master(rd)
    _check(
        "env",
        rank,
        world,
        local,
        None,
        None,
        None,
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"),
    )
    if world > 1 and (addr is None or port is None):
        missing = " and ".join(n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None)
        raise LaunchEnvError(f"RANK={rank} WORLD_SIZE={world} without {missing}; {ENV_HINT}")
    return LaunchEnv(
        launcher="env",
        rank=rank,
        world_size=world,
        local_rank=local,
        master_addr=addr,
        master_port=port,
        variables=rd.variables(),
    )


# --------------------------------------------------------------------------- rendezvous hooks


_PORT_FLOOR = 15000  # lowest port free_port draws (above most registered services' ports)


def _ephemeral_low() -> int:
    """The lowest port Linux hands out for outgoing connections (32768 where unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    It is drawn at random below the range the OS hands out for outgoing connections
    (``/proc/sys/net/ipv4/ip_local_port_range``): a port the OS picks (``bind(0)``) comes from
    that range, where any process's next outgoing connection (gloo opens many) may take it
    before the store binds it; below it only another program's explicit bind can. When no
    port there binds in 64 draws, the OS picks one. Raises ``OSError`` when ``host`` cannot be
    bound at all."""
    low = _ephemeral_low()
    draw = random.Random()
    if low - _PORT_FLOOR >= 1000:
        for _ in range(64):
            port = draw.randrange(_PORT_FLOOR, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
