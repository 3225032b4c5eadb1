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
from parallelctx.planning.layout import ParallelMode

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
    # gathered as raw bytes: exact for every dtype, including those gloo cannot send (int16, ...)
    raw = local.reshape(-1).view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in ranks]
    dist.all_gather(parts, raw, group=group)
    return [p.view(local.dtype).reshape(local.shape).to(tensor.device) for p in parts]


def _is_exact(dtype: torch.dtype) -> bool:
    """Integer and bool tensors compare exactly (no tolerance, no detour through floats)."""
    return not (dtype.is_floating_point or dtype.is_complex)


def _differences(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[bool, float | int]:
    """(whether a and b are close, the largest absolute difference).

    Integer and bool tensors are equal only when every element is (the difference an exact
    Python int); floating tensors use ``torch.isclose``, NaNs in the same places being equal.
    Two empty tensors are equal.
    """
    if not a.numel():
        return True, 0
    if _is_exact(a.dtype):
        differ = a != b
        if not bool(differ.any()):
            return True, 0
        pairs = zip(a[differ].tolist(), b[differ].tolist(), strict=True)
        return False, max(abs(int(x) - int(y)) for x, y in pairs)
    close = bool(torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True).all())
    diff = (a - b).abs()
    diff = torch.where(torch.isnan(a) & torch.isnan(b), torch.zeros_like(diff), diff)
    return close, float(torch.nan_to_num(diff, nan=float("inf")).max())


def _show(largest: float | int) -> str:
    return str(largest) if isinstance(largest, int) else f"{largest:.6g}"


def assert_same_across(
    mode: ParallelMode | str, tensor: torch.Tensor, atol: float = 0.0, rtol: float = 0.0, what: str = "tensor"
) -> None:
    """Assert that ``tensor`` is equal (within ``atol``/``rtol``) on every rank of this rank's
    ``mode`` group: replicated weights, a tensor-parallel layer's all-reduced output, gradients
    after a data-parallel all-reduce. Exact by default.

    Floating and complex tensors compare with ``torch.isclose`` (NaNs in the same places are
    equal). Integer and bool tensors compare exactly, element by element (``2**53`` and
    ``2**53 + 1`` differ); ``atol``/``rtol`` must stay 0 for them. Empty tensors (of the same
    shape on every rank) hold no values that could differ, so they are equal: the assertion passes.

    Returns:
        None.

    Raises:
        AssertionError: some ranks differ from the group's first rank; the message names them
            (global ranks), the largest absolute difference of each, and the group.
        ValueError: ``atol`` or ``rtol`` is not 0 for an integer or bool tensor; also see
            :func:`gather_across`.
        TypeError: see :func:`gather_across`.
    """
    __tracebackhide__ = True  # reports start at the test's line
    parts = gather_across(mode, tensor)  # every rank reaches the checks below with the same dtype
    exact = _is_exact(parts[0].dtype)
    if exact and (atol or rtol):
        raise ValueError(
            f"assert_same_across compares {parts[0].dtype} tensors exactly, so atol={atol:g}, "
            f"rtol={rtol:g} do not apply; leave them 0, or compare a floating copy "
            "(tensor.double()) within a tolerance"
        )
    ranks = gpc.get_ranks_in_group(mode)
    bad = []
    largest: list[float | int] = []
    for rank, part in zip(ranks[1:], parts[1:], strict=True):
        close, diff = _differences(parts[0], part, atol, rtol)
        if not close:
            bad.append(f"rank {rank} (max |diff| {_show(diff)})")
            largest.append(diff)
    if bad:
        how = f"compared exactly, {parts[0].dtype}" if exact else f"atol={atol:g}, rtol={rtol:g}"
        raise AssertionError(
            f"{what} differs across the {_name(mode)} group {ranks}: max |diff| {_show(max(largest))} "
            f"({how}); compared with rank {ranks[0]}, these differ: {', '.join(bad)}"
        )


def assert_differs_across(mode: ParallelMode | str, tensor: torch.Tensor, what: str = "tensor") -> None:
    """Assert that ``tensor`` differs between every two ranks of this rank's ``mode`` group:
    a tensor-parallel shard initialised from the TENSOR seed stream, a dropout mask on a shard.
    A group of one rank passes.

    Two tensors differ when any element does: integer and bool tensors are compared exactly,
    floating ones with NaNs in the same places counting as equal. Empty tensors are equal to each
    other (:func:`assert_same_across`), so on a group of two or more ranks they fail, with a
    message saying they are empty.

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
    if len(ranks) > 1 and not parts[0].numel():
        raise AssertionError(
            f"{what} is empty (shape {list(parts[0].shape)}) on every rank of the {_name(mode)} group "
            f"{ranks}: empty tensors hold no values, so they cannot differ; pass the values to compare"
        )
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
