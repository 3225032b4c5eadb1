"""Run under torchrun (4 ranks): Hugging Face Accelerate creates the default group
(``Accelerator(cpu=True)``), gpc adopts it with tensor=2 (so data=2), which guards Accelerate's
own calls (parallelctx.engines.guard). Each rank writes what it saw.

1. Adoption: the tests' TPMLP trains with Accelerate's optimizer wrapper and
   ``accelerator.backward``, the model in DDP over gpc's data group by hand, equal to serial.
2. The user's own tensor-parallel model (tests/engine_user_model.py: column- + row-parallel
   MLP, replicated bias b2, dropout under ``gpc.seed(TENSOR)``): ``accelerator.prepare(model)``
   and ``accelerator.prepare(loader)`` refused; ``STEPS`` SGD-momentum steps through Accelerate's
   optimizer wrapper and ``accelerator.backward``, each clipped by
   ``accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)`` (every step clips), compared
   with the serial clipped run; b2 all-gathered over the tensor group.
3. Resume: after ``SAVED_AT`` steps ``parallelctx.engines.save`` (and gpc's RNG state, for the
   dropout); a fresh model and optimizer ``parallelctx.engines.load`` it and train the last
   steps: parameters and momentum against the continued run.
4. ``accelerator.save_state`` / ``load_state`` / ``save_model`` refused. The control: the same
   run clipped by Accelerate's own ``clip_grad_norm_`` (the original the guard replaced).
5. After ``gpc.destroy()`` Accelerate's methods are its own again and its group still works.

Usage: torchrun --standalone --nproc-per-node 4 tests/engine_accelerate_train.py OUT_DIR
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
from accelerate import Accelerator
from engine_models import TPMLP, batches, check_equals_serial, my_share
from engine_user_model import (
    LR,
    MAX_NORM,
    MOMENTUM,
    SAVED_AT,
    Trace,
    UserTPMLP,
    b2_equal_across_tensor,
    compare_with_serial,
    loader,
    refused,
    serial_run,
    train,
    worst_between,
    worst_vs_serial,
)
from torch.nn.parallel import DistributedDataParallel

import parallelctx
import parallelctx.engines
from parallelctx import ParallelMode, gpc

GUARDED = (
    "prepare_model",
    "prepare_data_loader",
    "clip_grad_norm_",
    "save_state",
    "load_state",
    "save_model",
)


def adoption(accelerator: Accelerator, record: dict[str, Any]) -> None:
    """The tests' TPMLP, DDP over gpc's data group by hand, unclipped: equal to serial."""
    model = DistributedDataParallel(TPMLP(), process_group=gpc.get_group(ParallelMode.DATA))
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in batches(gpc.data.size):
        x, y = my_share(batch, gpc.data.rank)
        opt.zero_grad()
        accelerator.backward(F.mse_loss(model(x), y))
        opt.step()
    record["worst"] = check_equals_serial({n: p.detach() for n, p in model.module.named_parameters()})


def build(accelerator: Accelerator, seed: int) -> tuple[torch.nn.Module, Any]:
    """The recipe: DDP over gpc's data × context group by hand, the optimizer through Accelerate."""
    model = DistributedDataParallel(UserTPMLP(seed), process_group=gpc.get_group(ParallelMode.DATA_CONTEXT))
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    return model, opt


def user_model(accelerator: Accelerator, out: Path, record: dict[str, Any]) -> None:
    """Points 2-4 of the module docstring."""
    rows = loader()
    record["prepare_model"] = refused(lambda: accelerator.prepare(UserTPMLP()))
    record["prepare_loader"] = refused(lambda: accelerator.prepare(rows))
    steps = list(rows)
    model, opt = build(accelerator, seed=0)

    def clip() -> torch.Tensor:
        return accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)

    trace = Trace()
    train(model, opt, steps[:SAVED_AT], accelerator.backward, clip, trace)
    parallelctx.engines.save(out / "ckpt", model, opt)
    torch.save(gpc.get_rng_state(), out / f"rng-{gpc.get_global_rank()}.pt")
    train(model, opt, steps[SAVED_AT:], accelerator.backward, clip, trace)

    record.update(compare_with_serial(model, trace))

    fresh, fresh_opt = build(accelerator, seed=7)  # other weights until loaded
    parallelctx.engines.load(out / "ckpt", fresh, fresh_opt)
    gpc.set_rng_state(torch.load(out / f"rng-{gpc.get_global_rank()}.pt", weights_only=False))

    def fresh_clip() -> torch.Tensor:
        return accelerator.clip_grad_norm_(fresh.parameters(), MAX_NORM)

    train(fresh, fresh_opt, steps[SAVED_AT:], accelerator.backward, fresh_clip, Trace())
    record["resumed_vs_continued"] = worst_between(fresh, fresh_opt, model, opt)

    # the control: the same run clipped by Accelerate's own clip, which the guard replaced
    own_clip = vars(Accelerator)["clip_grad_norm_"].__wrapped__
    control, control_opt = build(accelerator, seed=0)
    control_trace = Trace()
    train(
        control,
        control_opt,
        steps,
        accelerator.backward,
        lambda: own_clip(accelerator, control.parameters(), MAX_NORM),
        control_trace,
    )
    control_serial, _ = serial_run(control_trace)
    record["unguarded_clip"] = {
        "worst_vs_serial": worst_vs_serial(control, control_serial),
        "b2_equal_across_tensor": b2_equal_across_tensor(control),
    }

    path = str(out / "accelerate-state")
    record["own_save"] = {
        "save_state": refused(lambda: accelerator.save_state(path)),
        "load_state": refused(lambda: accelerator.load_state(path)),
        "save_model": refused(lambda: accelerator.save_model(model, path)),
    }


def main() -> None:
    out = Path(sys.argv[1])
    started = time.monotonic()
    accelerator = Accelerator(cpu=True)
    assert dist.is_initialized() and accelerator.num_processes == 4
    accelerates_group = dist.group.WORLD
    originals = {n: vars(Accelerator)[n] for n in GUARDED}
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=2), dist=dict(timeout=300)))
    record: dict[str, Any] = {
        "rank": gpc.get_global_rank(),
        "accelerate_rank": accelerator.process_index,
        "tensor": [gpc.tensor.rank, gpc.tensor.size],
        "data": [gpc.data.rank, gpc.data.size],
        "adopted": gpc.get_group(ParallelMode.GLOBAL) is accelerates_group,
        "data_context_ranks": gpc.get_ranks_in_group(ParallelMode.DATA_CONTEXT),
        "guarded": sorted(n for n in GUARDED if vars(Accelerator)[n] is not originals[n]),
    }
    adoption(accelerator, record)
    user_model(accelerator, out, record)
    gc.collect()  # the DDP wrappers go before their groups
    gpc.destroy()
    record["restored"] = sorted(n for n in GUARDED if vars(Accelerator)[n] is originals[n])
    t = torch.ones(1)
    dist.all_reduce(t)  # Accelerate's group is still there: gpc did not make it, so it keeps it
    record["after_destroy"] = {"initialized": dist.is_initialized(), "world_sum": t.item()}
    accelerator.wait_for_everyone()
    record["seconds"] = time.monotonic() - started
    Path(out, f"rank-{record['rank']}.json").write_text(json.dumps(record))
    accelerator.end_training()  # Accelerate tears its own group down
    assert not dist.is_initialized()


if __name__ == "__main__":
    main()
