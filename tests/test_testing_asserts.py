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
