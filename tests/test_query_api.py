"""The public queries of gpc explain themselves (help, signature) and take a mode by any name."""

from __future__ import annotations

import inspect
import pydoc
from typing import Any

import pytest
import torch
import torch.distributed as dist

from parallelctx import LayoutError, ParallelContext, ParallelMode, gpc
from parallelctx.layout import MODE_ALIASES


def _public_methods() -> list[str]:
    """Every public method of ParallelContext (properties and mode views aside)."""
    return sorted(
        name
        for name, value in vars(ParallelContext).items()
        if not name.startswith("_") and inspect.isfunction(value)
    )


def _check_documented(name: str) -> None:
    documented = getattr(ParallelContext, name)
    bound = getattr(gpc, name)
    doc = inspect.getdoc(bound)
    assert doc and doc == inspect.getdoc(documented), name
    first = doc.splitlines()[0]
    assert len(first) > 15, (name, first)
    params = list(inspect.signature(documented).parameters.values())[1:]  # without self
    assert inspect.signature(bound) == inspect.signature(documented).replace(parameters=params), name
    assert name in pydoc.render_doc(bound, renderer=pydoc.plaintext), name


def test_every_public_query_has_its_docstring_and_signature_before_launch() -> None:
    assert len(_public_methods()) >= 25
    for name in _public_methods():
        _check_documented(name)


def test_every_public_query_has_its_docstring_and_signature_after_launch(world_of_one: Any) -> None:
    world_of_one(None)
    for name in _public_methods():
        _check_documented(name)
    # The fast closures in particular: help() shows what the method documents.
    for name in ("get_local_rank", "get_world_size", "get_group", "get_cpu_group"):
        text = pydoc.render_doc(getattr(gpc, name), renderer=pydoc.plaintext)
        assert "Raises:" in text and "mode" in text, text
        assert getattr(gpc, name).__qualname__ == f"ParallelContext.{name}"


def test_parse_accepts_every_alias_in_any_case_and_lists_them_on_error() -> None:
    assert ParallelMode.parse("tp") is ParallelMode.TENSOR
    assert ParallelMode.parse("PP") is ParallelMode.PIPELINE
    assert ParallelMode.parse("Dp") is ParallelMode.DATA
    assert ParallelMode.parse("cp") is ParallelMode.CONTEXT
    assert ParallelMode.parse("EP") is ParallelMode.EXPERT
    assert ParallelMode.parse("TENSOR") is ParallelMode.TENSOR
    assert ParallelMode.parse("Data_Context") is ParallelMode.DATA_CONTEXT
    for alias, name in MODE_ALIASES.items():
        assert ParallelMode.parse(alias.upper()) is ParallelMode(name)
    with pytest.raises(LayoutError, match=r"unknown parallel mode 'tq'.*aliases: tp=tensor, pp=pipeline"):
        ParallelMode.parse("tq")
    with pytest.raises(LayoutError, match="unknown parallel mode 3"):
        ParallelMode.parse(3)  # type: ignore[arg-type]


def test_an_unknown_name_after_launch_names_the_aliases(world_of_one: Any) -> None:
    world_of_one(None)
    with pytest.raises(LayoutError, match="aliases: tp=tensor"):
        gpc.get_local_rank("tensr")
    with pytest.raises(LayoutError, match="aliases: tp=tensor"):
        gpc.get_ranks_in_group("tensr")


@pytest.mark.parallel(world_size=4, tensor=2, pipeline=2)
def test_model_code_can_name_modes_by_the_order_tokens() -> None:
    # What a user writes: the order string's tokens, in any case; answers and groups are the mode's.
    for alias, mode in [
        ("tp", ParallelMode.TENSOR),
        ("TP", ParallelMode.TENSOR),
        ("Tensor", ParallelMode.TENSOR),
        ("pp", ParallelMode.PIPELINE),
        ("DP", ParallelMode.DATA),
        ("cp", ParallelMode.CONTEXT),
    ]:
        assert gpc.get_local_rank(alias) == gpc.get_local_rank(mode)
        assert gpc.get_world_size(mode=alias) == gpc.get_world_size(mode)
        assert gpc.get_group(alias) is gpc.get_group(mode)
        assert gpc.get_cpu_group(alias) is gpc.get_cpu_group(mode)
        assert gpc.get_ranks_in_group(alias) == gpc.get_ranks_in_group(mode)
        assert gpc.is_first_rank(alias) == gpc.is_first_rank(mode)
        assert gpc.get_next_global_rank(alias) == gpc.get_next_global_rank(mode)
        assert gpc.is_initialized(alias)
    # The group found by its alias reduces over the tensor ranks: [0,1] and [2,3] here.
    t = torch.tensor([float(gpc.get_global_rank())])
    dist.all_reduce(t, group=gpc.get_group("tp"))
    rank = gpc.get_global_rank()
    assert t.item() == {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0}[rank]
    # The stream found by its alias is the mode's stream: the same draws.
    state = gpc.get_rng_state()
    with gpc.seed("tp"):
        by_alias = torch.rand(4)
    gpc.set_rng_state(state)
    with gpc.seed(ParallelMode.TENSOR):
        by_mode = torch.rand(4)
    assert torch.equal(by_alias, by_mode)
    assert gpc.get_seed("TP") == gpc.get_seed(ParallelMode.TENSOR)


@pytest.mark.parallel(world_size=4, tensor=2, pipeline=2)
def test_a_stream_named_by_any_spelling_continues_the_stream() -> None:
    # The active stream entered by a plain name continues: it must not replay earlier draws.
    streams = gpc.rng_streams
    first = torch.rand(4)  # the default (global) stream is active after launch
    for name in ("global", "GLOBAL", "world"):
        with streams.fork(name):
            again = torch.rand(4)
        assert not torch.equal(again, first), name
    # An alias's stream is the mode's stream, and differs from another mode's stream.
    state = gpc.get_rng_state()
    with gpc.seed("tp"):
        tp = torch.rand(8)
    gpc.set_rng_state(state)
    with gpc.seed("Data"):
        data = torch.rand(8)
    assert not torch.equal(tp, data)
    gpc.set_rng_state(state)
    with gpc.seed("REPLICA"):
        replica = torch.rand(8)
    gpc.set_rng_state(state)
    with gpc.seed("replica"):
        assert torch.equal(torch.rand(8), replica)
