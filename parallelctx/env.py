"""Launcher detection: what the environment says about this process's place in the job.

Each detector reads only environment variables and returns a :class:`LaunchEnv`, or None when
its launcher did not start this process. Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

__all__ = ["LaunchEnv", "LaunchEnvError", "detect", "from_torchrun", "single_process"]


class LaunchEnvError(RuntimeError):
    """The environment is missing a variable a launcher must set, or contradicts itself."""


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher told this process.

    ``local_world_size`` and ``node_rank`` are None where the launcher does not say;
    ``master_addr``/``master_port`` are None where it gives no rendezvous address.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None

    def as_dict(self) -> dict[str, object]:
        """Return the fields as a plain dict."""
        return asdict(self)


def _int(env: Mapping[str, str], name: str, launcher_hint: str) -> int:
    value = env.get(name)
    if value is None:
        raise LaunchEnvError(f"{name} is not set; {launcher_hint}")
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"{name}={value!r} is not an integer; {launcher_hint}") from None


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"{name}={value!r} is not an integer") from None


TORCHRUN_HINT = "start the script with torchrun (e.g. torchrun --nproc-per-node 8 train.py)"


def from_torchrun(env: Mapping[str, str] | None = None, required: bool = False) -> LaunchEnv | None:
    """Read torchrun's (torch elastic's) variables.

    Returns:
        The :class:`LaunchEnv`, or None when neither TORCHELASTIC_RUN_ID nor RANK, WORLD_SIZE
        and LOCAL_RANK are set (unless ``required``).

    Raises:
        LaunchEnvError: a variable is missing (when ``required`` or partly set) or not an integer;
            the message names it and says to start the script with torchrun.
    """
    env = os.environ if env is None else env
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not required and "TORCHELASTIC_RUN_ID" not in env and not all(k in env for k in keys):
        return None
    rank = _int(env, "RANK", TORCHRUN_HINT)
    world_size = _int(env, "WORLD_SIZE", TORCHRUN_HINT)
    local_rank = _int(env, "LOCAL_RANK", TORCHRUN_HINT)
    if "MASTER_ADDR" not in env:
        raise LaunchEnvError(f"MASTER_ADDR is not set; {TORCHRUN_HINT}")
    port = _int(env, "MASTER_PORT", TORCHRUN_HINT)
    return LaunchEnv(
        launcher="torchrun",
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=_optional_int(env, "LOCAL_WORLD_SIZE"),
        node_rank=_optional_int(env, "GROUP_RANK"),
        master_addr=env["MASTER_ADDR"],
        master_port=port,
    )


def single_process() -> LaunchEnv:
    """Return the environment of a plain ``python train.py``: a world of one."""
    return LaunchEnv("none", rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0)


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Detect which launcher started this process and what it said.

    Checked in order: torchrun; otherwise a world of one.

    Returns:
        The :class:`LaunchEnv`.

    Raises:
        LaunchEnvError: a launcher's variables are present but incomplete or inconsistent.
    """
    env = os.environ if env is None else env
    found = from_torchrun(env)
    return found if found is not None else single_process()
