"""Ray Train (make test-engines): gpc inside a ``TorchTrainer`` on a real local Ray cluster.

tests/engine_ray_train.py starts Ray (4 CPUs), runs 4 CPU workers whose training function calls
``launch_from_torch(dict(parallel=dict(tensor=2)))`` on the process group Ray made, trains the
tensor-parallel MLP with DDP over gpc's data group, compares with the serial run, destroys gpc and
uses Ray's group again; the driver then shuts Ray down and waits for its processes to end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.engines, pytest.mark.timeout(720)]  # a loaded machine: the run, not a hang
pytest.importorskip("ray.train", reason="the ray extra is not installed (make test-engines installs it)")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(every worker's record in rank order, the driver's record)."""
    out = tmp_path_factory.mktemp("ray")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "tests/engine_ray_train.py", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
        pytest.fail("the Ray job ran past 600 s:\n" + output[-6000:])
    assert proc.returncode == 0, output[-6000:]
    workers = [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(4)]
    return workers, json.loads(Path(out, "driver.json").read_text())


def test_tensor_2_data_2_trains_equal_to_serial(run: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    workers, driver = run
    assert driver["error"] is None
    for rank, rec in enumerate(workers):
        assert rec["tensor"] == [rank % 2, 2] and rec["data"] == [rank // 2, 2]
        assert rec["worst"] <= 1e-6


def test_gpc_adopts_rays_group_and_env(run: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    for rank, rec in enumerate(run[0]):
        assert rec["adopted"], "gpc's GLOBAL group is the default group Ray made"
        assert rec["env"]["RANK"] == str(rank) and rec["env"]["WORLD_SIZE"] == "4"
        assert rec["env"]["LOCAL_WORLD_SIZE"] == "4" and rec["env"]["NODE_RANK"] == "0"
        assert rec["env"]["LOCAL_RANK"] == str(rank)
        assert rec["gpc_local"] == [rank, 4, 1]  # gpc's local rank is Ray's; one node of 4


def test_destroy_leaves_rays_group_and_shutdown_is_clean(
    run: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    workers, driver = run
    for rec in workers:
        assert rec["after_destroy"] == {"initialized": True, "world_sum": 4.0}
    assert driver["ray_initialized_after_shutdown"] is False
    assert driver["children_left"] == []


def test_rays_prepare_model_gets_gpcs_data_group_and_its_loader_sampler_is_refused(
    run: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    # ray.train.torch.prepare_model would wrap DDP over all 4 workers (tensor rank 1 would get
    # rank 0's shard); parallelctx gives it gpc's data group, and the run equals serial
    for rank, rec in enumerate(run[0]):
        assert rec["prepare_model_ddp_ranks"] == [rank % 2, rank % 2 + 2]
        assert rec["prepare_model_worst"] <= 1e-6
        assert "prepare_data_loader() under gpc's tensor=2" in rec["prepare_data_loader"]
        assert "add_dist_sampler=False" in rec["prepare_data_loader"]
        # a DistributedSampler of the user's own, over gpc's data group, is kept: rows of data rank d
        assert rec["own_sampler_rows"] == list(range(8))[rec["data"][0] :: 2]
