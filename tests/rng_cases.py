"""Model code that draws random numbers, shared by the RNG tests (one process, the plugin's ranks,
and tests/torchrun_rng.py under real torchrun).

* :func:`stream_draws` draws 8 numbers from every stream; :func:`streams_alike` names the streams
  of one rank that drew the same numbers.
* :func:`train_step` runs a small layer whose checkpointed region is entered under one stream and
  whose backward runs under another (or outside any ``with gpc.seed``), and returns what a user
  sees: the output, the gradients and one draw from every stream afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as tc

import parallelctx
from parallelctx import REPLICA, ParallelMode, gpc
from parallelctx.seed import STREAMS

M = ParallelMode
Region = Callable[[torch.Tensor], torch.Tensor]
Checkpoint = Callable[[Region, torch.Tensor], torch.Tensor]


def stream_draws(n: int = 8) -> dict[str, list[float]]:
    """Draw ``n`` numbers from every stream (the default one as "global"), in stream order."""
    out = {}
    for stream in STREAMS:
        with gpc.seed(stream):
            out[str(stream)] = torch.rand(n, dtype=torch.float64).tolist()
    return out


def streams_alike(draws: dict[str, list[float]]) -> list[list[str]]:
    """The sets of streams that drew the same numbers (empty when every stream drew its own)."""
    by_draw: dict[tuple[float, ...], list[str]] = {}
    for stream, values in draws.items():
        by_draw.setdefault(tuple(values), []).append(stream)
    return [names for names in by_draw.values() if len(names) > 1]


# --------------------------------------------------------------------------- checkpoint forms
def _reentrant(fn: Region, x: torch.Tensor) -> torch.Tensor:
    return parallelctx.checkpoint(fn, x, use_reentrant=True)  # type: ignore[no-any-return]


def _non_reentrant(fn: Region, x: torch.Tensor) -> torch.Tensor:
    return parallelctx.checkpoint(fn, x, use_reentrant=False)  # type: ignore[no-any-return]


def _context_fn(fn: Region, x: torch.Tensor) -> torch.Tensor:
    return tc.checkpoint(fn, x, use_reentrant=False, context_fn=parallelctx.rng_context_fn)  # type: ignore[no-any-return]


def _torch_reentrant(fn: Region, x: torch.Tensor) -> torch.Tensor:
    return tc.checkpoint(fn, x, use_reentrant=True)  # type: ignore[no-any-return]


def _torch_non_reentrant(fn: Region, x: torch.Tensor) -> torch.Tensor:
    return tc.checkpoint(fn, x, use_reentrant=False)  # type: ignore[no-any-return]


FORMS: dict[str, Checkpoint] = {
    "reentrant": _reentrant,
    "non-reentrant": _non_reentrant,
    "context_fn": _context_fn,
}
"""parallelctx's three ways to checkpoint a region."""

TORCH_FORMS: dict[str, Checkpoint] = {
    "torch-reentrant": _torch_reentrant,
    "torch-non-reentrant": _torch_non_reentrant,
}
"""torch's own checkpoint, which restores only the generators of the stream active at entry."""

ENTRY_STREAMS: tuple[Any, ...] = (M.GLOBAL, M.TENSOR, M.DATA, REPLICA)
"""Streams a region is entered under."""

OTHER_STREAM: dict[Any, Any] = {M.GLOBAL: M.TENSOR, M.TENSOR: M.DATA, M.DATA: REPLICA, REPLICA: M.TENSOR}
"""For each entry stream, another stream for the backward pass to run under."""


# --------------------------------------------------------------------------- regions
def entry_only_region(x: torch.Tensor) -> torch.Tensor:
    """Draws only on the stream active when it is entered (what torch's checkpoint handles)."""
    y = torch.nn.functional.dropout(x, 0.3)
    return y * torch.rand_like(y) + y.tanh()


