"""The worker of tests/test_megatron_modules.py, run under torchrun on 8 ranks (gloo):
``torchrun --standalone --nproc-per-node 8 tests/megatron_modules_worker.py OUT TOPOLOGY CASE...``.

For each case (a ``parallel.modules`` layout), in the same processes: gpc is launched;
``parallelctx.megatron.multi_module_process_groups()``, ``hyper_comm_grids()`` and
``manual_seed_ranks()`` answer, every group proven by a one-hot all-reduce; in the ``bridge``
case a vision model's output goes through Megatron's ``BridgeCommunicator`` on gpc's grids to a
3-stage tensor-parallel language model and back, under ``forbid_globals()``; then Megatron builds
the same layout, by two references recorded side by side: ``"wheel"`` (always), the example's
topology made from the megatron-core wheel's own ``HyperCommGrid``, ``create_pg`` and
``parallel_state.default_embedding_ranks`` / ``default_position_embedding_ranks``
(:func:`wheel_reference`, the example's facts restated in :data:`MIMO_GRID_FIELDS`), and
``"create_topology"`` (where ``TOPOLOGY`` is a file, not ``-``), the example's own
``create_topology`` (``examples/mimo/training/topology.py``) on its ``ModuleGridSpec``\\ s. Each
field, grid and role is recorded by ``torch.distributed.get_process_group_ranks``; then all are
destroyed. The ``ctx_*`` cases compare ``process_groups(gpc.module(name))`` with Megatron's own
init or ``RankGenerator`` (any release); ``adopted`` checks that ``gpc.destroy()`` destroys the
bridge's groups, ``abort`` (the last: the processes exit after it) that ``gpc.abort()`` ends a
collective hung on one. Every rank writes ``OUT/<case>-rank<r>.json``.

Megatron's topology and bridge communicator ask for NCCL (``backend="nccl"`` groups,
``torch.cuda.current_device()`` buffers): :func:`cpu_megatron` maps that backend to the default
group's (gloo) and the device to the CPU while they run. The gpc side makes all its groups
before Megatron's, which every rank makes (torch names locally synchronized groups by how many
groups a process holds).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import parallelctx
import parallelctx.megatron as bridge
from parallelctx import LayoutError, gpc

warnings.simplefilter("ignore")

from megatron.core import ModelParallelConfig, tensor_parallel  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.hyper_comm_grid import HyperCommGrid  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from parallelctx.megatron import release as _release  # noqa: E402

RELEASE = _release.detect()
NEXT = hasattr(HyperCommGrid, "register_view")  # 0.19 on: Megatron's MIMO grids

# Every field create_topology sets (and the gtp ones, which it never sets), compared by members.
FIELDS = (*bridge.MIMO_FIELDS, "tp_dp", "embd", "pos_embd", "tp_ep_pp_with_egtp_remat", "dp_cp_gtp_remat")
FIELDS += (
    "gtp_remat",
    "expt_gtp_remat",
    "expt_dp_gtp_remat",
    "hcp",
    "inter_dist_opt",
    "dp_cp_ag",
    "expt_dp_ag",
)

# Megatron's MIMO example (examples/mimo/training/topology.py at core_v0.19.0), restated as facts
# for the wheel-only reference below: each ProcessGroupCollection field it sets from a module's
# HyperCommGrid, as (view, dims) of that grid (view None: the base view tp, cp, dp, pp, tp
# fastest; "expert": expt_tp, ep, expt_dp, pp, sharing pp). The grid creates a group for each
# distinct (view, dims) here and no other; embd and pos_embd (language module only) come from
# parallel_state's default_embedding_ranks / default_position_embedding_ranks of each pp row.
EXPERT_VIEW = "expert"
MIMO_GRID_FIELDS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "tp": (None, ("tp",)),
    "cp": (None, ("cp",)),
    "pp": (None, ("pp",)),
    "dp": (None, ("dp",)),
    "dp_cp": (None, ("dp", "cp")),
    "intra_dp_cp": (None, ("dp", "cp")),  # the same group as dp_cp
    "tp_cp": (None, ("tp", "cp")),
    "tp_dp": (None, ("tp", "dp")),
    "tp_dp_cp": (None, ("tp", "dp", "cp")),
    "mp": (None, ("tp", "pp")),
    "intra_dist_opt": (None, ("tp", "cp", "dp", "pp")),  # the module's every rank
    "ep": (EXPERT_VIEW, ("ep",)),
    "expt_tp": (EXPERT_VIEW, ("expt_tp",)),
    "expt_dp": (EXPERT_VIEW, ("expt_dp",)),
    "intra_expt_dp": (EXPERT_VIEW, ("expt_dp",)),  # the same group as expt_dp
    "tp_ep": (EXPERT_VIEW, ("expt_tp", "ep")),
    "tp_ep_pp": (EXPERT_VIEW, ("expt_tp", "ep", "pp")),
}
GRID_GROUPS: tuple[tuple[str | None, tuple[str, ...]], ...] = tuple(dict.fromkeys(MIMO_GRID_FIELDS.values()))
"""The groups each reference grid creates (and each grid's facts read): 10 dense, 5 expert."""

# name -> (gpc's parallel.modules, create_topology's specs (name, num_ranks, sizes)). ModuleGridSpec's
# expt_tp defaults to 1 and gpc's expert tensor size to the tensor size: the specs say expt_tp.
CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
    "colocated": (
        dict(
            vision=dict(ranks=8, tensor=2),
            language=dict(colocated_with="vision", tensor=2, pipeline=2),
        ),
        [
            dict(name="vision", num_ranks=8, tp=2, expt_tp=2),
            dict(name="language", num_ranks=8, tp=2, pp=2, expt_tp=2),
        ],
    ),
    "bridge": (  # disjoint: vision on ranks 0-1, language on 2-7
        dict(vision=dict(ranks=2), language=dict(ranks=6, tensor=2, pipeline=3)),
        [
            dict(name="vision", num_ranks=2),
            dict(name="language", num_ranks=6, tp=2, pp=3, expt_tp=2, rank_offset=2),
        ],
    ),
    "experts": (  # three disjoint modules, experts in the language module
        dict(
            vision=dict(ranks=2),
            audio=dict(ranks=2, tensor=2),
            language=dict(ranks=4, tensor=2, expert=dict(size=2, tensor=1)),
        ),
        [
            dict(name="vision", num_ranks=2),
            dict(name="audio", num_ranks=2, tp=2, expt_tp=2, rank_offset=2),
            dict(name="language", num_ranks=4, tp=2, ep=2, expt_tp=1, rank_offset=4),
        ],
    ),
    "gtp": (  # language at gtp_remat 2: create_topology has no gtp dim; its dp spans gtp x dp
        dict(vision=dict(ranks=4, tensor=2), language=dict(ranks=4, gtp_remat=2)),
        [
            dict(name="vision", num_ranks=4, tp=2, expt_tp=2),
            dict(name="language", num_ranks=4, rank_offset=4),
        ],
    ),
}


