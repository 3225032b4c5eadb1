"""Run under torchrun (4 ranks): the engine's own everyday calls under gpc's tensor 2 × data 2,
with the user-style tensor-parallel MLP of tests/user_tp_model.py. Each rank writes a record.

Usage: torchrun --standalone --nproc-per-node 4 tests/engine_guarded_train.py ENGINE OUT_DIR
(ENGINE: accelerate or fabric).

1. The engine makes the default group; gpc adopts it (``launch_from_torch``), which guards the
   engine's calls (parallelctx.engines.guard).
2. The wrappers: Accelerate's ``prepare(model)`` and ``prepare(loader)`` and Fabric's
   ``setup_dataloaders(loader)`` are refused (the refusal's text is recorded); Fabric's
   ``setup(model, optimizer)`` (DDP strategy) is made right: its DDP's group is recorded.
3. Clipped training: ``STEPS`` SGD steps with momentum, each clipped through the engine's own
   call (``accelerator.clip_grad_norm_``, ``fabric.clip_gradients(max_norm=...)``), each
   compared with the serial clipped run; the replicated bias b2 gathered over the tensor group.
4. Resume: the state after 2 of those steps was saved with ``parallelctx.engines.save``; a fresh
   model and optimizer (through the engine again) load it and train the last 2 steps: the
   difference from the continued run.
5. The engine's own save / load are refused (text recorded).
6. After ``gpc.destroy()`` the engine's methods are its own again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from user_tp_model import LR, MAX_NORM, MLP, batches, my_rows, serial, shard_of

import parallelctx
import parallelctx.engines
from parallelctx import ParallelMode, gpc
from parallelctx.engines import EngineMisuseError

MOMENTUM = 0.9


def refused(call: Any) -> str:
    """The EngineMisuseError text ``call()`` raised ('' when it did not raise)."""
    try:
        call()
    except EngineMisuseError as exc:
        return str(exc)
    return ""


class Accelerate:
    def __init__(self) -> None:
        from accelerate import Accelerator

        self.cls = Accelerator
        self.engine = Accelerator(cpu=True)
        self.names = ("prepare_model", "prepare_data_loader", "clip_grad_norm_", "save_state", "load_state")

    def wrappers(self, record: dict[str, Any]) -> None:
        loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
        record["prepare_model"] = refused(lambda: self.engine.prepare(MLP(gpc.tensor.rank, 2)))
        record["prepare_loader"] = refused(lambda: self.engine.prepare(loader))

    def build(self) -> tuple[nn.Module, Any]:
        model = DistributedDataParallel(
            MLP(gpc.tensor.rank, 2), process_group=gpc.get_group(ParallelMode.DATA_CONTEXT)
        )
        opt = self.engine.prepare(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
        return model, opt

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def clip(self, model: nn.Module, opt: Any) -> float:
        return float(self.engine.clip_grad_norm_(model.parameters(), MAX_NORM))

    def own_save(self, path: Path) -> dict[str, str]:
        return {
            "save_state": refused(lambda: self.engine.save_state(str(path))),
            "load_state": refused(lambda: self.engine.load_state(str(path))),
        }

    def end(self) -> None:
        self.engine.end_training()


class Fabric:
    def __init__(self) -> None:
        from lightning.fabric import Fabric as F

        self.cls = F
        self.engine = F(accelerator="cpu", devices=4, strategy="ddp")
        self.engine.launch()
        self.names = ("setup", "setup_module", "setup_dataloaders", "clip_gradients", "save", "load")

    def wrappers(self, record: dict[str, Any]) -> None:
        loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
        record["setup_loader"] = refused(lambda: self.engine.setup_dataloaders(loader))
        plain = self.engine.setup_dataloaders(loader, use_distributed_sampler=False)
        record["setup_loader_without_sampler_rows"] = [int(b.sum()) for b in plain]

    def build(self) -> tuple[nn.Module, Any]:
        module = MLP(gpc.tensor.rank, 2)
        model, opt = self.engine.setup(module, torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM))
        self.ddp_ranks = dist.get_process_group_ranks(model._forward_module.process_group)
        return model, opt

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def clip(self, model: nn.Module, opt: Any) -> float:
        return float(self.engine.clip_gradients(model, opt, max_norm=MAX_NORM))

    def own_save(self, path: Path) -> dict[str, str]:
        return {
            "save": refused(lambda: self.engine.save(path, {"x": torch.zeros(1)})),
            "load": refused(lambda: self.engine.load(path)),
        }

    def end(self) -> None:
        pass


def train(
    engine: Any, model: nn.Module, opt: Any, steps: list[Any], norms: list[float], shard_norms: list[float]
) -> None:
    for x, y in steps:
        x, y = my_rows(x, y)
        opt.zero_grad()
        engine.backward(nn.functional.mse_loss(model(x), y))
        # what the engine's own clip would measure: this rank's shard alone
        shard_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        norms.append(engine.clip(model, opt))
        opt.step()


def plain(model: nn.Module) -> MLP:
    """The user's module inside the engine's and DDP's wrappers."""
    while not isinstance(model, MLP):
        model = getattr(model, "module", None) or model._forward_module  # type: ignore[assignment]
    return model


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    engine = {"accelerate": Accelerate, "fabric": Fabric}[name]()
    originals = {n: vars(engine.cls)[n] for n in engine.names}
    parallelctx.launch_from_torch(dict(parallel=dict(tensor=2), dist=dict(timeout=300)))
    record: dict[str, Any] = {"rank": gpc.get_global_rank(), "tensor": gpc.tensor.rank, "data": gpc.data.rank}
    record["guarded"] = sorted(n for n in engine.names if vars(engine.cls)[n] is not originals[n])
    engine.wrappers(record)

    data = batches(gpc.data.size)
    model, opt = engine.build()
    record["ddp_ranks"] = dist.get_process_group_ranks(gpc.get_group(ParallelMode.DATA_CONTEXT))
    if name == "fabric":
        record["fabric_ddp_ranks"] = engine.ddp_ranks
    norms: list[float] = []
    shard_norms: list[float] = []
    train(engine, model, opt, data[:2], norms, shard_norms)
    parallelctx.engines.save(out / "ckpt", model, opt)
    train(engine, model, opt, data[2:], norms, shard_norms)

    serial_model, serial_norms = serial(gpc.data.size, momentum=MOMENTUM)
    mine, want = plain(model), shard_of(serial_model)
    record["norms"], record["serial_norms"], record["shard_norms"] = norms, serial_norms, shard_norms
    record["worst_vs_serial"] = max(
        float((p.detach() - want[n]).abs().max()) for n, p in mine.named_parameters()
    )
    both = [torch.empty_like(mine.b2) for _ in range(2)]
    dist.all_gather(both, mine.b2.detach(), group=gpc.get_group(ParallelMode.TENSOR))
    record["b2_equal_across_tensor"] = torch.equal(both[0], both[1])

    fresh_model, fresh_opt = engine.build()
    with torch.no_grad():
        for p in plain(fresh_model).parameters():
            p.add_(1.0)  # not the checkpoint's values until loaded
    parallelctx.engines.load(out / "ckpt", fresh_model, fresh_opt)
    train(engine, fresh_model, fresh_opt, data[2:], [], [])
    record["worst_resumed_vs_continued"] = max(
        float((p - q).abs().max())
        for p, q in zip(plain(fresh_model).parameters(), mine.parameters(), strict=True)
    )
    record["own_save"] = engine.own_save(out / f"engine-state-{name}")
    gpc.destroy()
    record["restored"] = all(vars(engine.cls)[n] is originals[n] for n in engine.names)
    t = torch.ones(1)
    dist.all_reduce(t)
    record["world_sum_after_destroy"] = t.item()
    Path(out, f"rank-{record['rank']}.json").write_text(json.dumps(record))
    engine.end()


if __name__ == "__main__":
    main()