def forking_region(x: torch.Tensor) -> torch.Tensor:
    """Draws on the entry stream, on CONTEXT, on GLOBAL inside it, and on TENSOR and DATA (one of
    which may be the entry stream itself)."""
    y = torch.nn.functional.dropout(x, 0.3)  # the stream active at entry
    with gpc.seed(M.CONTEXT):
        y = torch.nn.functional.dropout(y.tanh(), 0.5)
        with gpc.seed(M.GLOBAL):
            y = y + torch.rand_like(y)
    y = y * torch.rand_like(y)  # the entry stream again
    with gpc.seed(M.TENSOR):
        y = torch.nn.functional.dropout(y, 0.2)
    with gpc.seed(M.DATA):
        y = y + torch.randn_like(y)
    return y.sin()


def nested_region(ck: Checkpoint | None) -> Region:
    """A region that enters a second region under DATA (checkpointed with ``ck`` too)."""

    def outer(x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.dropout(x, 0.4)
        with gpc.seed(M.DATA):
            inner = forking_region(y) if ck is None else ck(forking_region, y)
        with gpc.seed(REPLICA):
            return inner * torch.rand_like(inner) + y

    return outer


def _advance_every_stream() -> None:
    """What a training loop does between forward and backward: draw on every stream."""
    for stream in STREAMS:
        with gpc.seed(stream):
            torch.rand(3)


def after_draws() -> list[torch.Tensor]:
    """One draw from every stream, the default one first: where each stream stands."""
    out = [torch.rand(4)]
    for stream in STREAMS:
        with gpc.seed(stream):
            out.append(torch.rand(4))
    return out


Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]


def train_step(region: Region, ck: Checkpoint | None, entry: Any, backward: Any) -> Result:
    """Run ``region`` (checkpointed with ``ck``, or plainly) entered under stream ``entry``,
    then backward under ``backward``: ``"inside"`` the same ``with gpc.seed(entry)`` block,
    ``"outside"`` any block, or a stream. Every stream is put back afterwards.

    Returns:
        ``(output, grad of x, grad of w, one draw from every stream after backward)``.
    """
    start = gpc.get_rng_state()
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    h = x @ w
    with gpc.seed(entry):
        out = region(h) if ck is None else ck(region, h)
        if backward == "inside":
            _advance_every_stream()
            (out**2).sum().backward()
    if backward == "outside":
        _advance_every_stream()
        (out**2).sum().backward()
    elif backward != "inside":
        with gpc.seed(backward):
            _advance_every_stream()
            (out**2).sum().backward()
    assert x.grad is not None and w.grad is not None
    result = (out.detach(), x.grad, w.grad, after_draws())
    gpc.set_rng_state(start)
    return result


def same_result(a: Result, b: Result) -> bool:
    """Whether two :func:`train_step` results are equal bit for bit."""
    return (
        torch.equal(a[0], b[0])
        and torch.equal(a[1], b[1])
        and torch.equal(a[2], b[2])
        and all(torch.equal(p, q) for p, q in zip(a[3], b[3], strict=True))
    )


def checkpoint_mismatches(entries: tuple[Any, ...] = ENTRY_STREAMS) -> list[str]:
    """Every case where a checkpointed region differs from the plain run: each parallelctx form,
    each entry stream, backward inside, outside and under another stream, one region and nested.

    Returns:
        A description of each mismatch (empty when all agree bit for bit).
    """
    bad = []
    for entry in entries:
        for backward in ("inside", "outside", OTHER_STREAM[entry]):
            plain = train_step(forking_region, None, entry, backward)
            nested_plain = train_step(nested_region(None), None, entry, backward)
            for name, ck in FORMS.items():
                case = f"{name}, entered under {entry}, backward {backward}"
                if not same_result(plain, train_step(forking_region, ck, entry, backward)):
                    bad.append(case)
                if not same_result(nested_plain, train_step(nested_region(ck), ck, entry, backward)):
                    bad.append(case + ", nested")
    return bad
