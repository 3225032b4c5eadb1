"""The per-mode seed formula (pure), checked over whole worlds."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from parallelctx import LayoutError, ParallelMode, plan
from parallelctx.limits import MAX_WORLD_SIZE
from parallelctx.seed import STREAM_AXES, STREAMS, mode_seed


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tensor=2, pipeline=3, context=2, expert=2, expert_tensor=1, order="tp-cp-ep-dp-pp"),
        dict(tensor=2, pipeline=3, order="tp-pp-dp"),
    ],
)
def test_formula_properties_over_a_world(kwargs: dict) -> None:
    layout = plan(48, **kwargs)
    base = 1234
    seeds = {r: {m: mode_seed(layout, r, m, base) for m in ParallelMode} for r in range(48)}
    for r, per_mode in seeds.items():
        assert len(set(per_mode.values())) == len(ParallelMode), "modes never share a seed on a rank"
        assert per_mode[ParallelMode.GLOBAL] == base + layout.coords(r)["pp"]
    for group in layout.groups("tensor"):
        assert len({seeds[r][ParallelMode.GLOBAL] for r in group}) == 1
        assert len({seeds[r][ParallelMode.TENSOR] for r in group}) == len(group)
    for group in layout.groups("data"):
        assert len({seeds[r][ParallelMode.TENSOR] for r in group}) == 1
        assert len({seeds[r][ParallelMode.DATA] for r in group}) == 1
    for group in layout.groups("context"):
        assert len({seeds[r][ParallelMode.CONTEXT] for r in group}) == len(group)
        assert len({seeds[r][ParallelMode.TENSOR] for r in group}) == 1
    for group in layout.groups("pipeline"):
        assert len({seeds[r][ParallelMode.DATA] for r in group}) == len(group)
    for group in layout.groups("expert_data"):
        assert len({seeds[r][ParallelMode.EXPERT] for r in group}) == 1
    for group in layout.groups("expert"):
        assert len({seeds[r][ParallelMode.EXPERT] for r in group}) == len(group)


def test_formula_is_independent_of_data_parallel_size() -> None:
    small, large = plan(8, tensor=2, pipeline=2), plan(32, tensor=2, pipeline=2)
    for mode, (tp, pp) in itertools.product(ParallelMode, [(0, 0), (1, 1)]):
        r_small = pp * 4 + tp  # coordinates (tp, dp=0, pp) in each world
        r_large = pp * 16 + tp
        assert mode_seed(small, r_small, mode, 7) == mode_seed(large, r_large, mode, 7)


def test_documented_example() -> None:
    layout = plan(8, tensor=2, pipeline=2)
    # rank 5: tp=1, dp=0, pp=1 -> TENSOR index = pp*T + tp = 3, slot(TENSOR) = 1
    assert mode_seed(layout, 5, "tensor", 1024) == 1024 + 2**24 + 3
    assert mode_seed(layout, 5, "global", 1024) == 1025
    # the sum wraps around 2**32, so a seed always fits the CPU generator's 32 bits
    assert (
        mode_seed(layout, 5, "replica", 2**32 - 1) == (2**32 - 1 + 64 * 2**24 + 2) % 2**32
    )  # index pp*D + dp = 2


@pytest.mark.parametrize("base", [0, 1234, 2**32 - 1])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(world=48, tensor=2, pipeline=3, context=2, expert=2, expert_tensor=1, order="tp-cp-ep-dp-pp"),
        dict(world=16, tensor=2, pipeline=2, expert=2),
        dict(world=MAX_WORLD_SIZE, tensor=8, pipeline=16),
    ],
)
def test_seeds_fit_32_bits_and_two_share_one_only_for_the_same_stream_coordinates(
    base: int, kwargs: dict
) -> None:
    # the CPU generator keeps only the low 32 bits of a seed: distinct seeds must stay distinct there
    world = kwargs["world"]
    layout = plan(world, **{k: v for k, v in kwargs.items() if k != "world"})
    ranks = range(world) if world <= 64 else [0, 1, world // 2, world - 2, world - 1]
    owner: dict[int, tuple[str, tuple[int, ...]]] = {}
    for rank in ranks:
        coords = layout.coords(rank)
        for stream in STREAMS:
            seed = mode_seed(layout, rank, stream, base)
            assert 0 <= seed < 2**32
            key = (str(stream), tuple(coords[a] for a in STREAM_AXES[stream]))
            assert owner.setdefault(seed, key) == key, f"{key} and {owner[seed]} share seed {seed}"


def test_seed_table_in_the_docs_is_the_formulas() -> None:
    # docs/seeds.md shows every stream's seed on a 4-rank world; regenerate it from the formula
    text = (Path(__file__).resolve().parent.parent / "docs" / "seeds.md").read_text()
    marker = "<!-- seed-table: world=4 tensor=2 pipeline=2 base=1024 -->\n"
    shown = text.split(marker, 1)[1].split("\n\n", 1)[0].strip()
    layout = plan(4, tensor=2, pipeline=2)
    where = [layout.coords(r) for r in range(4)]
    rows = [
        "| stream | "
        + " | ".join(f"rank {r} (tp {c['tp']}, pp {c['pp']})" for r, c in enumerate(where))
        + " |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {s} | " + " | ".join(str(mode_seed(layout, r, s, 1024)) for r in range(4)) + " |"
            for s in STREAMS
        ),
    ]
    assert shown == "\n".join(rows), "paste this table into docs/seeds.md:\n" + "\n".join(rows)


def test_seeding_without_cuda_queues_no_deferred_cuda_seed_and_draws_the_same() -> None:
    """On a build or machine without CUDA, seeding the streams records no deferred CUDA seed
    (each one costs a stack trace) and the draws are torch.manual_seed's (issue 26)."""
    import torch

    from parallelctx.seed import RNGStreams

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: seeding it is torch.manual_seed's, unchanged")
    seeds = {ParallelMode.GLOBAL: 11, ParallelMode.TENSOR: 12, ParallelMode.DATA: 13}
    before = (len(torch.cuda._queued_calls), torch.cuda._lazy_seed_tracker.get_calls())
    streams = RNGStreams(seeds, cuda=False)
    assert (len(torch.cuda._queued_calls), torch.cuda._lazy_seed_tracker.get_calls()) == before
    got = {}
    for mode in seeds:
        with streams.fork(mode):
            got[mode] = torch.rand(4)
    for mode, seed in seeds.items():
        torch.manual_seed(seed)
        assert torch.equal(got[mode], torch.rand(4)), mode


def test_an_unknown_stream_is_named_before_a_rank_outside_the_layout() -> None:
    # mode_seed checks the stream before the rank (seed_at, which reads the coordinates once for
    # every stream of make_streams, must not change which mistake the message names)
    layout = plan(world_size=4, tensor=2)
    with pytest.raises(LayoutError, match="unknown parallel mode 'bogus'"):
        mode_seed(layout, 99, "bogus", 1)
    with pytest.raises(LayoutError, match="rank=99"):
        mode_seed(layout, 99, "tensor", 1)