def members(group: Any) -> list[int] | None:
    """A group's members by torch (None for None, a list of lists for a list of groups)."""
    if group is None:
        return None
    if isinstance(group, list):
        return [dist.get_process_group_ranks(g) for g in group]  # type: ignore[misc]
    return dist.get_process_group_ranks(group)


def onehot(group: Any) -> list[int]:
    """The members of ``group`` by a real collective: all-reduce of this rank's one-hot row."""
    row = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    row[dist.get_rank()] = 1
    dist.all_reduce(row, group=group)
    return [r for r, v in enumerate(row.tolist()) if v]


@contextlib.contextmanager
def cpu_megatron(calls: list[int]) -> Iterator[None]:
    """Run Megatron's topology and bridge communicator on the CPU: ``new_group(backend="nccl")``
    takes the default group's backend, ``torch.cuda.current_device()`` is the CPU; counts the
    ``new_group`` calls in ``calls[0]``. The least patching they need here (both ask for NCCL)."""
    c10d = dist.distributed_c10d
    original, current = c10d.new_group, torch.cuda.current_device

    def new_group(*args: Any, backend: Any = None, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, backend=None if backend == "nccl" else backend, **kwargs)

    c10d.new_group = dist.new_group = new_group  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # Megatron's groups connect on first use
    try:
        yield
    finally:
        c10d.new_group = dist.new_group = original  # type: ignore[assignment]
        torch.cuda.current_device = current  # type: ignore[assignment]
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)


