"""Dry runs: this process acts as one rank of a world of any size, on torch's ``fake`` backend.

``gpc.launch(config, simulate=dict(world_size=16384, rank=12345))`` (and ``parallelctx dry-run``,
which arms the same for a script that calls ``launch_from_torch``) makes the default group on
torch's ``fake`` backend with its in-process ``FakeStore``: no store server, no other process.
Every subgroup, ``gpc.device_mesh``, the Megatron and torchtitan bridges and DTensor sharding on
meta or CPU tensors then run as on the real rank; collectives return at once and their results
are not real (the first one of each kind logs that once). See docs/dry_run.md.

This module is the script's side: :func:`record` adds a value to the rank's report. The parts
live in the layers and are named here too: the simulated world (:mod:`parallelctx.planning.simulation`:
:class:`Simulation`, :func:`parse_simulate`, :class:`SimulatedHosts`, :func:`torchrun_environment`),
the report and its recorders (:mod:`parallelctx.guard.recorder`: :class:`DryRun`, :class:`GroupCall`,
:func:`install_recorders`, :data:`COLLECTIVES`, :data:`NOT_FORWARDED`) and the fake world's meeting
(:mod:`parallelctx.runtime.simulate`: :func:`fake_default_group`).
"""

from __future__ import annotations

import json
from typing import Any

from .context import gpc
from .guard.recorder import COLLECTIVES, NOT_FORWARDED, DryRun, GroupCall, install_recorders
from .planning.layout import LayoutError, ParallelMode
from .planning.simulation import SimulatedHosts, Simulation, parse_simulate, torchrun_environment
from .runtime.simulate import fake_default_group

__all__ = [
    "COLLECTIVES",
    "NOT_FORWARDED",
    "DryRun",
    "GroupCall",
    "SimulatedHosts",
    "Simulation",
    "fake_default_group",
    "install_recorders",
    "parse_simulate",
    "record",
    "torchrun_environment",
]


def record(
    key: str, value: Any, same_across: ParallelMode | str | None = None, module: str | None = None
) -> None:
    """Add ``key: value`` to this rank's dry-run report (a no-op outside a dry run, so scripts
    keep the call). ``value`` must be JSON-serialisable (lists, dicts, numbers, strings;
    ``list(p.shape)`` for a shape). ``same_across="tensor"`` declares that every rank of a tensor
    group must record the same value; ``parallelctx dry-run --ranks`` checks it. ``module``
    (``parallel.modules``): the groups are that module's (default: the rank's primary module).

    Raises:
        TypeError: ``key`` is not a string, or ``value`` does not serialise to JSON.
        LayoutError: ``same_across`` names no parallel mode, or ``module`` is given without
            ``same_across``.
    """
    if not isinstance(key, str):
        raise TypeError(f"record() takes a string key, not {key!r}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"record({key!r}, ...): the value must serialise to JSON ({exc}); "
            "record list(tensor.shape), not the tensor"
        ) from None
    mode = ParallelMode.parse(same_across).value if same_across is not None else None
    if module is not None and mode is None:
        raise LayoutError(f"record({key!r}, ..., module={module!r}) needs same_across=<mode> of that module")
    dry = gpc.dry_run
    if dry is None:
        return
    dry.values[key] = value
    if mode is not None:
        dry.same_across[key] = mode if module is None else f"{module}:{mode}"
