"""A tensor-parallel model written as a user writes one, and the run it must equal, for the
engine scripts (tests/engine_accelerate_train.py, engine_lightning_train.py, engine_ray_train.py).

The user ports a plain two-layer MLP (:class:`SerialMLP`: ``fc2(dropout(gelu(fc1(x))))``) to
gpc's tensor group the Megatron way (:class:`UserTPMLP`): ``fc1`` column-parallel (its rows of
the weight and bias), ``fc2`` row-parallel (its columns of the weight; the partial outputs summed
over the tensor group in the forward) with its bias ``b2`` replicated and added after the sum,
the shards marked ``tensor_model_parallel = True`` as Megatron's layers mark theirs, and the
dropout on the sharded hidden activations drawn under ``gpc.seed(ParallelMode.TENSOR)``. Each
data rank reads its rows through a ``DistributedSampler`` over gpc's data group.

The serial run (:func:`serial_run`) trains the whole model on the whole batch of each step (every
data rank's rows) in one process with torch's own ``clip_grad_norm_``, with the dropout masks
the ranks drew (rebuilt from the gpc RNG states taken before each step, gathered over the
world): the parallel run must equal it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from parallelctx import ParallelMode, gpc

IN, HIDDEN, OUT = 8, 16, 4
ROWS = 8  # rows per data rank per step
STEPS, SAVED_AT = 4, 2  # steps of the run; the checkpoint is taken after SAVED_AT of them
LR, MOMENTUM = 0.5, 0.9
MAX_NORM = 0.05  # below every step's norm: every step clips
DROP = 0.25


class _CopyToTensor(torch.autograd.Function):
    """Identity forward, gradients summed over the tensor group backward (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, group=gpc.get_group(ParallelMode.TENSOR))
        return grad


class _ReduceFromTensor(torch.autograd.Function):
    """Partial outputs summed over the tensor group forward, identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=gpc.get_group(ParallelMode.TENSOR))
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _hidden_slice() -> slice:
    step = HIDDEN // gpc.tensor.size
    return slice(gpc.tensor.rank * step, (gpc.tensor.rank + 1) * step)


class SerialMLP(nn.Module):
    """The user's plain model, initialised by torch from ``seed`` (the same on every rank)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():  # torch's own initialisation, drawn from ``seed``
            torch.manual_seed(seed)
            self.fc1, self.fc2 = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``mask``: the dropout's scaled mask (what ``F.dropout`` multiplies by)."""
        return self.fc2(F.gelu(self.fc1(x)) * mask)


