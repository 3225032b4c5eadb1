"""The gtp_remat axes (megatron-core 0.19's generalized tensor parallelism) in gpc's config, layout,
seeds and ``plan`` command; torch-free, no megatron-core needed. The layouts themselves are
compared with 0.19.2's RankGenerator in tests/test_megatron_gtp.py (``make test-megatron-next``)."""

from __future__ import annotations

import json

import pytest

from parallelctx import LayoutError, ParallelMode, plan
from parallelctx.cli import main
from parallelctx.config import load_config
from parallelctx.seed import mode_seed

M = ParallelMode


def test_config_keys_reach_the_layout() -> None:
    cfg = load_config({"parallel": {"tensor": 2, "gtp_remat": 2, "expert": {"size": 2, "gtp_remat": 2}}})
    layout = cfg.parallel.to_layout(16)
    assert (layout.gtp_remat, layout.expert_gtp_remat, layout.data, layout.expert_data) == (2, 2, 4, 2)
    assert layout.groups(M.GTP_REMAT)[0] == [0, 2]  # right after tp: stride 2
    assert layout.groups(M.EXPERT_GTP_REMAT)[0] == [0, 4]  # right after ep (stride tp*ep = 4)
    assert layout.groups(M.MODEL)[0] == [0, 1, 2, 3]  # tensor x gtp_remat x pipeline
    assert layout.groups(M.DATA)[0] == [0, 4, 8, 12]  # excludes gtp_remat
    with pytest.raises(ValueError, match="gtp_remat"):
        load_config({"parallel": {"gtp_remat": 0}})


def test_sizes_that_do_not_divide_are_refused_naming_gtp_remat() -> None:
    with pytest.raises(LayoutError, match=r"gtp_remat=4 = 16 does not divide world_size=8"):
        plan(8, tensor=2, pipeline=2, gtp_remat=4)
    with pytest.raises(LayoutError, match=r"expert_gtp_remat=4 = 16 does not divide world_size=8"):
        plan(8, expert=4, expert_gtp_remat=4)


def test_size_one_changes_no_group_and_hides_the_modes() -> None:
    a, b = plan(16, tensor=2, pipeline=2, expert=2), plan(16, tensor=2, pipeline=2, expert=2, gtp_remat=1)
    assert a.to_dict() == b.to_dict()
    assert M.GTP_REMAT not in a.shown_modes() and M.GTP_REMAT in plan(8, gtp_remat=2).shown_modes()
    assert all(len(g) == 1 for g in a.groups(M.GTP_REMAT))


def test_gtp_stream_differs_across_weight_shards_and_agrees_across_data() -> None:
    layout = plan(16, tensor=2, gtp_remat=2)
    seeds = {r: mode_seed(layout, r, M.GTP_REMAT, 7) for r in range(16)}
    for group in layout.groups(M.GTP_REMAT):
        assert len({seeds[r] for r in group}) == len(group)
    for group in layout.groups(M.DATA):
        assert len({seeds[r] for r in group}) == 1


def test_plan_command_takes_the_gtp_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--world-size", "16", "--tensor", "2", "--gtp-remat", "2", "--expert", "2"]
    assert main([*args, "--expert-gtp-remat", "2", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)
    assert groups["gtp_remat"][0] == [0, 2] and groups["expert_gtp_remat"][0] == [0, 4]


def test_an_order_not_in_lowercase_is_refused_with_gtp_remat() -> None:
    # megatron-core 0.19's _inject_gtp_remat_axis looks for 'tp' (dense) and 'ep' (expert) case-
    # sensitively: with "TP-CP-EP-DP-PP" it puts gtp_remat first (GTP groups [0, 1], ...), where
    # parallelctx, which reads the order in any case, put it after tp ([0, 2], ...): silently
    # other groups than Megatron's own init. Refused by name instead; size 1 changes no group.
    for kwargs in ({"gtp_remat": 2}, {"expert": 2, "expert_gtp_remat": 2}):
        with pytest.raises(LayoutError, match=r"order='TP-CP-EP-DP-PP'.*gtp_remat=2.*lowercase"):
            plan(8, tensor=2, order="TP-CP-EP-DP-PP", **kwargs)
    upper = plan(8, tensor=2, order="TP-CP-EP-DP-PP")
    assert upper.groups(M.TENSOR) == plan(8, tensor=2).groups(M.TENSOR)
    assert plan(8, tensor=2, gtp_remat=2, order="tp-cp-ep-dp-pp").groups(M.GTP_REMAT)[0] == [0, 2]


def test_the_picture_shows_every_rank_once_with_gtp_remat(capsys: pytest.CaptureFixture[str]) -> None:
    # The grid picture had a column per (cp, tp) only: with gtp_remat=2 it left out half the ranks.
    from parallelctx.cli.tables import layout_picture

    for layout in (plan(8, tensor=2, gtp_remat=2), plan(16, tensor=2, pipeline=2, gtp_remat=2, context=2)):
        picture = layout_picture(layout).plain
        cells = [
            int(c) for line in picture.splitlines() if line.startswith("  dp ") for c in line.split()[2:]
        ]
        assert sorted(cells) == list(range(layout.world_size)), picture
        assert "gtp_remat" in picture
    assert "columns = (cp, tp), rows = dp" in layout_picture(plan(8, tensor=2)).plain  # unchanged at 1
