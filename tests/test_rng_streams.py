"""Every RNG stream draws its own numbers, checked by draws on real ranks over several layouts.

On one rank no two streams may draw the same numbers (a replicated weight drawn on GLOBAL and a
dropout mask drawn on DATA must not be the same random numbers); across ranks, two ranks draw
the same numbers on a stream exactly when they share that stream's coordinates
(``parallelctx.seed.STREAM_AXES``: the rule behind the table of docs/seeds.md), and two different
streams never draw the same numbers, on any ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from rng_cases import stream_draws, streams_alike

from parallelctx import gpc
from parallelctx.seed import STREAM_AXES, STREAMS

LAYOUTS = [
    dict(world_size=4, tensor=2, pipeline=2),
    dict(world_size=8, tensor=2, pipeline=2, expert=2),
    dict(world_size=8, tensor=2, context=2),
    dict(world_size=8, tensor=2, pipeline=2, order="tp-pp-dp"),
    dict(world_size=8, tensor=1, pipeline=4),
]


@pytest.mark.parallel(layouts=LAYOUTS)
def test_no_two_streams_of_a_rank_draw_the_same_numbers() -> None:
    draws = stream_draws(8)
    assert streams_alike(draws) == [], f"rank {gpc.get_global_rank()}: these streams drew the same 8 numbers"


@pytest.mark.parallel(layouts=LAYOUTS)
def test_ranks_share_a_streams_draws_exactly_when_they_share_its_coordinates() -> None:
    world = gpc.get_world_size("global")
    every: list[Any] = [None] * world
    dist.all_gather_object(every, stream_draws(8))
    coords = [gpc.layout.coords(r) for r in range(world)]
    items = [(r, key) for r in range(world) for key in STREAMS]
    wrong = []
    for i, (r, a) in enumerate(items):
        for s, b in items[i + 1 :]:
            drew_same = every[r][str(a)] == every[s][str(b)]
            expected = a == b and all(coords[r][axis] == coords[s][axis] for axis in STREAM_AXES[a])
            if drew_same != expected:
                wrong.append(f"rank {r} {a} vs rank {s} {b}: {'same' if drew_same else 'different'} draws")
    assert wrong == [], f"{len(wrong)} pairs break the rule, e.g. {wrong[:5]}"


@pytest.mark.parallel(world_size=4, tensor=2, pipeline=2)
def test_a_replicated_weight_and_a_dropout_mask_are_not_the_same_numbers() -> None:
    # the user's view of the bug: two draws model code makes on two streams of one rank
    weight = torch.empty(64).uniform_(-1, 1)  # replicated weight: default (GLOBAL) stream
    with gpc.seed("data"):
        noise = torch.empty(64).uniform_(-1, 1)  # per-stage noise on the DATA stream
    with gpc.seed("tensor"):
        shard = torch.empty(64).uniform_(-1, 1)  # a tensor-parallel shard
    assert not torch.equal(weight, noise)
    assert not torch.equal(weight, shard)
    assert not torch.equal(noise, shard)