class ColumnParallelLinear(nn.Module):
    """This tensor rank's rows of ``full``'s weight and bias (both marked)."""

    def __init__(self, full: nn.Linear) -> None:
        super().__init__()
        rows = _hidden_slice()
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rows].clone())
        self.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.bias.tensor_model_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTensor.apply(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This tensor rank's columns of ``full``'s weight (marked); the bias replicated, added
    after the sum over the tensor group."""

    def __init__(self, full: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[:, _hidden_slice()].clone())
        self.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
        self.bias = nn.Parameter(full.bias.detach().clone())  # b2: a replica on every tensor rank

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTensor.apply(F.linear(h, self.weight)) + self.bias


class UserTPMLP(nn.Module):
    """:class:`SerialMLP` split over gpc's tensor group (the module docstring)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        full = SerialMLP(seed)
        self.fc1, self.fc2 = ColumnParallelLinear(full.fc1), RowParallelLinear(full.fc2)
        self.drop = nn.Dropout(DROP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        with gpc.seed(ParallelMode.TENSOR):  # each tensor rank drops its own hidden units
            h = self.drop(h)
        return self.fc2(h)


def unwrap(model: nn.Module) -> UserTPMLP:
    """The user's module inside DDP's and the engines' wrappers."""
    while not isinstance(model, UserTPMLP):
        inner = getattr(model, "module", None)
        model = inner if isinstance(inner, nn.Module) else model._forward_module  # type: ignore[assignment]
    return model


def dataset() -> TensorDataset:
    """``STEPS`` global batches of ``gpc.data.size * ROWS`` rows (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    n = STEPS * gpc.data.size * ROWS
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g))


def loader() -> DataLoader[Any]:
    """The recipe's loader: a ``DistributedSampler`` over gpc's data group (not the world)."""
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=gpc.data.size, rank=gpc.data.rank, shuffle=False)
    return DataLoader(data, batch_size=ROWS, sampler=sampler)


@dataclass
class Trace:
    """What one run of steps saw on this rank."""

    rows: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    rng: list[Any] = field(default_factory=list)  # gpc.get_rng_state() before each step
    norms: list[float] = field(default_factory=list)  # what the clip returned
    shard_norms: list[float] = field(default_factory=list)  # torch's norm of this rank's grads


def train(model: nn.Module, opt: Any, steps: list[Any], backward: Any, clip: Any, trace: Trace) -> None:
    """SGD steps on ``steps`` (this rank's rows), each loss through ``backward(loss)`` and each
    gradient through ``clip()`` (returns the norm), recorded in ``trace``."""
    for x, y in steps:
        trace.rows.append((x, y))
        trace.rng.append(gpc.get_rng_state())
        opt.zero_grad()
        backward(F.mse_loss(model(x), y))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        trace.shard_norms.append(float(torch.nn.utils.get_total_norm(grads)))
        trace.norms.append(float(clip()))
        opt.step()


def _masks(states: list[Any]) -> list[torch.Tensor]:
    """The dropout masks this rank drew at the steps that began in ``states`` (gpc RNG states),
    redrawn from them; gpc's streams are put back after."""
    now, masks = gpc.get_rng_state(), []
    for state in states:
        gpc.set_rng_state(state)
        with gpc.seed(ParallelMode.TENSOR):
            masks.append(F.dropout(torch.ones(ROWS, HIDDEN // gpc.tensor.size), DROP, training=True))
    gpc.set_rng_state(now)
    return masks


def serial_run(trace: Trace) -> tuple[SerialMLP, list[float]]:
    """The serial clipped run of the steps of ``trace`` (every rank calls it: it gathers each
    step's rows and masks over the world): the whole model after those steps, and each step's
    norm before clipping (torch's ``clip_grad_norm_``)."""
    masks = torch.stack(_masks(trace.rng))
    xs = torch.stack([x for x, _ in trace.rows])
    ys = torch.stack([y for _, y in trace.rows])
    mine = torch.cat([xs.flatten(1), ys.flatten(1), masks.flatten(1)], dim=1)
    world = gpc.get_world_size(ParallelMode.GLOBAL)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    coords = torch.tensor([gpc.data.rank, gpc.tensor.rank])
    where = [torch.empty_like(coords) for _ in range(world)]
    dist.all_gather(where, coords)
    at = {(int(c[0]), int(c[1])): t for c, t in zip(where, every, strict=True)}
    steps, width = len(trace.rows), HIDDEN // gpc.tensor.size
    model = SerialMLP()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    norms = []
    for i in range(steps):
        xs_i, ys_i, ms_i = [], [], []
        for d in range(gpc.data.size):
            row = at[(d, 0)][i]
            xs_i.append(row[: ROWS * IN].view(ROWS, IN))
            ys_i.append(row[ROWS * IN : ROWS * (IN + OUT)].view(ROWS, OUT))
            ms_i.append(
                torch.cat(
                    [at[(d, t)][i][ROWS * (IN + OUT) :].view(ROWS, width) for t in range(gpc.tensor.size)], 1
                )
            )
        opt.zero_grad()
        F.mse_loss(model(torch.cat(xs_i), torch.cat(ms_i)), torch.cat(ys_i)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return model, norms


def worst_vs_serial(model: nn.Module, serial: SerialMLP) -> float:
    """The largest difference of this rank's shard of ``model`` from the serial model's part."""
    mine, rows = unwrap(model), _hidden_slice()
    want = {
        "fc1.weight": serial.fc1.weight[rows],
        "fc1.bias": serial.fc1.bias[rows],
        "fc2.weight": serial.fc2.weight[:, rows],
        "fc2.bias": serial.fc2.bias,
    }
    return max(float((p.detach() - want[n].detach()).abs().max()) for n, p in mine.named_parameters())


def b2_equal_across_tensor(model: nn.Module) -> bool:
    """Whether the replicated bias b2 (``fc2.bias``) is bit-equal on every rank of this rank's
    tensor group, by an all-gather over it."""
    b2 = unwrap(model).fc2.bias.detach()
    both = [torch.empty_like(b2) for _ in range(gpc.tensor.size)]
    dist.all_gather(both, b2, group=gpc.get_group(ParallelMode.TENSOR))
    return all(torch.equal(both[0], b) for b in both)


def worst_between(a: nn.Module, opt_a: Any, b: nn.Module, opt_b: Any) -> dict[str, float]:
    """The largest differences between two runs on this rank: parameters, and the optimizer's
    momentum buffers (SGD's), matched by parameter name."""
    ma, mb = unwrap(a), unwrap(b)
    pa, pb = dict(ma.named_parameters()), dict(mb.named_parameters())
    state_a, state_b = getattr(opt_a, "state", {}), getattr(opt_b, "state", {})
    params = max(float((pa[n].detach() - pb[n].detach()).abs().max()) for n in pa)
    momenta = max(
        float((state_a[pa[n]]["momentum_buffer"] - state_b[pb[n]]["momentum_buffer"]).abs().max()) for n in pa
    )
    return {"params": params, "momentum": momenta}


def refused(call: Any) -> str:
    """The EngineMisuseError text ``call()`` raised ('' when it returned)."""
    from parallelctx.engines import EngineMisuseError

    try:
        call()
    except EngineMisuseError as exc:
        return str(exc)
    return ""


def compare_with_serial(model: nn.Module, trace: Trace) -> dict[str, Any]:
    """What a clipped run recorded in ``trace`` says against the serial run of the same steps:
    the norms (the engine's, the serial run's, each rank's shard's), the largest difference of
    this rank's weights from the serial run's, and whether b2 is equal across the tensor group."""
    serial, serial_norms = serial_run(trace)
    return {
        "norms": trace.norms,
        "serial_norms": serial_norms,
        "shard_norms": trace.shard_norms,
        "worst_vs_serial": worst_vs_serial(model, serial),
        "b2_equal_across_tensor": b2_equal_across_tensor(model),
    }
