"""parallelctx.testing's assertion helpers, run on 4 ranks (tensor 2, data 2) by the plugin itself.

Each helper is shown catching the bug it exists for: a replicated weight drawn on a per-rank
stream, a shard drawn on the shared stream.
"""

from __future__ import annotations

import re

import pytest
import torch

from parallelctx import ParallelMode, gpc
from parallelctx.testing import assert_differs_across, assert_same_across, gather_across

pytestmark = pytest.mark.parallel(world_size=4, tensor=2)


def test_gather_across_returns_group_order() -> None:
    rank = gpc.get_global_rank()
    parts = gather_across(ParallelMode.TENSOR, torch.tensor([float(rank)]))
    assert [int(p.item()) for p in parts] == gpc.get_ranks_in_group(ParallelMode.TENSOR)
    assert len(gather_across("data", torch.zeros(3))) == 2


def test_gather_across_refuses_different_shapes() -> None:
    tensor = torch.zeros(1 + gpc.get_local_rank("tensor"))
    with pytest.raises(ValueError, match=r"same shape and dtype.*shape \[1\].*shape \[2\]"):
        gather_across("tensor", tensor)


def test_assert_same_across_catches_a_weight_drawn_per_rank() -> None:
    replicated = torch.randn(8)  # default stream: the same on every rank of a tensor group
    assert_same_across("tensor", replicated)
    with gpc.seed(ParallelMode.TENSOR):
        wrong = torch.randn(8)  # the bug: a replicated weight initialised on the per-rank stream
    ranks = gpc.get_ranks_in_group("tensor")
    with pytest.raises(
        AssertionError, match=re.escape(f"differs across the tensor group {ranks}: max |diff| ")
    ) as info:
        assert_same_across("tensor", wrong, what="bias")
    assert info.value.args[0].startswith("bias differs")
    assert f"these differ: rank {ranks[1]} (max |diff|" in str(info.value)


def test_assert_same_across_tolerance() -> None:
    noisy = torch.ones(4) + 1e-7 * gpc.get_local_rank("tensor")
    with pytest.raises(AssertionError, match="atol=0, rtol=0"):
        assert_same_across("tensor", noisy)
    assert_same_across("tensor", noisy, atol=1e-6)


def test_assert_differs_across_catches_a_shard_drawn_on_the_shared_stream() -> None:
    with gpc.seed(ParallelMode.TENSOR):
        shard = torch.randn(8)  # right: every tensor rank draws its own shard
    assert_differs_across("tensor", shard)
    wrong = torch.randn(8)  # the bug: every tensor rank draws the same "shard"
    ranks = gpc.get_ranks_in_group("tensor")
    with pytest.raises(
        AssertionError, match=f"identical on ranks {ranks[0]}, {ranks[1]} of the tensor group"
    ):
        assert_differs_across("tensor", wrong)


def test_helpers_need_a_tensor() -> None:
    with pytest.raises(TypeError, match="needs a torch.Tensor, got list"):
        gather_across("tensor", [1.0])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- exact dtypes
def test_integer_tensors_that_differ_by_one_are_not_the_same() -> None:
    # 2**53 and 2**53 + 1 are one float64: a comparison through floats would call them equal
    token_ids = torch.tensor([2**53 + gpc.get_local_rank("tensor"), 7], dtype=torch.int64)
    ranks = gpc.get_ranks_in_group("tensor")
    with pytest.raises(
        AssertionError,
        match=re.escape(f"differs across the tensor group {ranks}: max |diff| 1 (compared exactly"),
    ):
        assert_same_across("tensor", token_ids, what="token ids")
    assert_differs_across("tensor", token_ids)
    assert_same_across("data", token_ids)  # the data replicas hold the same ids


def test_large_integer_differences_are_reported_exactly() -> None:
    extreme = torch.tensor([[-(2**63), 2**63 - 1][gpc.get_local_rank("tensor")]], dtype=torch.int64)
    with pytest.raises(AssertionError, match=f"max \\|diff\\| {2**64 - 1} "):
        assert_same_across("tensor", extreme)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.uint8, torch.int16])
def test_small_integer_dtypes_compare_exactly(dtype: torch.dtype) -> None:
    values = torch.tensor([1, 2, 3 + gpc.get_local_rank("tensor")], dtype=dtype)
    with pytest.raises(AssertionError, match=f"max \\|diff\\| 1 \\(compared exactly, {dtype}\\)"):
        assert_same_across("tensor", values)
    assert_differs_across("tensor", values)


def test_bool_masks_compare_exactly() -> None:
    mask = torch.tensor([True, False, gpc.get_local_rank("tensor") == 0])
    with pytest.raises(AssertionError, match="mask differs across the tensor group"):
        assert_same_across("tensor", mask, what="mask")
    assert_differs_across("tensor", mask)
    assert_same_across("tensor", torch.tensor([True, False]))
    with pytest.raises(AssertionError, match="identical on ranks"):
        assert_differs_across("tensor", torch.tensor([True, False]))


def test_tolerances_are_refused_for_integer_tensors() -> None:
    with pytest.raises(
        ValueError, match=r"compares torch.int64 tensors exactly, so atol=1, rtol=0 do not apply"
    ):
        assert_same_across("tensor", torch.arange(3), atol=1)


def test_empty_tensors_are_the_same_and_cannot_differ() -> None:
    for empty in (torch.empty(0), torch.zeros(3, 0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)):
        assert_same_across("tensor", empty)
        with pytest.raises(
            AssertionError, match=r"is empty \(shape \[.*\]\) on every rank of the tensor group"
        ):
            assert_differs_across("tensor", empty)
