"""A small tensor-parallel model trained on gpc's groups and seeds, run under torchrun by
tests/test_reform.py: ``torchrun ... tests/torchrun_reform.py MODE OUT [KILL | ROUNDS] [--megatron]``.
With ``--megatron`` the Megatron bridge is installed after launch (``gpc.reform()`` reinstalls it)
and the records hold every ``parallel_state`` getter's answer and ``process_groups()``.

The model, written as model code would be: a column-parallel linear (its output features split
over the tensor group), GELU, dropout under ``gpc.seed(ParallelMode.TENSOR)``, a row-parallel
linear whose partial outputs are summed over the tensor group; data-parallel gradients averaged
over the data group; plain SGD. Data rank ``d`` of ``D`` at step ``s`` draws its batch from seed
``1000 * s + d``; the loss logged is the mean over the data group.

* ``MODE=kill``: 8 ranks, tensor 2 x data 4. Steps 0-2, then a checkpoint (each tensor rank's
  shards, from data rank 0), then step 3, in which rank KILL kills itself (SIGKILL) between its
  forward and its backward. Every other rank's step raises (a peer closed the connection); it
  calls ``gpc.abort()`` and ``gpc.reform(exclude=[KILL])``. A rank that stays loads the
  checkpoint and trains steps 3-7 on the smaller layout.
* ``MODE=fresh``: a fresh launch (6 ranks, tensor 2 x data 3): loads the checkpoint, trains steps 3-7.
* ``MODE=cycles``: ``WORLD`` ranks of data parallelism alone (tensor 1); CYCLES times, the highest
  rank left is killed at step 1 of a round of 2 steps, and the others reform and go on. Writes
  each round's losses, thread count and group count after reform.

Writes OUT/<mode>-rank-<R>.json: the new rank, world size, tensor and data groups (by all_gather
of the global ranks), losses, and for reform what ``Reformed`` said.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parallelctx
from parallelctx import ParallelMode, gpc

IN, HIDDEN, BATCH, LR = 8, 16, 4, 0.1


class TPMLP:
    """Column-parallel then row-parallel linear over gpc's tensor group (the full weights are
    made from seed 0, and each tensor rank keeps its slice)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        w1, w2 = torch.randn(IN, HIDDEN, generator=g) / 3, torch.randn(HIDDEN, IN, generator=g) / 4
        t, n = gpc.tensor.rank, gpc.tensor.size
        part = slice(t * HIDDEN // n, (t + 1) * HIDDEN // n)
        self.w1 = w1[:, part].clone().requires_grad_()
        self.w2 = w2[part, :].clone().requires_grad_()

    def params(self) -> list[torch.Tensor]:
        return [self.w1, self.w2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(x @ self.w1)
        with gpc.seed(ParallelMode.TENSOR):
            h = F.dropout(h, p=0.2, training=True)
        return _ReduceTensor.apply(h @ self.w2)


class _ReduceTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor) -> torch.Tensor:
        out = partial.clone()
        dist.all_reduce(out, group=gpc.get_group(ParallelMode.TENSOR))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + gpc.data.rank)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, IN, generator=g)


def step(model: TPMLP, s: int, die: bool = False) -> float:
    x, y = batch(s)
    loss = F.mse_loss(model.forward(x), y)
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    data = gpc.get_group(ParallelMode.DATA)
    with torch.no_grad():
        for p in model.params():
            dist.all_reduce(p.grad, group=data)
            p -= LR * p.grad / gpc.data.size
            p.grad = None
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=data)
    return mean.item() / gpc.data.size


def save(model: TPMLP, out: Path) -> None:
    if gpc.data.rank == 0:
        torch.save([p.detach() for p in model.params()], out / f"ckpt-tp{gpc.tensor.rank}.pt")
    dist.barrier()


def load(model: TPMLP, out: Path) -> None:
    for p, v in zip(model.params(), torch.load(out / f"ckpt-tp{gpc.tensor.rank}.pt"), strict=True):
        with torch.no_grad():
            p.copy_(v)


