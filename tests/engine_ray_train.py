"""A Ray Train job on a real local Ray cluster: 4 CPU workers, gpc launched inside the training
function with tensor=2 (so data=2) on the process group Ray made, the tensor-parallel MLP trained
with DDP over gpc's data group; every worker writes what it saw, the driver what Ray left.

Usage: python tests/engine_ray_train.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def train_func(config: dict[str, Any]) -> None:
    """Ray's training function: the code a user writes, gpc launched on Ray's group."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from engine_models import TPMLP, batches, check_equals_serial, my_share
    from torch.nn.parallel import DistributedDataParallel

    import parallelctx
    from parallelctx import ParallelMode, gpc

    rays_group = dist.group.WORLD
    env = {
        k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")
    }
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=2), dist=dict(timeout=300)))
    adopted = gpc.get_group(ParallelMode.GLOBAL) is rays_group
    model = DistributedDataParallel(TPMLP(), process_group=gpc.get_group(ParallelMode.DATA))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches(gpc.data.size):
        x, y = my_share(batch, gpc.data.rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    worst = check_equals_serial({n: p.detach() for n, p in model.module.named_parameters()})
    record = {
        "rank": gpc.get_global_rank(),
        "tensor": [gpc.tensor.rank, gpc.tensor.size],
        "data": [gpc.data.rank, gpc.data.size],
        "worst": worst,
        "adopted": adopted,
        "env": env,
        "gpc_local": [gpc.local_rank, gpc.num_processes_on_current_node, gpc.num_nodes],
    }
    # Ray's own wrappers: prepare_model gets gpc's data group (the same run, equal to serial);
    # prepare_data_loader's sampler over every worker is refused
    import ray.train.torch

    from parallelctx.engines import EngineMisuseError

    ray_model = ray.train.torch.prepare_model(TPMLP(), move_to_device=False)
    ray_opt = torch.optim.SGD(ray_model.parameters(), lr=0.1)
    for batch in batches(gpc.data.size):
        x, y = my_share(batch, gpc.data.rank)
        ray_opt.zero_grad()
        F.mse_loss(ray_model(x), y).backward()
        ray_opt.step()
    record["prepare_model_ddp_ranks"] = dist.get_process_group_ranks(ray_model.process_group)
    record["prepare_model_worst"] = check_equals_serial(
        {n: p.detach() for n, p in ray_model.module.named_parameters()}
    )
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    try:
        ray.train.torch.prepare_data_loader(loader)
        record["prepare_data_loader"] = ""
    except EngineMisuseError as exc:
        record["prepare_data_loader"] = str(exc)
    # the recipe's own sampler (gpc's data rank) passes and is kept
    from torch.utils.data import DistributedSampler

    mine = DistributedSampler(list(range(8)), num_replicas=gpc.data.size, rank=gpc.data.rank, shuffle=False)
    kept = ray.train.torch.prepare_data_loader(
        torch.utils.data.DataLoader(list(range(8)), batch_size=2, sampler=mine), move_to_device=False
    )
    record["own_sampler_rows"] = [int(v) for b in kept for v in b]
    del model, ray_model
    gpc.destroy()
    # Ray's group is still there and works: gpc made it not, so gpc does not destroy it
    t = torch.ones(1)
    dist.all_reduce(t)
    record["after_destroy"] = {"initialized": dist.is_initialized(), "world_sum": t.item()}
    Path(config["out"], f"rank-{record['rank']}.json").write_text(json.dumps(record))


def main() -> None:
    import psutil
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = Path(sys.argv[1])
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=100 * 1024**2,
        runtime_env={"env_vars": {"PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"}},
    )
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=4, use_gpu=False, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo", timeout_s=300),
        run_config=RunConfig(storage_path=str(out / "ray"), name="gpc"),
    )
    result = trainer.fit()
    ray.shutdown()
    deadline = time.monotonic() + 60
    left = psutil.Process().children(recursive=True)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    driver = {
        "error": None if result.error is None else repr(result.error),
        "ray_initialized_after_shutdown": ray.is_initialized(),
        "children_left": [p.name() for p in left],
    }
    Path(out, "driver.json").write_text(json.dumps(driver))


if __name__ == "__main__":
    main()
