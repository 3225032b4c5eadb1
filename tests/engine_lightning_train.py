"""Run under torchrun (4 ranks): Lightning Fabric creates the default group (``fabric.launch()``
with the DDP strategy on CPU), gpc adopts it with tensor=2 (so data=2), which guards Fabric's
own calls (parallelctx.engines.guard). Each rank writes what it saw.

1. Adoption: the tests' TPMLP trains with Fabric's optimizer wrapper and ``fabric.backward``,
   the model in DDP over gpc's data group by hand, equal to serial.
2. An engine imported after the launch is guarded as its import ends: ``accelerate``, imported
   here only now, refuses ``Accelerator.prepare_model``.
3. The user's own tensor-parallel model (tests/engine_user_model.py: column- + row-parallel
   MLP, replicated bias b2, dropout under ``gpc.seed(TENSOR)``): ``fabric.setup_dataloaders``
   of a loader without a sampler refused, passed with ``use_distributed_sampler=False``, and a
   loader with the recipe's ``DistributedSampler`` kept; ``fabric.setup(model, optimizer)``
   made right (DDP over gpc's data × context group), a ``DDPStrategy(process_group=...)`` over
   the world and the FSDP strategy refused; ``STEPS`` SGD-momentum steps through
   ``fabric.backward``, each clipped by ``fabric.clip_gradients(model, optimizer,
   max_norm=MAX_NORM)`` (every step clips), against the serial clipped run; b2 all-gathered
   over the tensor group.
4. Resume: after ``SAVED_AT`` steps ``parallelctx.engines.save`` (and gpc's RNG state, for the
   dropout); a fresh ``fabric.setup`` model and optimizer ``parallelctx.engines.load`` it and
   train the last steps: parameters and momentum against the continued run.
5. ``fabric.save`` / ``fabric.load`` refused. The control: the same run clipped by Fabric's
   own ``clip_gradients`` (the original the guard replaced).
6. After ``gpc.destroy()`` Fabric's (and Accelerate's) methods are their own again and Fabric's
   group still works.

Usage: torchrun --standalone --nproc-per-node 4 tests/engine_lightning_train.py OUT_DIR
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_models import TPMLP, batches, check_equals_serial, my_share
from engine_user_model import (
    LR,
    MAX_NORM,
    MOMENTUM,
    ROWS,
    SAVED_AT,
    Trace,
    UserTPMLP,
    b2_equal_across_tensor,
    compare_with_serial,
    dataset,
    loader,
    refused,
    serial_run,
    train,
    worst_between,
    worst_vs_serial,
)
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import parallelctx
import parallelctx.engines
from parallelctx import ParallelMode, gpc

GUARDED = ("setup", "setup_module", "setup_dataloaders", "clip_gradients", "save", "load")


def adoption(fabric: Fabric, record: dict[str, Any]) -> None:
    """The tests' TPMLP, DDP over gpc's data group by hand, unclipped: equal to serial."""
    model = DistributedDataParallel(TPMLP(), process_group=gpc.get_group(ParallelMode.DATA))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in batches(gpc.data.size):
        x, y = my_share(batch, gpc.data.rank)
        opt.zero_grad()
        fabric.backward(F.mse_loss(model(x), y))
        opt.step()
    record["worst"] = check_equals_serial({n: p.detach() for n, p in model.module.named_parameters()})


def imported_late(record: dict[str, Any]) -> None:
    """Accelerate imported after gpc launched: guarded by the import watch."""
    record["accelerate_imported_before"] = "accelerate" in sys.modules
    from accelerate import Accelerator

    record["late_prepare_model"] = refused(lambda: Accelerator.prepare_model(None, UserTPMLP()))
    record["late_originals"] = vars(Accelerator)["prepare_model"].__wrapped__


def other_fabrics(record: dict[str, Any]) -> None:
    """A DDP strategy given a process group over the world, and DeepSpeed's strategy (a
    subclass of Fabric's DDPStrategy that builds no DDP; it and FSDP's are CUDA-only): refused."""
    world = Fabric(accelerator="cpu", devices=4, strategy=DDPStrategy(process_group=dist.group.WORLD))
    world.launch()
    record["setup_world_group"] = refused(lambda: world.setup(UserTPMLP()))
    from lightning.fabric.strategies import DeepSpeedStrategy

    # Fabric builds DeepSpeed's strategy on CUDA only: an unbuilt one stands in (the guard
    # refuses from its type before Fabric touches it)
    world._strategy = object.__new__(DeepSpeedStrategy)
    record["setup_deepspeed"] = refused(lambda: world.setup_module(UserTPMLP()))


def user_model(fabric: Fabric, out: Path, record: dict[str, Any]) -> None:
    """Points 3-5 of the module docstring."""
    plain = DataLoader(dataset(), batch_size=ROWS)
    record["setup_loader"] = refused(lambda: fabric.setup_dataloaders(plain))
    unsharded = fabric.setup_dataloaders(plain, use_distributed_sampler=False)
    record["unsharded_batches"] = len(unsharded)
    rows = fabric.setup_dataloaders(loader())  # the recipe's own DistributedSampler: kept
    record["sampler_kept"] = {
        "num_replicas": rows.sampler.num_replicas,  # type: ignore[attr-defined]
        "rank": rows.sampler.rank,  # type: ignore[attr-defined]
        "batches": len(rows),
    }
    steps = list(rows)

    def build(seed: int) -> tuple[Any, Any]:
        module = UserTPMLP(seed)
        return fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM))

    model, opt = build(0)
    record["fabric_ddp_ranks"] = dist.get_process_group_ranks(model._forward_module.process_group)

    trace = Trace()
    train(
        model,
        opt,
        steps[:SAVED_AT],
        fabric.backward,
        lambda: fabric.clip_gradients(model, opt, max_norm=MAX_NORM),
        trace,
    )
    parallelctx.engines.save(out / "ckpt", model, opt)
    torch.save(gpc.get_rng_state(), out / f"rng-{gpc.get_global_rank()}.pt")
    train(
        model,
        opt,
        steps[SAVED_AT:],
        fabric.backward,
        lambda: fabric.clip_gradients(model, opt, max_norm=MAX_NORM),
        trace,
    )

    record.update(compare_with_serial(model, trace))

    fresh, fresh_opt = build(7)  # other weights until loaded
    parallelctx.engines.load(out / "ckpt", fresh, fresh_opt)
    gpc.set_rng_state(torch.load(out / f"rng-{gpc.get_global_rank()}.pt", weights_only=False))
    train(
        fresh,
        fresh_opt,
        steps[SAVED_AT:],
        fabric.backward,
        lambda: fabric.clip_gradients(fresh, fresh_opt, max_norm=MAX_NORM),
        Trace(),
    )
    record["resumed_vs_continued"] = worst_between(fresh, fresh_opt, model, opt)

    # the control: the same run clipped by Fabric's own clip, which the guard replaced
    own_clip = vars(Fabric)["clip_gradients"].__wrapped__
    control, control_opt = build(0)
    control_trace = Trace()
    train(
        control,
        control_opt,
        steps,
        fabric.backward,
        lambda: own_clip(fabric, control, control_opt, max_norm=MAX_NORM),
        control_trace,
    )
    control_serial, _ = serial_run(control_trace)
    record["unguarded_clip"] = {
        "worst_vs_serial": worst_vs_serial(control, control_serial),
        "b2_equal_across_tensor": b2_equal_across_tensor(control),
    }

    path = out / "fabric-state.ckpt"
    record["own_save"] = {
        "save": refused(lambda: fabric.save(path, {"model": model, "optimizer": opt})),
        "load": refused(lambda: fabric.load(path, {"model": model, "optimizer": opt})),
    }
    other_fabrics(record)


def main() -> None:
    out = Path(sys.argv[1])
    started = time.monotonic()
    fabric = Fabric(accelerator="cpu", devices=4, strategy="ddp")
    fabric.launch()
    assert dist.is_initialized() and fabric.world_size == 4
    fabrics_group = dist.group.WORLD
    originals = {n: vars(Fabric)[n] for n in GUARDED}
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=2), dist=dict(timeout=300)))
    record: dict[str, Any] = {
        "rank": gpc.get_global_rank(),
        "fabric_rank": fabric.global_rank,
        "tensor": [gpc.tensor.rank, gpc.tensor.size],
        "data": [gpc.data.rank, gpc.data.size],
        "adopted": gpc.get_group(ParallelMode.GLOBAL) is fabrics_group,
        "data_context_ranks": gpc.get_ranks_in_group(ParallelMode.DATA_CONTEXT),
        "guarded": sorted(n for n in GUARDED if vars(Fabric)[n] is not originals[n]),
    }
    adoption(fabric, record)
    imported_late(record)
    user_model(fabric, out, record)
    gc.collect()  # the DDP wrappers go before their groups
    gpc.destroy()
    record["restored"] = sorted(n for n in GUARDED if vars(Fabric)[n] is originals[n])
    from accelerate import Accelerator

    record["late_restored"] = vars(Accelerator)["prepare_model"] is record.pop("late_originals")
    t = torch.ones(1)
    dist.all_reduce(t)  # Fabric's group is still there: gpc did not make it, so it keeps it
    record["after_destroy"] = {"initialized": dist.is_initialized(), "world_sum": t.item()}
    fabric.barrier()
    record["seconds"] = time.monotonic() - started
    Path(out, f"rank-{record['rank']}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
