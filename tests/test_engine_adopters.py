"""Accelerate and Lightning Fabric (make test-engines): gpc on the default group the engine made,
under real torchrun.

tests/engine_<name>_train.py (4 CPU ranks) lets the engine create the default group, launches gpc
with tensor=2 on it (adoption), trains the tensor-parallel MLP with the engine's optimizer wrapper
and backward and DDP over gpc's data group, compares with the serial run, destroys gpc and uses the
engine's group again. Each engine is skipped when its extra is not installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from torchrun_helpers import run_torchrun

pytestmark = [pytest.mark.engines, pytest.mark.timeout(720)]  # a loaded machine: the run, not a hang

# engine: (the package its extra installs, the record key of the engine's own rank)
ENGINES = {"accelerate": ("accelerate", "accelerate_rank"), "lightning": ("lightning", "fabric_rank")}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict[str, Any]]]:
    """``(engine name, every rank's record in rank order)``, one torchrun per engine."""
    name = request.param
    package, _ = ENGINES[name]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the {name} extra is not installed (make test-engines installs it)")
    out = tmp_path_factory.mktemp(name)
    proc = run_torchrun(4, [f"tests/engine_{name}_train.py", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return name, [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(4)]


def test_tensor_2_data_2_trains_equal_to_serial(engine: tuple[str, list[dict[str, Any]]]) -> None:
    for rank, rec in enumerate(engine[1]):
        assert rec["tensor"] == [rank % 2, 2] and rec["data"] == [rank // 2, 2]
        assert rec["worst"] <= 1e-6


def test_gpc_adopts_the_engines_group_and_leaves_it(engine: tuple[str, list[dict[str, Any]]]) -> None:
    name, records = engine
    for rank, rec in enumerate(records):
        assert rec["adopted"] and rec[ENGINES[name][1]] == rank
        assert rec["after_destroy"] == {"initialized": True, "world_sum": 4.0}
