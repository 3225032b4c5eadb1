"""A Ray Train job on a real local Ray cluster: 4 CPU workers, gpc launched inside the training
function with tensor=2 (so data=2) on the process group Ray made: the tests' TPMLP trained with
DDP over gpc's data group by hand, then the user's own tensor-parallel model
(tests/engine_user_model.py) through Ray's ``prepare_model`` and ``prepare_data_loader``
(guarded: parallelctx.engines.guard), clipped, against the serial clipped run; every worker
writes what it saw, the driver what Ray left.

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


def ray_names() -> dict[str, bool]:
    """Which of the names Ray's ``prepare_model`` / ``prepare_data_loader`` build with are the
    guard's now (replaced names carry ``__wrapped__``), per Ray module that holds them."""
    seen = {}
    for module_name in ("ray.train.torch.train_loop_utils", "ray.train.v2.torch.train_loop_utils"):
        module = sys.modules.get(module_name)
        for name in ("DistributedDataParallel", "DistributedSampler", "prepare_model"):
            if module is not None and hasattr(module, name):
                seen[f"{module_name}.{name}"] = hasattr(getattr(module, name), "__wrapped__")
    return seen


def train_func(config: dict[str, Any]) -> None:
    """Ray's training function: the code a user writes, gpc launched on Ray's group."""
    imported_at_start = {
        m: m in sys.modules for m in ("ray.train.torch", "ray.train.v2.torch.train_loop_utils")
    }
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from engine_models import TPMLP, batches, check_equals_serial, my_share
    from engine_user_model import (
        LR,
        MAX_NORM,
        MOMENTUM,
        ROWS,
        Trace,
        UserTPMLP,
        b2_equal_across_tensor,
        dataset,
        loader,
        refused,
        serial_run,
        train,
        worst_vs_serial,
    )
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
    record: dict[str, Any] = {
        "rank": gpc.get_global_rank(),
        "tensor": [gpc.tensor.rank, gpc.tensor.size],
        "data": [gpc.data.rank, gpc.data.size],
        "worst": worst,
        "adopted": adopted,
        "env": env,
        "gpc_local": [gpc.local_rank, gpc.num_processes_on_current_node, gpc.num_nodes],
        "imported_at_start": imported_at_start,
        "guarded_names": ray_names(),
        "data_context_ranks": gpc.get_ranks_in_group(ParallelMode.DATA_CONTEXT),
    }
    # Ray's own wrappers with the user's tensor-parallel model (tests/engine_user_model.py):
    # prepare_model gets gpc's data group and trains equal to the serial clipped run (Ray has no
    # clip of its own: parallelctx.clip_grad_norm_); prepare_data_loader's sampler over every
    # worker is refused, the recipe's own sampler over gpc's data group kept
    plain = torch.utils.data.DataLoader(dataset(), batch_size=ROWS)
    record["prepare_data_loader"] = refused(lambda: ray.train.torch.prepare_data_loader(plain))
    kept = ray.train.torch.prepare_data_loader(loader())
    record["sampler_kept"] = {"num_replicas": kept.sampler.num_replicas, "rank": kept.sampler.rank}
    ray_model = ray.train.torch.prepare_model(UserTPMLP())
    record["prepare_model_ddp_ranks"] = dist.get_process_group_ranks(ray_model.process_group)
    params = list(ray_model.parameters())
    ray_opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    trace = Trace()
    train(
        ray_model,
        ray_opt,
        list(kept),
        lambda loss: loss.backward(),
        lambda: parallelctx.clip_grad_norm_(params, MAX_NORM),
        trace,
    )
    serial, serial_norms = serial_run(trace)
    record["norms"], record["serial_norms"] = trace.norms, serial_norms
    record["prepare_model_worst"] = worst_vs_serial(ray_model, serial)
    record["b2_equal_across_tensor"] = b2_equal_across_tensor(ray_model)
    record["world_group"] = refused(
        lambda: ray.train.torch.prepare_model(
            UserTPMLP(), parallel_strategy_kwargs={"process_group": dist.group.WORLD}
        )
    )
    record["fsdp"] = refused(lambda: ray.train.torch.prepare_model(UserTPMLP(), parallel_strategy="fsdp"))
    del model, ray_model
    gpc.destroy()
    record["restored_names"] = ray_names()
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