def members(mode: ParallelMode) -> list[int]:
    """The global ranks of this rank's group of ``mode``, by a real all_gather."""
    got = [torch.zeros(1, dtype=torch.long) for _ in range(gpc.get_world_size(mode))]
    dist.all_gather(got, torch.tensor([gpc.get_global_rank()]), group=gpc.get_group(mode))
    return [int(t) for t in got]


def describe() -> dict[str, Any]:
    return {
        "rank": gpc.get_global_rank(),
        "world_size": gpc.get_world_size(ParallelMode.GLOBAL),
        "tensor": members(ParallelMode.TENSOR),
        "data": members(ParallelMode.DATA),
        "tensor_seed_draw": _draw(ParallelMode.TENSOR),
        "data_seed_draw": _draw(ParallelMode.DATA),
    }


def _draw(mode: ParallelMode) -> float:
    with gpc.seed(mode):
        return torch.rand(1).item()


def megatron_answers() -> dict[str, Any]:
    """Every parallel_state getter's answer and every process_groups() field, by members."""
    import megatron_workers  # tests/: the Megatron bridge suite's own probes

    from parallelctx import megatron

    getters, _ = megatron_workers.discover()
    return {
        "globals": megatron_workers.answer_all(getters),
        "collection": megatron_workers.collection(megatron.process_groups()),
    }


def main() -> int:
    """Run MODE on this rank; returns 0 (the test reads the JSON files)."""
    bridge = "--megatron" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--megatron"]
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    config = {"parallel": {"tensor": 1 if mode == "cycles" else 2}, "dist": {"timeout": 30}, "seed": 7}
    parallelctx.launch_from_torch(config)
    if bridge:
        from parallelctx import megatron

        megatron.install()
    record: dict[str, Any] = {"mode": mode, "old_rank": rank}
    if mode == "fresh":
        model = TPMLP()
        load(model, out)
        record.update(describe(), losses=[step(model, s) for s in range(3, 8)])
        if bridge:
            record["megatron"] = megatron_answers()
    elif mode == "kill":
        kill = int(sys.argv[3])
        model = TPMLP()
        record["before"] = [step(model, s) for s in range(3)]
        save(model, out)
        try:
            step(model, 3, die=rank == kill)
            record["step3"] = "finished"
        except RuntimeError as exc:
            record["step3"] = str(exc).splitlines()[0][:200]
        gpc.abort()
        began = time.monotonic()
        reformed = gpc.reform(exclude=[kill])
        record["reform_s"] = round(time.monotonic() - began, 3)
        record["reformed"] = {
            "rank": reformed.rank,
            "left": list(reformed.left),
            "world_size": reformed.world_size,
        }
        if reformed.stays:
            model = TPMLP()
            load(model, out)
            record.update(describe(), losses=[step(model, s) for s in range(3, 8)])
            if bridge:
                record["megatron"] = megatron_answers()
    else:  # cycles
        rounds = int(sys.argv[3])
        model = TPMLP()
        record["rounds"] = []
        for _ in range(rounds):
            world = gpc.get_world_size(ParallelMode.GLOBAL)
            victim = world - 1
            me = gpc.get_global_rank()
            losses = [step(model, 0)]
            try:
                losses.append(step(model, 1, die=me == victim))
                print(f"rank {me} of {world}: step 1 did not fail", file=sys.stderr, flush=True)
            except RuntimeError as exc:
                print(
                    f"{time.time():.3f} rank {me} of {world}: step 1 failed: {str(exc).splitlines()[0][:240]}",
                    file=sys.stderr,
                    flush=True,
                )
                gpc.abort()
                reformed = gpc.reform(exclude=[victim])
                print(f"{time.time():.3f} rank {me} of {world}: reformed", file=sys.stderr, flush=True)
                model = TPMLP()
                losses.append(step(model, 1))
                record["rounds"].append(
                    {
                        "world_size": reformed.world_size,
                        "rank": reformed.rank,
                        "losses": losses,
                        "threads": sorted(t.name for t in threading.enumerate()),
                        "groups": len(dist.distributed_c10d._world.pg_map),
                        **describe(),
                    }
                )
    record["threads_end"] = sorted(t.name for t in threading.enumerate())
    name = f"{mode}-rank-{rank}.json"
    (out / name).write_text(json.dumps(record))
    gpc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
