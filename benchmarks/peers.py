"""The three libraries under test, behind one small interface.

Each ``setup_*`` function builds the tensor x pipeline (x data) layout on top of an existing
default process group and returns a :class:`Built`: the process groups this rank belongs to
(to run a first collective in each), the query statements to time, and a teardown that
destroys the groups it made so the next library starts from the same state.

Megatron-core and DeviceMesh are imported lazily, so parallelctx alone needs neither.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

LIBS: tuple[str, ...] = ("parallelctx", "megatron", "devicemesh")
"""Library names, in the order of the table."""


@dataclass
class Query:
    """One timed query: ``stmt`` evaluated with ``env`` as globals (see :mod:`timeit`)."""

    name: str
    stmt: str
    env: dict[str, Any]


@dataclass
class Built:
    """What one library made on this rank."""

    groups: list[Any]
    queries: list[Query]
    teardown: Callable[[], None]
    calls: int = 0
    member_groups: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def count_new_groups() -> Iterator[list[int]]:
    """Count the process groups this rank asks torch to make while the block runs.

    Yields a one-element list ``[calls]``, filled when the block exits. Every public way to make
    a group (``new_group``, ``new_subgroups*``, DeviceMesh) goes through
    ``distributed_c10d._new_group_with_tag``; ``split_group`` is counted too.
    """
    counter = [0]
    wrapped = {name: getattr(c10d, name) for name in ("_new_group_with_tag", "split_group")}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in wrapped.items():
        setattr(c10d, name, wrap(fn))
    try:
        yield counter
    finally:
        for name, fn in wrapped.items():
            setattr(c10d, name, fn)


_SPACERS: list[Any] = []


def keep_spacer() -> None:
    """Keep one more one-rank group alive, so that torch's count of held groups (which names a
    locally synchronized group) moves on. The spacer is a ``"fake"`` group: no collective ever
    runs on it, and unlike a gloo group it starts no threads (a live gloo group's event loop wakes
    100 times a second, so gloo spacers piling up round after round would load the machine, and
    more so in a job whose teardown keeps more of them)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    _SPACERS.append(dist.new_group([dist.get_rank()], backend="fake", use_local_synchronization=True))


def _held_everywhere() -> int:
    """The most process groups any rank holds now (ranks off the embedding group hold fewer)."""
    import torch

    held = torch.tensor([len(c10d._world.pg_names)])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return int(held.item())


def _fresh_names(held: int) -> None:
    """Keep one-rank groups until every rank holds more groups than ``held`` (the same count on
    every rank): torch names a locally synchronized group by its members and how many groups the
    process holds, so the next round's groups cannot take the names (and stale store keys) of
    groups destroyed in this one, and the members of a group agree on its name."""
    while len(c10d._world.pg_names) <= held:
        keep_spacer()


def _distinct_groups(groups: list[Any]) -> list[Any]:
    """Drop None, the default group and repeats; keep the first-seen order."""
    seen: set[int] = set()
    out = []
    for g in groups:
        if g is None or g is dist.group.WORLD or g is c10d.GroupMember.NON_GROUP_MEMBER:
            continue
        if id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def _destroy(groups: list[Any]) -> None:
    for g in _distinct_groups(groups):
        dist.destroy_process_group(g)


