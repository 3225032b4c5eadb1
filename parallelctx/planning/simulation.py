"""The world a dry run plays, torch-free: which rank of how many ranks on how many per node, the
variables torchrun would give that rank, and every rank's simulated host name.

``parse_simulate`` checks ``launch(simulate=...)``; the fake world itself (torch's ``fake``
backend) is :mod:`parallelctx.runtime.simulate`, the report is :mod:`parallelctx.guard.recorder`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .limits import MAX_WORLD_SIZE

__all__ = ["SimulatedHosts", "Simulation", "parse_simulate", "torchrun_environment"]


@dataclass(frozen=True)
class Simulation:
    """Which rank of which world this process plays: ``world_size``, ``rank`` and the ranks per
    node, ``nproc_per_node`` (node = rank // nproc_per_node, as torchrun places them)."""

    world_size: int
    rank: int
    nproc_per_node: int

    @property
    def local_rank(self) -> int:
        """This rank's index on its node."""
        return self.rank % self.nproc_per_node

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.rank // self.nproc_per_node


def parse_simulate(value: Any) -> Simulation:
    """Check ``simulate=`` (a mapping with ``world_size``, ``rank`` and optionally
    ``nproc_per_node``, default 8 where 8 divides the world, else 1) or a :class:`Simulation`.

    Returns:
        The :class:`Simulation`.

    Raises:
        ValueError: a missing or unknown key, or a value out of range (the message names it).
    """
    if isinstance(value, Simulation):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"simulate={value!r} must be a dict such as dict(world_size=16384, rank=12345)")
    unknown = sorted(set(value) - {"world_size", "rank", "nproc_per_node"})
    if unknown:
        raise ValueError(
            f"simulate= got unknown keys {unknown}; it takes world_size, rank and nproc_per_node"
        )

    def whole(name: str, default: int | None = None) -> int:
        got = value.get(name, default)
        if got is None:
            raise ValueError(f"simulate= needs {name}=<int>, e.g. simulate=dict(world_size=16384, rank=0)")
        if isinstance(got, bool) or not isinstance(got, int):
            raise ValueError(f"simulate {name}={got!r} must be an integer")
        return got

    world = whole("world_size")
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise ValueError(f"simulate world_size={world} must lie in [1, {MAX_WORLD_SIZE}]")
    rank = whole("rank")
    if not 0 <= rank < world:
        raise ValueError(f"simulate rank={rank} must lie in [0, world_size={world})")
    per_node = whole("nproc_per_node", 8 if world % 8 == 0 else 1)
    if per_node < 1 or world % per_node:
        raise ValueError(
            f"simulate nproc_per_node={per_node} must be a positive divisor of world_size={world}"
        )
    return Simulation(world, rank, per_node)


def torchrun_environment(sim: Simulation) -> dict[str, str]:
    """Return the variables torchrun would give ``sim``'s rank (RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, TORCHELASTIC_RUN_ID); the address is never contacted in a dry run."""
    return {
        "RANK": str(sim.rank),
        "WORLD_SIZE": str(sim.world_size),
        "LOCAL_RANK": str(sim.local_rank),
        "LOCAL_WORLD_SIZE": str(sim.nproc_per_node),
        "GROUP_RANK": str(sim.node),
        "GROUP_WORLD_SIZE": str(sim.world_size // sim.nproc_per_node),
        "ROLE_RANK": str(sim.rank),
        "ROLE_WORLD_SIZE": str(sim.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "parallelctx-dry-run",
    }


class SimulatedHosts(Sequence[str]):
    """Every rank's host name in a simulated world (``node<i>``, i = rank // nproc_per_node),
    computed on demand: its memory does not grow with the world."""

    def __init__(self, world_size: int, nproc_per_node: int) -> None:
        self._world = world_size
        self._per_node = nproc_per_node

    def __len__(self) -> int:
        return self._world

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._world)))
        i = int(index)
        if i < 0:
            i += self._world
        if not 0 <= i < self._world:
            raise IndexError(f"rank {index} outside the simulated world of {self._world}")
        return f"node{i // self._per_node}"

    def __iter__(self) -> Iterator[str]:
        for node in range(self._world // self._per_node):
            name = f"node{node}"
            for _ in range(self._per_node):
                yield name
