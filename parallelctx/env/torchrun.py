"""torchrun (torch elastic): RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_ADDR, ... ."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .base import LaunchEnv, LaunchEnvError, _check, _master, _Reader

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