def setup_parallelctx(tensor: int, pipeline: int) -> Built:
    """Launch ``gpc`` on the existing default group (config, adopt, create groups)."""
    from parallelctx import ParallelMode, gpc

    gpc.load_config({"parallel": {"tensor": tensor, "pipeline": pipeline}})
    gpc.init_global_dist(dist.get_rank(), dist.get_world_size())
    gpc.init_parallel_groups()
    groups = _distinct_groups([gpc.get_group(m) for m in ParallelMode if gpc.is_initialized(m)])
    tensor_mode = ParallelMode.TENSOR
    queries = [
        Query("get_local_rank(mode)", "f(m)", {"f": gpc.get_local_rank, "m": tensor_mode}),
        Query("get_world_size(mode)", "f(m)", {"f": gpc.get_world_size, "m": tensor_mode}),
        Query("get_group(mode)", "f(m)", {"f": gpc.get_group, "m": tensor_mode}),
        Query("gpc.tensor.rank", "g.tensor.rank", {"g": gpc}),
        Query(
            "get_local_rank(ParallelMode.TENSOR)",
            "gpc.get_local_rank(ParallelMode.TENSOR)",
            {"gpc": gpc, "ParallelMode": ParallelMode},
        ),
        Query(
            "get_local_rank(mode=ParallelMode.TENSOR)",
            "gpc.get_local_rank(mode=ParallelMode.TENSOR)",
            {"gpc": gpc, "ParallelMode": ParallelMode},
        ),
        Query("get_local_rank('tensor')", "gpc.get_local_rank('tensor')", {"gpc": gpc}),
    ]

    def teardown() -> None:
        gpc.destroy()
        # torch names a locally synchronized group by its members and the number of groups the
        # process holds; re-creating the same groups on this default group after a destroy
        # would reuse the names (parallelctx refuses). One singleton group per rank, kept alive,
        # shifts that number so the next round gets fresh names.
        keep_spacer()

    return Built(groups, queries, teardown, calls=gpc.group_creations, member_groups=len(groups))


def setup_megatron(tensor: int, pipeline: int) -> Built:
    """Megatron-core's ``initialize_model_parallel`` on the existing default group.

    ``create_gloo_process_groups=False``: with gloo as the main backend its extra gloo data
    groups would duplicate the main ones, so leaving them out is the setting kindest to Megatron.
    """
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        create_gloo_process_groups=False,
    )
    groups = _distinct_groups(list(ps._global_process_group_list or []))

    def teardown() -> None:
        _destroy(groups)
        ps.destroy_model_parallel()

    queries = [
        Query("get_tensor_model_parallel_rank()", "f()", {"f": ps.get_tensor_model_parallel_rank}),
        Query(
            "get_tensor_model_parallel_world_size()",
            "f()",
            {"f": ps.get_tensor_model_parallel_world_size},
        ),
        Query("get_tensor_model_parallel_group()", "f()", {"f": ps.get_tensor_model_parallel_group}),
    ]
    return Built(groups, queries, teardown, member_groups=len(groups))


def setup_devicemesh(tensor: int, pipeline: int) -> Built:
    """``init_device_mesh("cpu", (pp, dp, tp))`` with dims named ``pp``, ``dp``, ``tp``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    data = world // (tensor * pipeline)
    mesh = init_device_mesh("cpu", (pipeline, data, tensor), mesh_dim_names=("pp", "dp", "tp"))
    groups = _distinct_groups(mesh.get_all_groups())
    queries = [
        Query('mesh.get_local_rank("tp")', 'm.get_local_rank("tp")', {"m": mesh}),
        Query("mesh.size(2)  # tp dim", "m.size(2)", {"m": mesh}),
        Query('mesh.get_group("tp")', 'm.get_group("tp")', {"m": mesh}),
    ]
    return Built(groups, queries, lambda: _destroy(groups), member_groups=len(groups))


def setup_bridge(tensor: int, pipeline: int) -> Built:
    """parallelctx launched on the existing default group (config, adopt, groups, host count,
    device, seeds: what ``launch`` does) and ``parallelctx.megatron.install()``, so that
    Megatron-core's ``parallel_state`` is ready; the groups are those parallel_state holds."""
    from megatron.core import parallel_state as ps

    import parallelctx.megatron as bridge
    from parallelctx import gpc

    gpc.load_config({"parallel": {"tensor": tensor, "pipeline": pipeline}})
    gpc.init_global_dist(dist.get_rank(), dist.get_world_size())
    gpc.init_parallel_groups()
    gpc.detect_num_processes_on_current_node()
    gpc.set_device()
    gpc.set_seed()
    calls = gpc.group_creations + bridge.install()
    groups = _distinct_groups(
        [
            getattr(ps, name)
            for name in sorted(bridge.release.detect().globals)
            if isinstance(getattr(ps, name), dist.ProcessGroup)
        ]
    )
    queries = [Query("get_tensor_model_parallel_rank()", "f()", {"f": ps.get_tensor_model_parallel_rank})]

    def teardown() -> None:
        gpc.destroy()  # uninstalls too
        keep_spacer()

    return Built(groups, queries, teardown, calls=calls, member_groups=len(groups))


