"""The dry run's way to meet: a default group on torch's ``fake`` backend with its in-process
``FakeStore`` (no store server, no other process, no rendezvous), and simulated host names.

The start-up takes it instead of :func:`parallelctx.runtime.meetings.init_default_group` for
``launch(simulate=...)`` and under ``parallelctx dry-run``; everything after the meeting (this
rank's groups, ``gpc.device_mesh``, the bridges, seeds) runs as on the real rank, while
collectives return at once and their results are not real (docs/dry_run.md).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..planning.simulation import SimulatedHosts, Simulation
from .meetings import DefaultGroup

__all__ = ["fake_default_group", "meet"]


def fake_default_group(rank: int, world_size: int, timeout: Any) -> None:
    """Initialise the default group on torch's ``fake`` backend with a ``FakeStore``; returns None.

    Raises:
        RuntimeError: torch refused (already initialised).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size, timeout=timeout)


def meet(sim: Simulation, timeout: timedelta) -> DefaultGroup:
    """Be rank ``sim.rank`` of ``sim.world_size`` on the fake backend.

    Returns:
        A :class:`DefaultGroup` (backend ``"fake"``, owned, no store) whose host names are
        ``node<i>`` with ``i = rank // nproc_per_node``.

    Raises:
        RuntimeError: torch.distributed is already initialised in this process.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "a dry run makes its own default group on the fake backend, but torch.distributed is "
            "already initialised in this process; call torch.distributed.destroy_process_group() first"
        )
    fake_default_group(sim.rank, sim.world_size, timeout)
    return DefaultGroup("fake", True, timeout, SimulatedHosts(sim.world_size, sim.nproc_per_node))
