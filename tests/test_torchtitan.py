"""parallelctx.torchtitan: torchtitan's ParallelDims on gpc's groups.

One real-torchrun run (tests/torchtitan_parity.py) goes through 9 layouts of 8 ranks; on each it
builds the bridge and torchtitan's own ``build_mesh`` on the same processes. Here the parent
checks that every mesh holds the same ranks under the same names, that the bridge's groups hold
those ranks (an all-gather over each), and that the bridge made no process group. Pure tests
check the refusals; a pooled test runs torchtitan's FSDP apply step on the bridge and trains.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torchrun_helpers import run_torchrun

from parallelctx import plan
from parallelctx.torchtitan import TorchtitanError, check_layout

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed (make venv installs it)")

NAMES = ("pp", "batch", "loss", "dp_replicate", "cp", "tp", "ep", "efsdp", "dp", "dp_shard")


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """Every rank's records of tests/torchtitan_parity.py (one torchrun, 9 layouts)."""
    out = tmp_path_factory.mktemp("titan")
    proc = run_torchrun(8, ["tests/torchtitan_parity.py", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(8)]


@pytest.mark.slow
def test_nine_layouts_ran(parity: list[list[dict[str, Any]]]) -> None:
    layouts = [rec["layout"] for rec in parity[0]]
    assert len(layouts) == 9
    assert any(lay[0] > 1 and lay[1] > 1 for lay in layouts), "HSDP"
    assert any(lay[5] > 1 and lay[0] > 1 for lay in layouts), "expert parallel with replicas"
    for i in range(6):  # every axis is > 1 somewhere
        assert any(lay[i] > 1 for lay in layouts)


@pytest.mark.slow
def test_every_mesh_matches_torchtitans_build(parity: list[list[dict[str, Any]]]) -> None:
    checked = 0
    for rank, records in enumerate(parity):
        for rec in records:
            for backend, entry in rec["backends"].items():
                assert entry["bridge_is_parallel_dims"]
                mine, theirs = entry["bridge"], entry["torchtitan"]
                assert mine.keys() == theirs.keys(), (rec["layout"], backend)
                for key, value in theirs.items():
                    assert mine[key] == value, (rank, rec["layout"], backend, key)
                    checked += 1
                if backend == "spmd_types":
                    assert set(NAMES) | {
                        "world",
                        "dp_replicate,dp_shard",
                        "dp_replicate,dp_shard,cp,tp",
                    } == set(mine)
    assert checked > 8 * 9 * 12


@pytest.mark.slow
def test_the_bridges_groups_hold_those_ranks(parity: list[list[dict[str, Any]]]) -> None:
    for rank, records in enumerate(parity):
        for rec in records:
            for backend, entry in rec["backends"].items():
                for name, members in entry["bridge_proved"].items():
                    _, ranks = entry["bridge"][name]
                    assert members == ranks, (rank, rec["layout"], backend, name)
                    assert rank in members


@pytest.mark.slow
def test_the_bridge_makes_no_process_group(parity: list[list[dict[str, Any]]]) -> None:
    for records in parity:
        for rec in records:
            for entry in rec["backends"].values():
                assert entry["bridge_groups"] == {"calls": 0, "fake_calls": 0, "joined": 0}
                assert entry["torchtitan_groups"]["calls"] >= 0
            # torchtitan makes a group per dimension of every mesh it unflattens (all ranks call for
            # every subgroup); gpc's whole launch makes at most one per mode and rank
            own = rec["backends"]["spmd_types"]["torchtitan_groups"]
            if rec["layout"][0] * rec["layout"][1] < 8:  # not one data axis over the whole world
                assert rec["launch_groups"]["calls"] < own["calls"], rec["layout"]


# --------------------------------------------------------------------------- pure
def test_default_order_fits_torchtitan() -> None:
    check_layout(plan(16, tensor=2, context=2, pipeline=2, replicate=2))
    check_layout(plan(8, tensor=2, replicate=2, expert=4, expert_tensor=1))


def test_layouts_torchtitan_cannot_describe_are_refused() -> None:
    with pytest.raises(TorchtitanError, match=r"order='tp-pp-dp' does not lay ranks out as torchtitan"):
        check_layout(plan(8, tensor=2, pipeline=2, order="tp-pp-dp"))
    with pytest.raises(TorchtitanError, match=r"expert.tensor=2: .* expert=dict\(size=2, tensor=1\)"):
        check_layout(plan(8, tensor=2, expert=2))
    with pytest.raises(TorchtitanError, match=r"put 'ep' before 'dp'"):
        check_layout(plan(8, tensor=1, expert=2, replicate=2, order="tp-cp-dp-ep-pp"))


def test_gtp_remat_is_refused_naming_it() -> None:
    # torchtitan's meshes have no gtp_remat axis; the order check alone passed gtp_remat=2 where
    # every other axis is 1 (a mesh of half the world), and blamed the default order elsewhere.
    for layout in (plan(2, gtp_remat=2), plan(4, tensor=2, gtp_remat=2), plan(8, tensor=2, gtp_remat=2)):
        with pytest.raises(TorchtitanError, match=r"gtp_remat=2: torchtitan"):
            check_layout(layout)
    with pytest.raises(TorchtitanError, match=r"expert.gtp_remat=2: torchtitan"):
        check_layout(plan(4, expert=2, expert_gtp_remat=2))


def test_missing_torchtitan_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from parallelctx import torchtitan

    monkeypatch.setitem(sys.modules, "torchtitan.distributed.parallel_dims", None)
    with pytest.raises(
        TorchtitanError,
        match=r"`pip install 'parallelctx\[torchtitan\]' && pip install --no-deps torchtitan==0.3.0`",
    ):
        torchtitan._parallel_dims_class()


# --------------------------------------------------------------------------- pooled ranks
STEPS, BATCH, LR = 3, 16, 0.1


def _tiny_decoder() -> Any:
    """A decoder as torchtitan's apply_fsdp_to_decoder walks it: layers, norm, lm_head."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.w2(torch.tanh(self.w1(x)))

    class Tiny(nn.Module):
        enable_weight_tying = False

        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = None
            self.layers = nn.ModuleDict({"0": Block(), "1": Block()})
            self.norm, self.lm_head = nn.LayerNorm(8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers.values():
                x = layer(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(0)
    return Tiny().double()


def _steps(model: Any, rank: int, size: int) -> tuple[list[float], dict[str, Any]]:
    """SGD on data rank ``rank`` of ``size`` (the whole batch when size is 1); torchtitan's FSDP
    sums gradients, so each rank's loss is its share of the global mean."""
    import torch

    gen = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(BATCH, 8, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, 4, generator=gen, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rows, losses = BATCH // size, []
    for x, y in data:
        mine = slice(rank * rows, (rank + 1) * rows)
        loss = ((model(x[mine]) - y[mine]) ** 2).sum() / y.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
        for k, v in model.state_dict().items()
    }
    return losses, full


@pytest.mark.slow  # 4 s: make test-slow
@pytest.mark.parallel(world_size=8, tensor=2, data=dict(replicate=2, shard=2), local=True)
def test_torchtitans_fsdp_apply_step_trains_like_serial_in_a_local_world() -> None:
    # the same training, every rank a thread of this process (parallelctx.run_local): FSDP2's
    # reduce-scatters and all-gathers and DTensor's redistributes on the local backend
    test_torchtitans_fsdp_apply_step_on_the_bridge_trains_like_serial()


@pytest.mark.parallel(world_size=8, tensor=2, data=dict(replicate=2, shard=2))
def test_torchtitans_fsdp_apply_step_on_the_bridge_trains_like_serial() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.distributed.parallel_dims import ParallelDims

    from parallelctx import ParallelMode, gpc
    from parallelctx.torchtitan import parallel_dims

    dims = parallel_dims(spmd_backend="partial_dtensor")
    assert isinstance(dims, ParallelDims)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.ep) == (2, 2, 2, 1)
    # expert-tensor size 2 (the default) with ep 1: efsdp is torchtitan's shape-only fake group
    assert (
        dist.get_backend(dims.get_optional_mesh("efsdp", include_singleton_axes=True).get_group()) == "fake"
    )
    assert dims.get_optional_mesh("efsdp") is None
    assert dims.get_mesh("tp").get_group() is gpc.get_group(ParallelMode.TENSOR)
    dp_mesh = dims.get_mesh(["dp_replicate", "fsdp"])  # what torchtitan's parallelize_llama passes
    assert dp_mesh["fsdp"].get_group() is gpc.get_group(ParallelMode.DATA_SHARD_CONTEXT)
    model = _tiny_decoder()
    for block in model.layers.values():
        parallelize_module(block, dims.get_mesh("tp"), {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    apply_fsdp_to_decoder(model, dp_mesh, torch.float64, torch.float64, pp_enabled=dims.pp_enabled)
    losses, weights = _steps(
        model, gpc.get_local_rank(ParallelMode.DATA), gpc.get_world_size(ParallelMode.DATA)
    )
    for loss in losses:
        dist.all_reduce(loss, group=gpc.get_group(ParallelMode.DATA))
    want_losses, want_weights = _steps(_tiny_decoder(), 0, 1)
    assert [x.item() for x in losses] == pytest.approx([x.item() for x in want_losses], rel=1e-12)
    for key, value in want_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-12, atol=1e-12)
