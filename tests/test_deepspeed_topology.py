"""parallelctx.deepspeed.pipe_axes / check_pipe_topology: DeepSpeed's PipelineModule topology
from gpc's layout, without processes and without DeepSpeed (its ``ProcessTopology`` places rank
``r`` at ``numpy.unravel_index(r, dims)`` over ``axes``, slowest first; the mirror below is that
rule, checked against DeepSpeed's own class in tests/test_engine_deepspeed.py, process-free too).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from parallelctx import ParallelMode
from parallelctx.deepspeed import PipeTopologyError, check_pipe_engine, check_pipe_topology, pipe_axes
from parallelctx.planning.layout import Layout


class Topology:
    """DeepSpeed's ProcessTopology rule, for the checks (axes slowest first, row-major)."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        self.axes, self.dims = axes, dims

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)]

    def coord(self, rank: int, axis: str) -> int:
        if axis not in self.axes:
            return 0
        return int(np.unravel_index(rank, self.dims)[self.axes.index(axis)])


class FakeContext:
    """What check_pipe_topology reads from gpc: a launched layout."""

    def __init__(self, layout: Layout) -> None:
        self.launched = SimpleNamespace(layout=layout)

    def is_initialized(self, mode: ParallelMode) -> bool:
        return True

    def get_world_size(self, mode: ParallelMode) -> int:
        return self.launched.layout.world_size


ORDERS = ["-".join(p) for p in itertools.permutations(["tp", "pp", "dp"])] + ["tp-cp-ep-dp-pp"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("sizes", [(2, 2, 2), (2, 4, 1), (1, 2, 4), (4, 2, 2)], ids=str)
def test_the_topology_places_every_rank_at_gpcs_pipeline_data_and_tensor_ranks(
    order: str, sizes: tuple[int, int, int]
) -> None:
    tensor, pipeline, data = sizes
    layout = Layout(tensor * pipeline * data, tensor=tensor, pipeline=pipeline, order=order)
    axes, dims = pipe_axes(layout)
    topo = Topology(axes, dims)
    assert sorted(axes) == ["data", "model", "pipe"] and int(np.prod(dims)) == layout.world_size
    for rank in range(layout.world_size):
        assert topo.coord(rank, "pipe") == layout.local_rank(ParallelMode.PIPELINE, rank)
        assert topo.coord(rank, "data") == layout.local_rank(ParallelMode.DATA, rank)
        assert topo.coord(rank, "model") == layout.local_rank(ParallelMode.TENSOR, rank)
    check_pipe_topology(topo, None, FakeContext(layout))  # its own topology passes


def test_tp_pp_dp_reverses_the_order_string() -> None:
    assert pipe_axes(Layout(8, tensor=2, pipeline=2, order="tp-pp-dp")) == (
        ["data", "pipe", "model"],
        [2, 2, 2],
    )


def test_deepspeeds_default_is_refused_where_it_differs_and_passes_where_it_agrees() -> None:
    # DeepSpeed's default: axes [pipe, data], data fastest; gpc's "pp-dp" has the pipeline fastest
    with pytest.raises(
        PipeTopologyError,
        match=r"DeepSpeed's default for num_stages=2 .* puts rank 1 at pipe rank 0, but gpc's layout .* has it at pipeline rank 1.*topology=parallelctx.deepspeed.pipe_topology\(\)",
    ):
        check_pipe_topology(None, 2, FakeContext(Layout(8, pipeline=2, order="pp-dp")))
    check_pipe_topology(None, 2, FakeContext(Layout(8, pipeline=2, order="dp-pp")))  # the same places
    with pytest.raises(PipeTopologyError, match=r"puts rank 1 at data rank 1, but .* has it at data rank 0"):
        check_pipe_topology(None, 2, FakeContext(Layout(8, tensor=2, pipeline=2, order="tp-dp-pp")))


def test_a_topology_of_another_order_is_refused_naming_the_rank() -> None:
    layout = Layout(8, tensor=2, pipeline=2, order="tp-pp-dp")
    megatron_like = Topology(
        ["pipe", "data", "model"], [2, 2, 2]
    )  # DeepSpeed's PipeModelDataParallelTopology
    with pytest.raises(
        PipeTopologyError,
        match=r"the topology given \(axes \['pipe', 'data', 'model'\].*rank 2 at pipe rank 0",
    ):
        check_pipe_topology(megatron_like, None, FakeContext(layout))


def test_axes_deepspeeds_pipeline_has_not_are_refused() -> None:
    with pytest.raises(PipeTopologyError, match=r"context=2 has no place"):
        pipe_axes(Layout(8, context=2, pipeline=2))


def test_check_pipe_engine_takes_a_pipeline_engine_only() -> None:
    # DeepSpeed's pipeline module not imported here: nothing can be a PipelineEngine
    with pytest.raises(TypeError, match=r"check_pipe_engine\(object\): it checks the PipelineEngine"):
        check_pipe_engine(object(), FakeContext(Layout(8, pipeline=2)))