def load_topology(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("mimo_topology", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def grid_facts(grid: Any) -> dict[str, Any]:
    """What Megatron reads of a grid, and every GRID_GROUPS group's members by torch (a grid
    lacking one raises KeyError)."""
    out: dict[str, Any] = {
        "shape": list(grid.shape),
        "dim_names": list(grid.dim_names),
        "rank_offset": grid.rank_offset,
        "size": grid.size,
        "in_grid": grid.is_current_rank_in_grid(),
        "enum": {},
        "pgs": {},
    }
    for view, dims in GRID_GROUPS:
        name = f"{view or 'base'}:{'-'.join(dims)}"
        out["enum"][name] = grid.get_rank_enum(list(dims), view=view)
        out["pgs"][name] = members(grid.get_pg(list(dims), view=view))
    out["replica_enum"] = grid._gen_rank_enum([d for d in grid.dim_names if d != "dp"])
    return out


def role_facts(role: Any) -> dict[str, Any]:
    return {
        "mode": role.mode.value,
        "modules": {n: [i.is_first_stage, i.is_last_stage] for n, i in role.modules.items()},
    }


def collection_facts(multi: Any, prove: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"language": multi.language_model_module_name, "modules": {}}
    for name, pgc in multi.module_pgs.items():
        fields = {f: members(getattr(pgc, f, None)) for f in FIELDS}
        out["modules"][name] = {"fields": fields, "set": sorted(vars(pgc))}
        if prove:
            out["modules"][name]["onehot"] = {
                f: onehot(getattr(pgc, f))
                for f in FIELDS
                if isinstance(getattr(pgc, f, None), dist.ProcessGroup)
            }
    return out


def seed_facts(multi: Any) -> dict[str, dict[str, int]]:
    """model_parallel_cuda_manual_seed's rank arguments as a collection's groups give them."""
    return {
        n: {"tp_rank": p.tp.rank(), "ep_rank": p.ep.rank(), "etp_rank": p.expt_tp.rank()}
        for n, p in multi.module_pgs.items()
    }


def reference_facts(multi: Any, grids: dict[str, Any], calls: int, seconds: float) -> dict[str, Any]:
    """A reference topology's collection, grids, rank role and seed ranks, by members."""
    from megatron.core.models.mimo.config.role import RankRole

    return {
        "collection": collection_facts(multi, prove=False),
        "grids": {n: grid_facts(g) for n, g in grids.items()},
        "role": role_facts(RankRole.build([n for n in grids if n != "language"], grids)),
        "seed_ranks": seed_facts(multi),
        "new_group_calls": calls,
        "s": seconds,
    }


# ------------------------------------------------------------------ the wheel-only reference
def wheel_reference(specs: list[dict[str, Any]]) -> tuple[Any, dict[str, Any], list[Any]]:
    """Megatron's MIMO topology for ``specs`` (ModuleGridSpec's arguments) built from the
    megatron-core wheel alone, no example file: for each module Megatron's ``HyperCommGrid``
    (shape tp, cp, dp, pp with dp the ranks left over; ``rank_offset``; ``backend="nccl"``, which
    :func:`cpu_megatron` maps to gloo) with the expert view (expt_tp, ep, expt_dp, pp, sharing
    pp), its own ``create_pg`` for each of :data:`GRID_GROUPS` (``new_subgroups_by_enumeration``:
    every rank of the job takes part), each field of :data:`MIMO_GRID_FIELDS` by its ``get_pg``;
    on the language module (Megatron's ``MIMO_LANGUAGE_MODULE_KEY``) ``embd`` and ``pos_embd``
    from ``parallel_state.default_embedding_ranks`` / ``default_position_embedding_ranks`` of each
    row of ``grid.get_rank_enum("pp")`` (one ``new_group`` each, every rank). Run it under
    :func:`cpu_megatron`.

    Returns:
        (the ``MultiModuleProcessGroupCollection`` of the modules this rank is in, with the
        language module's name where it is one of them; ``{name: grid}``; the embedding groups
        made, for :func:`destroy_wheel_reference`).
    """
    from megatron.core.models.mimo.config.role import MIMO_LANGUAGE_MODULE_KEY
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    rank = dist.get_rank()
    grids: dict[str, Any] = {}
    pgcs: dict[str, Any] = {}
    embedding: list[Any] = []
    for spec in specs:
        n = spec["num_ranks"]
        tp, cp, pp, ep, etp = (spec.get(k, 1) for k in ("tp", "cp", "pp", "ep", "expt_tp"))
        assert n % (tp * cp * pp) == 0 and n % (etp * ep * pp) == 0, spec
        grid = HyperCommGrid(
            shape=[tp, cp, n // (tp * cp * pp), pp],
            dim_names=["tp", "cp", "dp", "pp"],
            rank_offset=spec.get("rank_offset", 0),
            backend="nccl",
        )
        grid.register_view(
            EXPERT_VIEW,
            [etp, ep, n // (etp * ep * pp), pp],
            ["expt_tp", "ep", "expt_dp", "pp"],
            shared_dims=["pp"],
        )
        for view, dims in GRID_GROUPS:
            grid.create_pg(list(dims), view=view)
        pgc = ProcessGroupCollection()
        for field, (view, dims) in MIMO_GRID_FIELDS.items():
            setattr(pgc, field, grid.get_pg(list(dims), view=view))
        pgc.embd = pgc.pos_embd = None
        if spec["name"] == MIMO_LANGUAGE_MODULE_KEY:
            for row in grid.get_rank_enum("pp"):
                for field, ranks_of in (
                    ("embd", ps.default_embedding_ranks),
                    ("pos_embd", ps.default_position_embedding_ranks),
                ):
                    ranks = ranks_of(list(row))
                    group = dist.new_group(ranks=ranks)
                    embedding.append(group)
                    if rank in row and rank in ranks:
                        setattr(pgc, field, group)
        grids[spec["name"]] = grid
        pgcs[spec["name"]] = pgc
    mine = {name: pgcs[name] for name, grid in grids.items() if grid.is_current_rank_in_grid()}
    language = MIMO_LANGUAGE_MODULE_KEY if MIMO_LANGUAGE_MODULE_KEY in mine else None
    return (
        MultiModuleProcessGroupCollection(module_pgs=mine, language_model_module_name=language),
        grids,
        embedding,
    )


def destroy_wheel_reference(grids: dict[str, Any], embedding: list[Any]) -> None:
    """Destroy the groups :func:`wheel_reference` made that this rank is in."""
    for group in embedding:
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    for grid in grids.values():
        grid.destroy()


# ------------------------------------------------------------------ the vision -> language bridge
B, S, DIN, H, F = 4, 3, 5, 8, 6


def serial_weights() -> dict[str, torch.Tensor]:
    """The same full float64 weights and batch on every rank (float32 draws, as Megatron's CPU
    initialisation draws float32 before the cast)."""
    gen = torch.Generator().manual_seed(11)
    w = {
        "x": torch.randn(B, S, DIN, generator=gen).double(),
        "wv": torch.randn(H, DIN, generator=gen).double(),
    }
    for k in range(3):
        w[f"w1_{k}"] = torch.randn(F, H, generator=gen).double() / 2
        w[f"w2_{k}"] = torch.randn(H, F, generator=gen).double() / 2
    return w


def serial_run(w: dict[str, torch.Tensor]) -> dict[str, Any]:
    params = {k: v.clone().requires_grad_(True) for k, v in w.items() if k != "x"}
    h = torch.tanh(w["x"] @ params["wv"].T)
    for k in range(3):
        h = torch.tanh(h @ params[f"w1_{k}"].T) @ params[f"w2_{k}"].T
    loss = 0.5 * h.square().sum()
    loss.backward()
    return {"loss": loss.item(), **{k: p.grad for k, p in params.items()}}


def bridge_run(out: dict[str, Any]) -> None:
    """Vision (ranks 0-1, data 2) -> BridgeCommunicator -> language stage 0 (ranks 2-3, tensor 2),
    stages 1 and 2 over gpc's pipeline groups, the loss, and back; Megatron's tensor-parallel
    layers on each module's ProcessGroupCollection; forward and backward under forbid_globals()."""
    from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator

    w = serial_weights()
    ref = serial_run(w)
    grids = bridge.hyper_comm_grids()
    calls = [0]
    with cpu_megatron(calls):
        comm = BridgeCommunicator(grids["vision"], grids["language"], comm_dtype=torch.float64)
    out["communicator_new_group_calls"] = calls[0]
    member = comm.bridge_pg is not dist.GroupMember.NON_GROUP_MEMBER
    out["bridge_pg"] = members(comm.bridge_pg) if member else None
    multi = bridge.multi_module_process_groups()
    name = gpc.modules[0]
    pgc = multi.module_pgs[name]
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=pgc.tp.size(), use_cpu_initialization=True, params_dtype=torch.float64
    )

    def copy_from(full: torch.Tensor) -> Any:
        return lambda t: t.copy_(full)

    layers: list[Any] = []
    if name == "vision":  # built outside forbid_globals: 0.19.2's layers read the gtp group there
        layers.append(
            tensor_parallel.ColumnParallelLinear(
                DIN,
                H,
                config=cfg,
                init_method=copy_from(w["wv"]),
                bias=False,
                gather_output=True,
                tp_group=pgc.tp,
            )
        )
    else:
        stage = pgc.pp.rank()
        layers.append(
            tensor_parallel.ColumnParallelLinear(
                H, F, config=cfg, init_method=copy_from(w[f"w1_{stage}"]), bias=False, gather_output=False,
                tp_group=pgc.tp,
            )
        )  # fmt: skip
        layers.append(
            tensor_parallel.RowParallelLinear(
                F, H, config=cfg, init_method=copy_from(w[f"w2_{stage}"]), bias=False, input_is_parallel=True,
                skip_bias_add=False, tp_group=pgc.tp,
            )
        )  # fmt: skip
    result: dict[str, Any] = {}
    with cpu_megatron(calls), bridge.forbid_globals() as refused:
        out["refused_getters"] = len(refused)
        if name == "vision":
            d, n = pgc.dp.rank(), pgc.dp.size()
            x = w["x"][d * B // n : (d + 1) * B // n]
            v = torch.tanh(layers[0](x)[0])
            comm.send_forward(v)
            grad = comm.recv_backward()
            v.backward(grad)
            weight_grad = layers[0].weight.grad.clone()
            dist.all_reduce(weight_grad, group=pgc.dp)  # the data-parallel gradient sum
            result["wv"] = (weight_grad - ref["wv"]).abs().max().item()
            result["activation_rows"] = list(v.shape)
        else:
            stage, last = pgc.pp.rank(), pgc.pp.size() - 1
            ctx = gpc.module(name)
            shape = (B, S, H)
            if stage == 0:
                h_in = comm.recv_forward().detach().requires_grad_(True)
                result["received_rows"] = list(h_in.shape)
            else:
                h_in = torch.empty(shape, dtype=torch.float64)
                dist.recv(h_in, src=ctx.get_prev_global_rank("pipeline"), group=pgc.pp)
                h_in.requires_grad_(True)
            mid = torch.tanh(layers[0](h_in)[0])
            h_out = layers[1](mid)[0]
            if stage == last:
                loss = 0.5 * h_out.square().sum()
                loss.backward()
                result["loss"] = loss.item() - ref["loss"]
            else:
                dist.send(h_out.detach(), dst=ctx.get_next_global_rank("pipeline"), group=pgc.pp)
                grad = torch.empty(shape, dtype=torch.float64)
                dist.recv(grad, src=ctx.get_next_global_rank("pipeline"), group=pgc.pp)
                h_out.backward(grad)
            if stage > 0:
                dist.send(h_in.grad, dst=ctx.get_prev_global_rank("pipeline"), group=pgc.pp)
            else:
                comm.send_backward(h_in.grad)
            tp, r = pgc.tp.size(), pgc.tp.rank()
            shard = F // tp
            full1, full2 = ref[f"w1_{stage}"], ref[f"w2_{stage}"]
            result["w1"] = (layers[0].weight.grad - full1[r * shard : (r + 1) * shard]).abs().max().item()
            result["w2"] = (layers[1].weight.grad - full2[:, r * shard : (r + 1) * shard]).abs().max().item()
            result["stage"] = stage
    out["bridge"] = result
    # a layer that reads the global state is refused, naming the getter (parallel_state is empty:
    # without the refusal Megatron would take tp_group=None); 0.19.2's layers read the gtp group
    # from it when they are built even with tp_group= given
    for given, kwargs in (("construction", {}), ("construction_with_tp_group", {"tp_group": pgc.tp})):
        try:
            with bridge.forbid_globals():
                tensor_parallel.ColumnParallelLinear(
                    DIN, H, config=cfg, init_method=copy_from(w["wv"]), bias=False, **kwargs
                )
            out[f"forbid_{given}"] = None
        except bridge.MegatronGlobalsError as exc:
            out[f"forbid_{given}"] = str(exc)
    out["getter_restored"] = ps.get_tensor_model_parallel_group(check_initialized=False) is None
    with cpu_megatron(calls):
        BridgeCommunicator.destroy_broadcast_pgs()
        BridgeCommunicator.destroy_bridge_pgs()


# ------------------------------------------------------------------ process_groups(ctx), any release
CTX_CASES: dict[str, dict[str, Any]] = {
    "ctx_colocated": CASES["colocated"][0],
    "ctx_disjoint": dict(
        vision=dict(ranks=2),
        language=dict(ranks=6, tensor=2, pipeline=3, expert=dict(size=2, tensor=1)),
    ),
}


def pg_fields(pgc: Any) -> dict[str, Any]:
    return {f: members(getattr(pgc, f, None)) for f in bridge.COLLECTION_FIELDS if f in RELEASE.fields}


def megatron_init_fields(layout: Any) -> dict[str, Any]:
    """Megatron's own initialize_model_parallel for ``layout``'s sizes on the whole world (a
    colocated module), then use_mpu_process_groups(), by members; destroyed after."""
    extra = {"gtp_remat_size": 1, "expert_gtp_remat_size": 1} if RELEASE.gtp else {}
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
            context_parallel_size=layout.context, expert_model_parallel_size=layout.expert,
            expert_tensor_parallel_size=layout.axis_size("etp"), order=layout.order, **extra,
        )  # fmt: skip
        return pg_fields(ProcessGroupCollection.use_mpu_process_groups())
    finally:
        ps.destroy_model_parallel()
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)


def rank_generator_fields(layout: Any, rank: int) -> dict[str, Any]:
    """This rank's group of each field by the installed release's RankGenerator on the module's
    sub-world (``rank_offset``), with the tokens its initialize_model_parallel uses."""
    gtp = {"gtp_remat": 1} if RELEASE.gtp else {}
    dense_order = ps._inject_gtp_remat_axis(layout.order, after="tp") if RELEASE.gtp else layout.order
    expert_order = ps._inject_gtp_remat_axis(layout.order, after="ep") if RELEASE.gtp else layout.order
    dense = ps.RankGenerator(
        tp=layout.tensor, ep=1, dp=layout.data, pp=layout.pipeline, cp=layout.context, order=dense_order,
        rank_offset=layout.offset, **gtp,
    )  # fmt: skip
    expert = ps.RankGenerator(
        tp=layout.axis_size("etp"), ep=layout.expert, dp=layout.expert_data, pp=layout.pipeline, cp=1,
        order=expert_order, rank_offset=layout.offset, **gtp,
    )  # fmt: skip
    g = "gtp_remat-" if RELEASE.gtp else ""
    tokens = {
        "tp": (dense, "tp"), "pp": (dense, "pp"), "mp": (dense, f"tp-{g}pp"), "cp": (dense, "cp"),
        "tp_cp": (dense, "tp-cp"), "tp_dp_cp": (dense, f"tp-{g}dp-cp"), "dp": (dense, "dp"),
        "dp_cp": (dense, "dp-cp"), "intra_dp_cp": (dense, "dp-cp"), "ep": (expert, "ep"),
        "expt_tp": (expert, "tp"), "tp_ep": (expert, "tp-ep"), "tp_ep_pp": (expert, "tp-ep-pp"),
        "expt_dp": (expert, "dp"), "intra_expt_dp": (expert, "dp"),
        "tp_ep_pp_with_egtp_remat": (expert, "tp-ep-gtp_remat-pp"), "dp_cp_gtp_remat": (dense, "gtp_remat-dp-cp"),
        "gtp_remat": (dense, "gtp_remat"), "expt_gtp_remat": (expert, "gtp_remat"),
        "expt_dp_gtp_remat": (expert, "gtp_remat-dp"),
    }  # fmt: skip
    out: dict[str, Any] = {f: None for f in bridge.COLLECTION_FIELDS if f in RELEASE.fields}
    for field, (gen, token) in tokens.items():
        if field in out:
            out[field] = next(grp for grp in gen.get_ranks(token) if rank in grp)
    out["intra_dist_opt"] = list(layout.ranks)
    pipe = out["pp"]
    out["embd"] = ps.default_embedding_ranks(pipe) if rank in ps.default_embedding_ranks(pipe) else None
    out["pos_embd"] = [rank] if rank == pipe[0] else None
    return out


def run_ctx_case(case: str, out_dir: Path) -> None:
    parallelctx.launch_from_torch(dict(parallel=dict(modules=CTX_CASES[case])))
    rank = gpc.get_global_rank()
    plan = gpc.launched.plan
    assert plan is not None
    out: dict[str, Any] = {
        "rank": rank,
        "case": case,
        "modules": list(gpc.modules),
        "primary": gpc.launched.module,
    }
    ours = {n: bridge.process_groups(gpc.module(n)) for n in gpc.modules}
    out["ours"] = {n: pg_fields(p) for n, p in ours.items()}
    out["onehot"] = {
        n: {
            f: onehot(getattr(p, f))
            for f in pg_fields(p)
            if isinstance(getattr(p, f, None), dist.ProcessGroup)
        }
        for n, p in ours.items()
    }
    out["plain_is_primary"] = bridge.process_groups() is ours[gpc.launched.module]
    out["again_is_same"] = all(bridge.process_groups(gpc.module(n)) is p for n, p in ours.items())
    out["distinct_objects"] = len({id(p) for p in ours.values()}) == len(ours)
    out["entries"] = sorted(str(k[0]) for k in bridge._collections if k[1] == rank)
    out["bridge_new_group_calls"] = sum(s.maker.calls for k, s in bridge._sources.items() if k[1] == rank)
    if plan.colocated():  # every module spans the world: Megatron's own init is the reference
        out["theirs"] = {n: megatron_init_fields(plan.layouts[n]) for n in gpc.modules}
    else:
        out["theirs"] = {n: rank_generator_fields(plan.layouts[n], rank) for n in gpc.modules}
    gpc.destroy()
    out["bridge_state_after_destroy"] = len(bridge._sources) + len(bridge._collections)
    (out_dir / f"{case}-rank{rank}.json").write_text(json.dumps(out))


# ------------------------------------------------------------------ one case
def run_case(case: str, topology: Any, out_dir: Path) -> None:
    from megatron.core.models.mimo.config.role import RankRole

    modules, specs = CASES[case]
    began = time.perf_counter()
    parallelctx.launch_from_torch(dict(parallel=dict(modules=modules)))
    rank = gpc.get_global_rank()
    out: dict[str, Any] = {"rank": rank, "case": case, "modules": list(gpc.modules)}
    out["launch_s"] = time.perf_counter() - began
    out["gpc_new_group_calls"] = gpc.group_creations
    # ---- gpc's side: every group made here before Megatron's
    began = time.perf_counter()
    multi = bridge.multi_module_process_groups()
    out["same_object"] = bridge.multi_module_process_groups() is multi
    out["shares_process_groups"] = all(
        getattr(multi.module_pgs[n], f) is getattr(bridge.process_groups(gpc.module(n)), f)
        for n in gpc.modules
        for f in bridge.MIMO_FIELDS
    )
    try:
        grids = bridge.hyper_comm_grids()
        out["grid_error"] = None
    except LayoutError as exc:
        grids = None
        out["grid_error"] = str(exc)
    out["ours_s"] = time.perf_counter() - began
    out["bridge_new_group_calls"] = sum(s.maker.calls for k, s in bridge._sources.items() if k[1] == rank)
    out["ours"] = collection_facts(multi, prove=True)
    if grids is not None:
        out["our_grids"] = {n: grid_facts(g) for n, g in grids.items()}
        names = [n for n in grids if n != "language"]
        out["our_role"] = role_facts(RankRole.build(names, grids))
    out["seed_ranks"] = {n: bridge.manual_seed_ranks(gpc.module(n)) for n in gpc.modules}
    for kwargs in out["seed_ranks"].values():
        inspect.signature(model_parallel_cuda_manual_seed).bind(1234, **kwargs)  # Megatron's own names
    if case == "bridge":
        bridge_run(out)
    # ---- Megatron's references on the same layout: the wheel's own classes (always), and
    # create_topology from the example file where it is at hand
    references: dict[str, Any] = {}
    calls = [0]
    began = time.perf_counter()
    with cpu_megatron(calls):
        wheel, wheel_grids, embedding = wheel_reference(specs)
    references["wheel"] = reference_facts(wheel, wheel_grids, calls[0], time.perf_counter() - began)
    with cpu_megatron(calls):
        destroy_wheel_reference(wheel_grids, embedding)
    if topology is not None:
        calls = [0]
        began = time.perf_counter()
        with cpu_megatron(calls):
            topo = topology.create_topology([topology.ModuleGridSpec(**spec) for spec in specs])
        seconds = time.perf_counter() - began
        references["create_topology"] = reference_facts(
            topo.schedule_pg_collection, topo.grids, calls[0], seconds
        )
        with cpu_megatron(calls):
            topo.destroy()
    out["references"] = references
    if case == "gtp":  # what Megatron 0.19.2 offers for gtp on a sub-world: RankGenerator(rank_offset=)
        out["rank_generator"] = gtp_rank_generator()
    gpc.destroy()
    out["bridge_state_after_destroy"] = len(bridge._sources) + len(bridge._collections) + len(bridge._grids)
    (out_dir / f"{case}-rank{rank}.json").write_text(json.dumps(out))


def gtp_rank_generator() -> dict[str, list[int]]:
    """This rank's groups of the gtp module by megatron-core 0.19.2's RankGenerator on the
    module's sub-world (rank_offset, gtp_remat), the tokens initialize_model_parallel uses."""
    plan = gpc.launched.plan
    assert plan is not None
    layout = plan.layouts["language"]
    if dist.get_rank() not in layout.ranks:
        return {}
    order = ps._inject_gtp_remat_axis(layout.order, after="tp")
    gen = ps.RankGenerator(
        tp=layout.tensor, ep=1, dp=layout.data, pp=layout.pipeline, cp=layout.context, order=order,
        rank_offset=layout.offset, gtp_remat=layout.gtp_remat,
    )  # fmt: skip
    tokens = {
        "tp": "tp",
        "pp": "pp",
        "dp": "dp",
        "cp": "cp",
        "dp_cp": "dp-cp",
        "gtp_remat": "gtp_remat",
        "mp": "tp-gtp_remat-pp",
        "tp_dp": "tp-gtp_remat-dp",
        "tp_dp_cp": "tp-gtp_remat-dp-cp",
        "dp_cp_gtp_remat": "gtp_remat-dp-cp",
    }
    return {f: next(g for g in gen.get_ranks(t) if dist.get_rank() in g) for f, t in tokens.items()}


# ------------------------------------------------------------------ teardown and abort of the bridge's groups
def run_adopted_case(out_dir: Path) -> None:
    """On a default group the worker made (gpc adopts it and leaves it alive at destroy):
    gpc.destroy() destroys the groups the bridge made for the modules."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    parallelctx.launch_from_torch(dict(parallel=dict(modules=CASES["colocated"][0])))
    rank = gpc.get_global_rank()
    language = {n: bridge.process_groups(gpc.module(n)) for n in gpc.modules}["language"]
    if NEXT:
        bridge.hyper_comm_grids()
    made = [g for k, s in bridge._sources.items() if k[1] == rank for g in s.created]
    out: dict[str, Any] = {"rank": rank, "made": [members(g) for g in made]}
    out["made_proven"] = [onehot(g) for g in made]
    out["tp_dp_cp"] = members(language.tp_dp_cp)
    gpc.destroy()
    registry = dist.distributed_c10d._world.pg_map
    out["alive_after_destroy"] = sum(1 for g in made if g in registry)
    out["default_alive"] = dist.is_initialized() and dist.group.WORLD in registry
    dist.barrier()
    dist.destroy_process_group()  # the next launch makes its own default group
    (out_dir / f"adopted-rank{rank}.json").write_text(json.dumps(out))


def run_abort_case(out_dir: Path) -> None:
    """gpc.abort() ends a collective hung on a group the bridge made (the language module's
    tensor x data group, which gpc has no mode for): rank 1 stops joining it, rank 0's watchdog
    aborts after 2 s. The last case: the processes exit after it."""
    parallelctx.launch_from_torch(dict(parallel=dict(modules=CASES["colocated"][0])))
    rank = gpc.get_global_rank()
    language = [bridge.process_groups(gpc.module(n)) for n in ("vision", "language")][1]
    group = language.tp_dp_cp  # made by the bridge: tensor x data (context 1) of the language module
    out: dict[str, Any] = {"rank": rank, "group": members(group), "raised": None, "hung": False}
    x = torch.ones(1)
    dist.all_reduce(x, group=group)  # warm: every connection of the group is made
    dist.barrier()
    if rank == 0:
        threading.Thread(target=lambda: (time.sleep(2), gpc.abort()), daemon=True).start()
        began = time.monotonic()
        try:
            dist.all_reduce(x, group=group)
            out["hung"] = True
        except RuntimeError as exc:
            out["raised"] = time.monotonic() - began
            out["error"] = str(exc).splitlines()[0][:200]
    (out_dir / f"abort-rank{rank}.json").write_text(json.dumps(out))
    deadline = time.monotonic() + 120  # the others stay (their sockets open) until rank 0 is done
    while rank != 0 and not (out_dir / "abort-rank0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    out_dir, topology_path, *cases = sys.argv[1:]
    topology = load_topology(topology_path) if topology_path != "-" else None
    for case in cases:
        if case == "adopted":
            run_adopted_case(Path(out_dir))
        elif case == "abort":
            run_abort_case(Path(out_dir))
        elif case in CTX_CASES:
            run_ctx_case(case, Path(out_dir))
        else:
            run_case(case, topology, Path(out_dir))


if __name__ == "__main__":
    main()
