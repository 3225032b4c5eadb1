"""Gradient clipping by the norm of the whole model, when gpc shards it.

``torch.nn.utils.clip_grad_norm_`` (and every engine's clip built on it: Accelerate's
``clip_grad_norm_``, Fabric's ``clip_gradients``) measures the gradients this process holds.
Under tensor or pipeline parallelism those are a shard of the model, so each rank clips by
another norm: replicated parameters (biases, norms) drift apart across the tensor group, and
the model is not the one a serial run trains. :func:`clip_grad_norm_` measures the whole
model, the way Megatron does:

* a parameter marked ``tensor_model_parallel = True`` (Megatron's mark; its
  ``ColumnParallelLinear`` and ``RowParallelLinear`` set it) is a shard: counted on every rank;
* any other parameter is a replica over the tensor group: counted on tensor rank 0 only;
* the squares (the maxima for ``inf``) are summed over gpc's MODEL group (tensor × pipeline:
  each pipeline stage holds other layers); a parameter marked ``allreduce = False`` (Megatron's
  mark of an expert's) over the EXPERT_MODEL group instead (expert-tensor × expert × pipeline),
  replicas counted on expert-tensor rank 0;
* a parameter marked ``shared = True`` (Megatron's mark of the last pipeline stage's copy of a
  tied embedding) is left out: the first stage counts it.

The data and context groups are left out: their ranks hold the same gradients once DDP (or
FSDP, or DeepSpeed) averaged them. The result is the same tensor on every rank, so every rank
scales by the same factor and replicas stay equal. The local norms and the scaling are torch's
(``torch.nn.utils.get_total_norm``, ``clip_grads_with_norm_``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from .context import gpc
from .planning.layout import ParallelMode

__all__ = ["check_marks", "clip_grad_norm_", "grad_norm"]

M = ParallelMode


def _params(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``parameters`` as a list, checked: tensors, not DTensors (TypeError naming the fix)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"clip_grad_norm_ takes parameters (tensors), not {type(p).__name__}")
        if type(p).__name__ == "DTensor":  # not imported here: torch.distributed.tensor is slow to load
            raise TypeError(
                "parallelctx.clip_grad_norm_ measures plain tensors marked by gpc's groups; a DTensor "
                "parameter carries its own mesh: clip DTensor models with torch.nn.utils.clip_grad_norm_, "
                "which reduces over the DTensor's mesh"
            )
    return params


def _local(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The ``norm_type``-th power of the norm of ``grads`` (the maximum for inf), float64 (the
    power taken in float64: float32 overflows where the norm itself does not)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norm = torch.nn.utils.get_total_norm(grads, norm_type).to(device=device, dtype=torch.float64)
    return norm if norm_type == float("inf") else norm**norm_type


def _hash_weights(n: int, device: torch.device) -> torch.Tensor:
    """``n`` fixed pseudo-random weights in [0, 1), float64: a weighted sum by them tells apart
    two tensors with the same values in another order (a symmetric weighting would not)."""
    x = torch.sin(torch.arange(n, dtype=torch.float64, device=device) * 12.9898 + 78.233) * 43758.5453
    return x - x.floor()


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """Of ``p``'s values and of its gradient: sum, sum of squares and a pseudo-randomly weighted
    sum (non-finite gradient entries counted as 0), whether it has a gradient, and whether that
    gradient has a non-finite entry; float64, 8 numbers."""
    flat = p.detach().double().flatten()
    weights = _hash_weights(flat.numel(), flat.device)
    values = [flat.sum(), flat.square().sum(), (flat * weights).sum()]
    if p.grad is None:
        zero = torch.zeros((), dtype=torch.float64, device=flat.device)
        return torch.stack([*values, zero, zero, zero, zero, zero])
    g = p.grad.detach().double().flatten()
    finite = torch.isfinite(g)
    g = torch.where(finite, g, torch.zeros_like(g))
    grads = [g.sum(), g.square().sum(), (g * weights).sum()]
    flags = [torch.ones_like(grads[0]), (~finite).any().double()]
    return torch.stack([*values, flags[0], *grads, flags[1]])


_WHAT_DIFFERS = ("values", "values", "values", "gradient (present on some ranks only)", "gradients",
                 "gradients", "gradients", "gradient's finiteness (non-finite on some ranks only)")  # fmt: skip


def check_marks(
    params: list[torch.Tensor],
    within: ParallelMode = M.TENSOR,
    names: list[str] | None = None,
    *,
    ctx: Any = None,
) -> None:
    """Check that every parameter of ``params`` without the ``tensor_model_parallel`` mark is a
    true replica across this rank's ``within`` group: the same values, and the same gradient
    (or none on every rank), as data and tensor parallelism keep a replica's. Two small
    all-reduces: the number of unmarked parameters, then a fingerprint of each (sums, sums of
    squares and pseudo-randomly weighted sums of values and gradient, so a shard holding the
    other rank's values in another order, or a zero-initialised shard whose gradients differ,
    is told apart). ``ctx``: the context whose groups to use (default gpc). Returns None.

    Raises:
        ValueError: every rank of the group does not hold the same number of unmarked
            parameters (both counts named); or the first unmarked parameter whose values or
            gradient differ across the group, named (by ``names[i]`` when given, else its index
            in ``params``) with its shape and the fix: a shard without the mark (counted once in a
            gradient norm, so the norm comes out too small), or replicas that drifted apart.
            Every rank of the group raises.
    """
    on = gpc if ctx is None else ctx  # a module of parallel.modules: gpc.module(name)
    if on.get_world_size(within) <= 1:
        return
    plain = [(i, p) for i, p in enumerate(params) if not getattr(p, "tensor_model_parallel", False)]
    group = on.get_group(within)
    count = torch.tensor([float(len(plain)), -float(len(plain))], dtype=torch.float64, device=on.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if count[0].item() != -count[1].item():
        raise ValueError(
            f"the ranks of the {within.value} group {on.get_ranks_in_group(within)} hold from "
            f"{int(-count[1].item())} to {int(count[0].item())} parameters without the "
            "tensor_model_parallel mark (this rank: "
            f"{len(plain)}): every rank of the group must pass the same parameters, in the same order"
        )
    if not plain:
        return
    sums = torch.stack([_fingerprint(p) for _, p in plain]).to(on.device)
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[: len(plain)], -both[len(plain) :]
    differ = (high - low).abs() > 1e-6 * (high.abs() + low.abs()) + 1e-12
    for (i, p), row in zip(plain, differ.tolist(), strict=True):
        if any(row):
            what = f"parameter {names[i]}" if names is not None else f"parameter {i} of those given"
            raise ValueError(
                f"{what} (shape {list(p.shape)}) has no tensor_model_parallel mark, so "
                f"it counts as a replica over the {within.value} group (ranks "
                f"{on.get_ranks_in_group(within)}), but its {_WHAT_DIFFERS[row.index(True)]} differ across "
                "those ranks: if it is a shard, mark it (p.tensor_model_parallel = True; Megatron's "
                "parallel layers do) or the norm comes out too small; if it is a replica, the replicas "
                "have drifted apart or were not reduced alike"
            )


def grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    check_replicas: bool = True,
    ctx: Any = None,
) -> torch.Tensor:
    """The norm of the whole model's gradients, of which ``parameters`` are this rank's (the
    module docstring says how shards and replicas count). Every rank of the launch must call it
    with its own parameters, the same number on the ranks of a tensor group (it all-reduces
    over gpc's MODEL group and, where the layout has an expert axis, its EXPERT_MODEL group).
    A parameter marked ``shared = True`` (Megatron's mark of the last stage's copy of a tied
    embedding) is left out, as Megatron does.

    ``check_replicas`` (default): check first that every parameter without the mark is a true
    replica across its tensor group (:func:`check_marks`), so that a shard missing its mark is
    named instead of counted once. ``ctx``: the context whose groups hold the model (default
    gpc; ``gpc.module(name)`` for one model of a job with ``parallel.modules``).

    Returns:
        A scalar tensor on gpc's device, the same on every rank: float64 when this rank's
        gradients are, else float32 (summed in float64 either way). nan when any rank's
        gradients hold a nan.

    Raises:
        NotLaunchedError: gpc is not launched.
        TypeError: a parameter is not a tensor, or is a DTensor.
        ValueError: ``norm_type`` is not positive; gtp_remat > 1 (how its shards count is not
            known here); with ``check_replicas``, what :func:`check_marks` raises.
    """
    on = gpc if ctx is None else ctx  # a module of parallel.modules: gpc.module(name)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(
            f"norm_type={norm_type} must be positive (2.0 for the Euclidean norm, inf for the largest)"
        )
    layout = on.launched.layout
    if layout is not None and max(layout.gtp_remat, layout.expert_gtp_remat) > 1:
        raise ValueError(
            f"parallelctx.clip_grad_norm_ under gtp_remat={layout.gtp_remat} (expert "
            f"{layout.expert_gtp_remat}): which parameters GTP shards is Megatron's to say; clip with "
            "Megatron's own optimizer (megatron.core.optimizer), which knows its parameters"
        )
    # (the group the squares are summed over, the group whose rank 0 counts a replica): grads
    buckets: dict[tuple[ParallelMode, ParallelMode], list[torch.Tensor]] = {
        (M.MODEL, M.TENSOR): [],
        (M.EXPERT_MODEL, M.EXPERT_TENSOR): [],
    }
    given = _params(parameters)
    if check_replicas:  # every parameter, with a gradient or not: the same list on every rank
        for expert, within in ((False, M.TENSOR), (True, M.EXPERT_TENSOR)):
            mine = [(i, p) for i, p in enumerate(given) if (getattr(p, "allreduce", True) is False) == expert]
            check_marks([p for _, p in mine], within, [f"{i} of those given" for i, _ in mine], ctx=ctx)
    for p in given:
        if p.grad is None or getattr(p, "shared", False):
            continue
        key = (
            (M.EXPERT_MODEL, M.EXPERT_TENSOR)
            if getattr(p, "allreduce", True) is False
            else (M.MODEL, M.TENSOR)
        )
        if getattr(p, "tensor_model_parallel", False) or on.get_local_rank(key[1]) == 0:
            buckets[key].append(p.grad)
    inf = norm_type == float("inf")
    dense, experts = buckets.values()
    parts = [(M.MODEL, _local(dense, norm_type, on.device))]
    expert_part = _local(experts, norm_type, on.device)
    if on.get_ranks_in_group(M.EXPERT_MODEL) == on.get_ranks_in_group(M.MODEL):  # no expert axis
        parts[0] = (M.MODEL, torch.maximum(parts[0][1], expert_part) if inf else parts[0][1] + expert_part)
    else:  # both, on every rank: a stage without experts joins too
        parts.append((M.EXPERT_MODEL, expert_part))
    total = torch.zeros((), dtype=torch.float64, device=on.device)
    nan = torch.zeros((), dtype=torch.float64, device=on.device)
    for over, part in parts:
        # gloo's MAX drops a nan that is not on the group's first rank: carry it as a flag
        flagged = torch.stack([torch.nan_to_num(part, nan=0.0, posinf=float("inf")), part.isnan().double()])
        if on.get_world_size(over) > 1:
            dist.all_reduce(
                flagged, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=on.get_group(over)
            )
        total = torch.maximum(total, flagged[0]) if inf else total + flagged[0]
        nan = nan + flagged[1]
    if nan.item() > 0:
        total = torch.full_like(total, float("nan"))
    dtype = (
        torch.float64
        if any(p.grad is not None and p.grad.dtype == torch.float64 for p in given)
        else torch.float32
    )
    return (total if inf else total ** (1.0 / norm_type)).to(dtype)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    check_replicas: bool = True,
    ctx: Any = None,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` (this rank's) in place so that the whole model's
    gradient norm (:func:`grad_norm`) is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does for a model held whole. Every rank must call it.
    ``check_replicas`` and ``ctx``: as for :func:`grad_norm`.

    Returns:
        The whole model's norm before clipping (as :func:`grad_norm` returns it).

    Raises:
        NotLaunchedError: gpc is not launched.
        TypeError: a parameter is not a tensor, or is a DTensor.
        ValueError: what :func:`grad_norm` raises.
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(params, norm_type, check_replicas=check_replicas, ctx=ctx)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the model's gradient norm (order {norm_type}) is {total.item()}; "
            "set error_if_nonfinite=False to clip anyway"
        )
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in params if p.grad is not None], max_norm, total.to(grads[0].device), foreach
        )
    return total
