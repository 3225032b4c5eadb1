"""Assertions across the ranks of a parallel mode's group, for tests of parallel model code.

Each helper is a collective over ``gpc``'s CPU group of ``mode``: every rank of the group must
call it, with a tensor of the same shape and dtype. Every rank gets the same verdict, so all
ranks of a group fail together with the same message.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parallelctx.context import gpc
from parallelctx.layout import ParallelMode

__all__ = ["assert_differs_across", "assert_same_across", "gather_across"]


def _name(mode: ParallelMode | str) -> str:
    return ParallelMode.parse(mode).value


def gather_across(mode: ParallelMode | str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """Gather ``tensor`` from every rank of this rank's ``mode`` group.

    Returns:
        One detached tensor per rank of the group, in group order (ascending global rank), on
        ``tensor``'s device; entry ``gpc.get_local_rank(mode)`` equals ``tensor``.

    Raises:
        NotLaunchedError: gpc is not launched.
        TypeError: ``tensor`` is not a torch.Tensor.
        ValueError: the ranks passed tensors of different shapes or dtypes (the message lists
            each rank's).
    """
    __tracebackhide__ = True
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"gather_across(mode, tensor) needs a torch.Tensor, got {type(tensor).__name__}")
    group = gpc.get_cpu_group(mode)
    ranks = gpc.get_ranks_in_group(mode)
    local = tensor.detach().to("cpu").contiguous()
    if len(ranks) == 1:
        return [local.to(tensor.device)]
    meta: list[Any] = [None] * len(ranks)
    dist.all_gather_object(meta, (tuple(local.shape), str(local.dtype)), group=group)
    if len(set(meta)) != 1:
        seen = ", ".join(f"rank {r}: shape {list(s)} {d}" for r, (s, d) in zip(ranks, meta, strict=True))
        raise ValueError(
            f"gather_across({_name(mode)!r}) needs the same shape and dtype on every rank of the group; "
            f"got {seen}"
        )
    parts = [torch.empty_like(local) for _ in ranks]
    dist.all_gather(parts, local, group=group)
    return [p.to(tensor.device) for p in parts]


def _differences(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[bool, float]:
    """(whether a and b are close, the largest absolute difference); NaNs in the same places are equal."""
    if a.dtype == torch.bool:
        a, b = a.to(torch.int8), b.to(torch.int8)
    if not (a.is_floating_point() or a.is_complex()):
        a, b = a.to(torch.float64), b.to(torch.float64)
    close = bool(torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True).all()) if a.numel() else True
    diff = (a - b).abs()
    diff = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(diff), diff)
    largest = float(torch.nan_to_num(diff, nan=float("inf")).max()) if diff.numel() else 0.0
    return close, largest


def assert_same_across(
    mode: ParallelMode | str, tensor: torch.Tensor, atol: float = 0.0, rtol: float = 0.0, what: str = "tensor"
) -> None:
    """Assert that ``tensor`` is equal (within ``atol``/``rtol``) on every rank of this rank's
    ``mode`` group: replicated weights, a tensor-parallel layer's all-reduced output, gradients
    after a data-parallel all-reduce. Exact by default.

    Returns:
        None.

    Raises:
        AssertionError: some ranks differ from the group's first rank; the message names them
            (global ranks), the largest absolute difference of each, and the group.
        ValueError, TypeError: see :func:`gather_across`.
    """
    __tracebackhide__ = True  # reports start at the test's line
    parts = gather_across(mode, tensor)
    ranks = gpc.get_ranks_in_group(mode)
    bad = []
    for rank, part in zip(ranks[1:], parts[1:], strict=True):
        close, largest = _differences(parts[0], part, atol, rtol)
        if not close:
            bad.append(f"rank {rank} (max |diff| {largest:.6g})")
    if bad:
        worst = max(_differences(parts[0], p, atol, rtol)[1] for p in parts[1:])
        raise AssertionError(
            f"{what} differs across the {_name(mode)} group {ranks}: max |diff| {worst:.6g} "
            f"(atol={atol:g}, rtol={rtol:g}); compared with rank {ranks[0]}, these differ: {', '.join(bad)}"
        )


def assert_differs_across(mode: ParallelMode | str, tensor: torch.Tensor, what: str = "tensor") -> None:
    """Assert that ``tensor`` differs between every two ranks of this rank's ``mode`` group:
    a tensor-parallel shard initialised from the TENSOR seed stream, a dropout mask on a shard.
    A group of one rank passes.

    Returns:
        None.

    Raises:
        AssertionError: two or more ranks hold equal tensors; the message names each set of
            ranks that agree and the group.
        ValueError, TypeError: see :func:`gather_across`.
    """
    __tracebackhide__ = True
    parts = gather_across(mode, tensor)
    ranks = gpc.get_ranks_in_group(mode)
    same: list[list[int]] = []
    placed: set[int] = set()
    for i, part in enumerate(parts):
        if i in placed:
            continue
        equal = [
            j
            for j in range(i + 1, len(parts))
            if j not in placed and _differences(part, parts[j], 0.0, 0.0)[0]
        ]
        if equal:
            placed.update(equal)
            same.append([ranks[i]] + [ranks[j] for j in equal])
    if same:
        sets = "; ".join("ranks " + ", ".join(str(r) for r in group) for group in same)
        raise AssertionError(
            f"{what} is identical on {sets} of the {_name(mode)} group {ranks}; expected a different value "
            "on "
            "every rank (e.g. a shard or mask drawn outside `with gpc.seed(...)`)"
        )
