"""Ray Train (make test-engines): gpc inside a ``TorchTrainer`` on a real local Ray cluster.

tests/engine_ray_train.py starts Ray (4 CPUs), runs 4 CPU workers whose training function calls
``launch_from_torch(dict(parallel=dict(tensor=2)))`` on the process group Ray made, trains the
tests' tensor-parallel MLP with DDP over gpc's data group and the user's own (tests/
engine_user_model.py) through Ray's ``prepare_model`` and ``prepare_data_loader`` (guarded by
parallelctx.engines.guard), compares with the serial runs, destroys gpc and uses Ray's group
again; the driver then shuts Ray down and waits for its processes to end.
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


def test_the_guard_is_installed_in_rays_worker_and_put_back(
    run: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    for rec in run[0]:
        # Ray's worker imported ray.train.torch before the training function ran: the launch
        # guards it (an import after the launch would be guarded by the import watch too)
        assert rec["imported_at_start"]["ray.train.torch"]
        assert rec["guarded_names"] and all(rec["guarded_names"].values()), rec["guarded_names"]
        assert "ray.train.v2.torch.train_loop_utils.DistributedDataParallel" in rec["guarded_names"]
        assert rec["restored_names"].keys() == rec["guarded_names"].keys()
        assert not any(rec["restored_names"].values()), rec["restored_names"]


def test_rays_prepare_model_gets_gpcs_data_group_and_trains_equal_to_serial(
    run: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    # ray.train.torch.prepare_model would wrap DDP over all 4 workers (tensor rank 1 would get
    # rank 0's shard); parallelctx gives it gpc's data group: the user's model (dropout under
    # gpc.seed(TENSOR), replicated b2), clipped by parallelctx.clip_grad_norm_, equals the serial
    # clipped run
    for rank, rec in enumerate(run[0]):
        assert rec["prepare_model_ddp_ranks"] == rec["data_context_ranks"] == [rank % 2, rank % 2 + 2]
        assert min(rec["serial_norms"]) > 0.1, "every step clips (max_norm 0.05)"
        assert rec["norms"] == pytest.approx(rec["serial_norms"], rel=1e-5)
        assert rec["prepare_model_worst"] <= 1e-6
        assert rec["b2_equal_across_tensor"]
        # a process group over every worker, given by hand, and FSDP: refused
        assert "has ranks [0, 1, 2, 3]" in rec["world_group"]
        assert "gpc.get_group(ParallelMode.DATA_CONTEXT)" in rec["world_group"]
        assert rec["fsdp"].startswith(
            "ray.train.torch.prepare_model(parallel_strategy='fsdp') under gpc's tensor=2"
        )


def test_rays_loader_sampler_is_refused_and_the_users_own_kept(
    run: tuple[list[dict[str, Any]], dict[str, Any]],
) -> None:
    for rec in run[0]:
        assert rec["prepare_data_loader"].startswith(
            "ray.train.torch.prepare_data_loader() under gpc's tensor=2:"
        )
        assert "add_dist_sampler=False" in rec["prepare_data_loader"]
        # the recipe's DistributedSampler over gpc's data group: kept (and trained the run above)
        assert rec["sampler_kept"] == {"num_replicas": 2, "rank": rec["data"][0]}