def setup_bridge_pgc(tensor: int, pipeline: int) -> Built:
    """``parallelctx.launch_from_torch(config)`` on the existing default group (the user's path:
    the launch rendezvous with its agreement check and host names, the groups, device, seeds),
    then ``parallelctx.megatron.process_groups()``: the ``ProcessGroupCollection`` Megatron-core
    models take as ``pg_collection=``, with ``parallel_state`` left alone."""
    import dataclasses

    import parallelctx
    import parallelctx.megatron as bridge
    from parallelctx import gpc

    parallelctx.launch_from_torch({"parallel": {"tensor": tensor, "pipeline": pipeline}})
    before = len(dist.distributed_c10d._world.pg_names)
    pgc = bridge.process_groups()
    calls = gpc.group_creations + len(dist.distributed_c10d._world.pg_names) - before
    fields = [getattr(pgc, f.name, None) for f in dataclasses.fields(pgc)]
    groups = _distinct_groups([g for g in fields if isinstance(g, dist.ProcessGroup)])
    queries = [Query("pgc.tp.rank()", "p.tp.rank()", {"p": pgc})]

    def teardown() -> None:
        gpc.destroy()  # destroys the groups process_groups() made too
        keep_spacer()

    return Built(groups, queries, teardown, calls=calls, member_groups=len(groups))


def setup_torch_groups(tensor: int, pipeline: int) -> Built:
    """torch alone making the groups ``launch + process_groups()`` makes on this rank (tensor 2,
    context 1, expert 1: this rank alone, tensor, pipeline, data, model, embedding, and Megatron's
    tensor x data group), locally synchronized, with no config, rendezvous, seeds or abort
    bookkeeping: the floor for any library that makes these groups through torch. Run it in a
    job without parallelctx (``--libs megatron,torch_groups``): its teardown keeps one-rank
    groups alive to keep names fresh, and those would add sockets to every later round."""
    from parallelctx import ParallelMode
    from parallelctx.config import ParallelConfig

    rank = dist.get_rank()
    parallel = ParallelConfig.model_validate({"tensor": tensor, "pipeline": pipeline})
    layout = parallel.to_layout(dist.get_world_size())
    rows = [[rank]]
    for mode in (
        ParallelMode.TENSOR,
        ParallelMode.PIPELINE,
        ParallelMode.DATA,
        ParallelMode.MODEL,
    ):
        rows.append(list(layout.group_of(mode, rank)))
    data = layout.group_of(ParallelMode.DATA, rank)
    rows.append(sorted({r for d in data for r in layout.group_of(ParallelMode.TENSOR, d)}))
    # last, as gpc makes it: middle pipeline stages are in no embedding group, and every member
    # of a group must hold as many groups as the others when it is made
    embedding = list(layout.group_of(ParallelMode.EMBEDDING, rank))
    if embedding:
        rows.append(embedding)
    groups = [dist.new_group(row, use_local_synchronization=True) for row in rows]

    def teardown() -> None:
        held = _held_everywhere()
        _destroy(groups)
        _fresh_names(held)

    return Built(groups, [], teardown, calls=len(rows), member_groups=len(groups))


SETUP: dict[str, Callable[[int, int], Built]] = {
    "parallelctx": setup_parallelctx,
    "megatron": setup_megatron,
    "devicemesh": setup_devicemesh,
    "bridge": setup_bridge,  # parallelctx + parallelctx.megatron.install(): benchmarks/megatron_bridge.py
    "bridge_pgc": setup_bridge_pgc,  # parallelctx + process_groups(): megatron_bridge.py --route process_groups
    "torch_groups": setup_torch_groups,  # the floor beside bridge_pgc
}
