"""No launcher of its own: plain ``env://`` variables without LOCAL_RANK (Kubeflow's
PyTorchJob), and a world of one (a plain ``python train.py``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .base import LaunchEnv, LaunchEnvError, _check, _master, _Reader


def single_process() -> LaunchEnv:
    """Return the environment of a plain ``python train.py``: a world of one."""
    return LaunchEnv(
        launcher="none", rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1
    )


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
