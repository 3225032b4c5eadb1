"""The tensor-parallel MLP of tp_mlp.py equals the serial model, forward and gradients, with
dropout on, for tensor 1, 2, 4 and a 2-stage pipeline: one pytest test per layout, run on 4
ranks by parallelctx's pytest plugin; and on 64 ranks (tensor 8; tensor 4 x pipeline 4; tensor 2
x pipeline 2 x context 2), every rank a thread of the test's process (``local=True``). Float64,
to 1e-12 (relative and absolute: the serial sums go in another order)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tp_mlp import ParallelMLP, pipeline_forward_backward, serial_mlp

from parallelctx import ParallelMode, gpc
from parallelctx.testing import assert_differs_across, assert_same_across, gather_across

# p = 0.5 and 8 rows: a 4-way shard of the mask has 32 entries, so two ranks draw the same one with
# probability 2**-32 (at p = 0.1 and 4 rows a mask of all ones was likely on two ranks).
HIDDEN, FFN, BATCH, P = 8, 16, 8, 0.5
LAYOUTS = [dict(tensor=1), dict(tensor=2), dict(tensor=4), dict(tensor=2, pipeline=2), dict(pipeline=2)]


def _serial_params(block: int) -> list[torch.Tensor]:
    """Block ``block``'s full weights: the same on every rank (a fixed generator)."""
    gen = torch.Generator().manual_seed(1000 + block)
    shapes = [(FFN, HIDDEN), (FFN,), (HIDDEN, FFN), (HIDDEN,)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


@pytest.mark.parallel(world_size=4, layouts=LAYOUTS)
def test_forward_and_gradients_equal_the_serial_model() -> None:
    _check_against_the_serial_model()


# The same check on 64 ranks, every rank a thread of this process (parallelctx.run_local): the
# numbers are the real ranks' (docs/testing.md), at a size no pool of processes reaches here.
@pytest.mark.parallel(
    world_size=64,
    layouts=[dict(tensor=8), dict(tensor=4, pipeline=4), dict(tensor=2, pipeline=2, context=2)],
    local=True,
)
def test_forward_and_gradients_equal_the_serial_model_on_64_ranks() -> None:
    _check_against_the_serial_model()


def _check_against_the_serial_model() -> None:
    stage = gpc.get_local_rank(ParallelMode.PIPELINE)
    stages = gpc.get_world_size(ParallelMode.PIPELINE)
    block = ParallelMLP(*_serial_params(stage), p=P)
    # each data-parallel replica gets its own batch; the ranks of one model replica share it
    gen = torch.Generator().manual_seed(50 + gpc.get_local_rank(ParallelMode.DATA))
    x = torch.randn(BATCH, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(BATCH, HIDDEN, generator=gen, dtype=torch.float64)

    y = pipeline_forward_backward(block, x, grad_out)

    keep_h, keep_y = block.masks
    if gpc.get_world_size(ParallelMode.TENSOR) > 1:
        assert_differs_across(ParallelMode.TENSOR, keep_h, what="dropout mask of the shard")
    assert_same_across(ParallelMode.TENSOR, keep_y, what="dropout mask of the replicated output")
    # the serial reference, with the masks the parallel model drew (all stages' blocks)
    full_h = torch.cat(gather_across(ParallelMode.TENSOR, keep_h), dim=-1)
    masks: list = [None] * stages
    dist.all_gather_object(masks, (full_h, keep_y), group=gpc.get_cpu_group(ParallelMode.PIPELINE))
    params = [[t.requires_grad_(True) for t in _serial_params(s)] for s in range(stages)]
    ref_x = x.detach().clone().requires_grad_(True)
    out = ref_x
    for s in range(stages):
        out = serial_mlp(out, params[s], masks[s], P)
    out.backward(grad_out)

    if gpc.is_pipeline_last_stage():
        torch.testing.assert_close(y, out.detach(), rtol=1e-12, atol=1e-12)
    if gpc.is_pipeline_first_stage():
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    w1, b1, w2, b2 = params[stage]
    part = block.part
    torch.testing.assert_close(block.w1.grad, w1.grad[part], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.b1.grad, b1.grad[part], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.w2.grad, w2.grad[:, part], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.b2.grad, b2.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parallel(world_size=4, tensor=2)
def test_a_missing_all_reduce_is_caught() -> None:
    # the bug a tensor-parallel test exists for: a row-parallel output without its all-reduce
    block = ParallelMLP(*_serial_params(0), p=0.0)
    x = torch.randn(BATCH, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    partial = torch.nn.functional.linear(
        torch.nn.functional.gelu(torch.nn.functional.linear(x, block.w1, block.b1)), block.w2
    )
    with pytest.raises(AssertionError, match="differs across the tensor group"):
        assert_same_across(ParallelMode.TENSOR, partial, what="row-parallel output")
    assert_same_across(ParallelMode.TENSOR, block(x).detach())
