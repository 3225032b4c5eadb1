"""What every launcher detector shares: the variables launchers set, the error they raise, the
:class:`LaunchEnv` they return, and the reader and checks that keep their messages alike.

Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from ..planning.limits import MAX_WORLD_SIZE

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
