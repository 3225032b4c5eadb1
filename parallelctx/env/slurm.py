"""Slurm: a job step started by ``srun`` (and the batch or salloc shell, which is not one)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .base import LaunchEnv, LaunchEnvError, _check, _master, _Reader
from .hostlist import HostlistError, count_hostlist, first_host, tasks_on_node

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
