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
  replicas counted on expert-tensor rank 0.

The data and context groups are left out: their ranks hold the same gradients once DDP (or
FSDP, or DeepSpeed) averaged them. The result is the same tensor on every rank, so every rank
scales by the same factor and replicas stay equal. The local norms and the scaling are torch's
(``torch.nn.utils.get_total_norm``, ``clip_grads_with_norm_``).
"""

from __future__ import annotations

from collections.abc import Iterable

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
    """The ``norm_type``-th power of the norm of ``grads`` (the maximum for inf), float32."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norm = torch.nn.utils.get_total_norm(grads, norm_type).to(device=device, dtype=torch.float32)
    return norm if norm_type == float("inf") else norm**norm_type


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """Sum, sum of squares and a position-weighted sum of ``p``, float64."""
    flat = p.detach().double().flatten()
    weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), flat.square().sum(), (flat * weights).sum()])


def check_marks(
    params: list[torch.Tensor], within: ParallelMode = M.TENSOR, names: list[str] | None = None
) -> None:
    """Check that every parameter of ``params`` without the ``tensor_model_parallel`` mark is
    equal across this rank's ``within`` group (one all-reduce of three sums per parameter; every
    rank of the group must call it with the same number of parameters). The fingerprint of a
    parameter is its sum, its sum of squares and a position-weighted sum, so a shard whose values
    are the other ranks' in another order is told apart too. Returns None.

    Raises:
        ValueError: the first unmarked parameter whose values differ across the group, named (by
            ``names[i]`` when given, else its index in ``params``) with its shape and the fix: a shard without
            the mark (counted once in a gradient norm, so the norm comes out too small), or
            replicas that drifted apart. Every rank raises the same error.
    """
    if gpc.get_world_size(within) <= 1:
        return
    plain = [(i, p) for i, p in enumerate(params) if not getattr(p, "tensor_model_parallel", False)]
    if not plain:
        return
    sums = torch.stack([_fingerprint(p) for _, p in plain]).to(gpc.device)
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=gpc.get_group(within))
    high, low = both[: len(plain)], -both[len(plain) :]
    differ = (high - low).abs() > 1e-6 * (high.abs() + low.abs()) + 1e-12
    for (i, p), bad in zip(plain, differ.any(dim=1).tolist(), strict=True):
        if bad:
            what = f"parameter {names[i]}" if names is not None else f"parameter {i} of those given"
            raise ValueError(
                f"{what} (shape {list(p.shape)}) has no tensor_model_parallel mark, so "
                f"it counts as a replica over the {within.value} group (ranks "
                f"{gpc.get_ranks_in_group(within)}), but its values differ across those ranks: if it is "
                "a shard, mark it (p.tensor_model_parallel = True; Megatron's parallel layers do) or the "
                "norm comes out too small; if it is a replica, the replicas have drifted apart"
            )


def grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0, *, check_replicas: bool = True
) -> torch.Tensor:
    """The norm of the whole model's gradients, of which ``parameters`` are this rank's (the
    module docstring says how shards and replicas count). Every rank of the launch must call it
    with its own parameters (it all-reduces over gpc's MODEL group and, where the layout has an
    expert axis, its EXPERT_MODEL group).

    ``check_replicas`` (default): check first that every parameter without the mark is equal
    across its tensor group (one more small all-reduce), so that a shard missing its mark is
    named instead of counted once.

    Returns:
        A float32 scalar tensor on gpc's device, the same on every rank.

    Raises:
        NotLaunchedError: gpc is not launched.
        TypeError: a parameter is not a tensor, or is a DTensor.
        ValueError: ``norm_type`` is not positive; with ``check_replicas``, a parameter without
            the mark differs across its tensor group (named by its index and shape).
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(
            f"norm_type={norm_type} must be positive (2.0 for the Euclidean norm, inf for the largest)"
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
            check_marks([p for _, p in mine], within, [f"{i} of those given" for i, _ in mine])
    with_grads = [p for p in given if p.grad is not None]
    for p in with_grads:
        key = (
            (M.EXPERT_MODEL, M.EXPERT_TENSOR)
            if getattr(p, "allreduce", True) is False
            else (M.MODEL, M.TENSOR)
        )
        if p.grad is not None and (
            getattr(p, "tensor_model_parallel", False) or gpc.get_local_rank(key[1]) == 0
        ):
            buckets[key].append(p.grad)
    inf = norm_type == float("inf")
    dense, experts = buckets.values()
    parts = [(M.MODEL, _local(dense, norm_type, gpc.device))]
    expert_part = _local(experts, norm_type, gpc.device)
    if gpc.get_ranks_in_group(M.EXPERT_MODEL) == gpc.get_ranks_in_group(M.MODEL):  # no expert axis
        parts[0] = (M.MODEL, torch.maximum(parts[0][1], expert_part) if inf else parts[0][1] + expert_part)
    else:  # both, on every rank: a stage without experts joins too
        parts.append((M.EXPERT_MODEL, expert_part))
    total = torch.zeros((), dtype=torch.float32, device=gpc.device)
    for over, part in parts:
        if gpc.get_world_size(over) > 1:
            dist.all_reduce(
                part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=gpc.get_group(over)
            )
        total = torch.maximum(total, part) if inf else total + part
    return total if norm_type == float("inf") else total ** (1.0 / norm_type)


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    check_replicas: bool = True,
) -> torch.Tensor:
    """Scale the gradients of ``parameters`` (this rank's) in place so that the whole model's
    gradient norm (:func:`grad_norm`) is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does for a model held whole. Every rank must call it.
    ``check_replicas``: as for :func:`grad_norm`.

    Returns:
        The whole model's norm before clipping (float32, the same on every rank).

    Raises:
        NotLaunchedError: gpc is not launched.
        TypeError: a parameter is not a tensor, or is a DTensor.
        ValueError: ``norm_type`` is not positive, or a parameter without the mark differs
            across its tensor group (``check_replicas``).
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf (on every rank).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(params, norm_type, check_replicas=check_replicas)
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
