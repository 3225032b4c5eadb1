"""Worker functions for the multi-process tests (module level, so spawned children import them).

Each worker measures its groups with its own collectives (one-hot all-reduce, all-gather of
global ranks) and writes what it saw to a JSON file; the test process compares the files with
the pure layout. Nothing here trusts what gpc stored except the answers under test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from probes import probe_group

import parallelctx
from parallelctx import NotLaunchedError, ParallelMode, gpc
from parallelctx.launch import free_port


def _measure_group(group: Any, world: int, rank: int) -> dict[str, Any]:
    return probe_group(group, world, rank)


def _record(case: dict[str, Any]) -> dict[str, Any]:
    world = gpc.get_world_size(ParallelMode.GLOBAL)
    rank = gpc.get_global_rank()
    modes: dict[str, Any] = {}
    for mode in ParallelMode:
        if not gpc.is_initialized(mode):
            modes[mode.value] = None
            continue
        entry: dict[str, Any] = {
            "local_rank": gpc.get_local_rank(mode),
            "local_rank_str": gpc.get_local_rank(mode.value),
            "size": gpc.get_world_size(mode),
            "ranks": gpc.get_ranks_in_group(mode),
            "next": gpc.get_next_global_rank(mode),
            "prev": gpc.get_prev_global_rank(mode),
            "first": gpc.is_first_rank(mode),
            "last": gpc.is_last_rank(mode),
            "has_group": gpc.get_group(mode) is not None,
        }
        view = getattr(gpc, "world" if mode is ParallelMode.GLOBAL else mode.value)
        entry["view"] = [view.rank, view.size, list(view.ranks)]
        group = gpc.get_group(mode)
        if group is not None:  # never None: the test fails on has_group then
            entry["measured"] = _measure_group(group, world, rank)
            entry["measured_cpu"] = _measure_group(gpc.get_cpu_group(mode), world, rank)
        modes[mode.value] = entry
    # seeds: two draws per mode in separate `with` blocks, plus the default stream
    draws = {}
    for mode in ParallelMode:
        with gpc.seed(mode):
            a = torch.rand(4).tolist()
        with gpc.seed(mode):
            b = torch.rand(4).tolist()
        draws[mode.value] = [a, b]
    default = torch.rand(4).tolist()
    mine = {
        "rank": rank,
        "seeds": {m.value: gpc.get_seed(m) for m in ParallelMode},
        "draws": draws,
        "default": default,
    }
    every = [None] * world
    dist.all_gather_object(every, mine)
    return {
        "case": case,
        "rank": rank,
        "modes": modes,
        "pipeline_first": gpc.is_pipeline_first_stage(),
        "pipeline_last": gpc.is_pipeline_last_stage(),
        "rank_for_log": gpc.is_rank_for_log(),
        "procs_on_node": gpc.num_processes_on_current_node,
        "num_nodes": gpc.num_nodes,
        "node_rank": gpc.node_rank,
        "local_rank": gpc.local_rank,
        "config_model": gpc.config.model.hidden_size,
        "seeds_all": every,
        # torch's own registry of groups: the default group plus every group made at launch
        "torch_groups": len(dist.distributed_c10d._world.pg_names),
    }


def case_config(case: dict[str, Any]) -> dict[str, Any]:
    """Return the config dict of one test case."""
    parallel: dict[str, Any] = {
        "tensor": case.get("tensor", 1),
        "pipeline": {"size": case.get("pipeline", 1)},
        "context": case.get("context", 1),
        "order": case.get("order", "tp-cp-ep-dp-pp"),
    }
    if "expert" in case:
        parallel["expert"] = {"size": case["expert"], "tensor": case.get("expert_tensor", parallel["tensor"])}
    return {
        "parallel": parallel,
        "dist": {"timeout": 120, "backend": "gloo"},
        "seed": 1234,
        "model": {"hidden_size": 64},
    }


def run_cases(out_dir: str, cases: list[dict[str, Any]], port: int) -> None:
    """Worker main for spawn: check every case, destroying and relaunching between cases.

    The first case was launched by spawn on ``tcp://127.0.0.1:port``; each next one is
    launched again in the same processes on the same host and port, as a user would.
    """
    rank = gpc.get_global_rank()
    world = gpc.get_world_size(ParallelMode.GLOBAL)
    local = gpc.local_rank
    for i, case in enumerate(cases):
        if i > 0:
            gpc.destroy()
            after = {"dist_initialized": dist.is_initialized()}
            try:
                gpc.get_local_rank(ParallelMode.TENSOR)
                after["query_raised"] = False
            except NotLaunchedError:
                after["query_raised"] = True
            try:
                gpc.tensor.rank
                after["view_raised"] = False
            except NotLaunchedError:
                after["view_raised"] = True
            parallelctx.launch(case_config(case), rank=rank, world_size=world, port=port, local_rank=local)
        else:
            after = None
        record = _record(case)
        record["after_destroy"] = after
        Path(out_dir, f"case{i}_rank{rank}.json").write_text(json.dumps(record))


def adopted_relaunch(index: int, world: int, init_method: str, out_dir: str) -> None:
    """Worker for torch.multiprocessing: the user makes the default group, parallelctx adopts it,
    is destroyed and launched again on it; records what happened on each rank."""
    dist.init_process_group("gloo", init_method=init_method, rank=index, world_size=world)
    config = {"parallel": {"tensor": 2}, "dist": {"timeout": 60}}
    result: dict[str, Any] = {}
    try:
        parallelctx.launch(config, rank=index, world_size=world)
        tensor = torch.ones(1)
        dist.all_reduce(tensor, group=gpc.get_group(ParallelMode.TENSOR))
        result["first_sum"] = tensor.item()
        gpc.destroy()
        result["default_alive"] = dist.is_initialized()
        try:
            parallelctx.launch(config, rank=index, world_size=world)
            result["relaunch"] = "ok"
        except RuntimeError as exc:
            result["relaunch"] = str(exc)
    finally:
        gpc.destroy()
        dist.destroy_process_group()
    Path(out_dir, f"rank{index}.json").write_text(json.dumps(result))


def seed_table_worker(out_dir: str, layouts: dict[str, dict[str, Any]]) -> None:
    """Draw once from every stream under each layout (relaunching between them); rank 0 writes
    ``{rank: {stream: draws}}`` per layout to OUT_DIR/<key>.json."""
    from parallelctx.seed import STREAMS

    rank = gpc.get_global_rank()
    world = gpc.get_world_size(ParallelMode.GLOBAL)
    local = gpc.local_rank
    port = None
    for i, (key, parallel) in enumerate(layouts.items()):
        if i > 0:
            if port is None:
                port_box = [free_port() if rank == 0 else None]
                dist.broadcast_object_list(port_box, src=0)
                port = port_box[0]
            gpc.destroy()
            parallelctx.launch(
                {"parallel": parallel}, rank=rank, world_size=world, port=port, local_rank=local
            )
        mine = {}
        for stream in STREAMS:
            with gpc.seed(stream):
                mine[str(stream)] = torch.rand(4).tolist()
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            Path(out_dir, f"{key}.json").write_text(json.dumps({str(r): d for r, d in enumerate(every)}))


def launches_again() -> None:
    """A main_func written as for torchrun: it launches gpc itself, inside spawn's worker."""
    parallelctx.launch_from_env({"parallel": {"tensor": 1}}, backend="gloo")


def groups_left_alive(
    index: int, world: int, init_method: str, out_dir: str, adopt: bool, bridge: bool = False
) -> None:
    """Worker for torch.multiprocessing: model code on gpc's groups (tensor 2), then
    ``gpc.destroy()`` (and, when the user made the default group, the user's own
    ``destroy_process_group()``); records which of the groups the model code used are still
    alive once the program holds none of them. A group kept alive into the interpreter's exit
    runs its worker threads there: a work they free then needs the GIL, and the rank dies of
    ``terminate called without an active exception``. With ``bridge``, the model code also
    installs the Megatron bridge and takes ``process_groups()`` while it is installed (its
    release check then sees process groups in ``parallel_state``)."""
    import gc
    import weakref

    if bridge:  # before the launch: imported after it, torch's and Megatron's modules keep the world group
        from parallelctx import megatron as megatron_bridge
    if adopt:
        dist.init_process_group("gloo", init_method=init_method, rank=index, world_size=world)
        parallelctx.launch({"parallel": {"tensor": 2}, "dist": {"timeout": 60}}, rank=index, world_size=world)
    else:
        parallelctx.launch(
            {"parallel": {"tensor": 2}, "dist": {"timeout": 60, "init_method": init_method}},
            rank=index,
            world_size=world,
        )
    for mode in (ParallelMode.TENSOR, ParallelMode.DATA):  # the model code's own collectives
        t = torch.ones(1)
        dist.all_reduce(t, group=gpc.get_group(mode))
    used: dict[str, weakref.ref[Any]] = {}
    if bridge:
        import dataclasses

        megatron_bridge.install()
        collection = megatron_bridge.process_groups()
        for f in dataclasses.fields(collection):
            if isinstance(getattr(collection, f.name, None), dist.ProcessGroup):
                used[f"megatron {f.name}"] = weakref.ref(getattr(collection, f.name))
        collection = None
    for mode in ParallelMode:
        for kind, get in (("", gpc.get_group), ("cpu ", gpc.get_cpu_group)):
            try:
                group = get(mode)
            except Exception:  # a mode this layout does not have
                continue
            if group is not None:
                used[f"{kind}{mode.value}"] = weakref.ref(group)
    group = t = None
    dist.barrier()
    gpc.destroy()
    if adopt:
        dist.destroy_process_group()
    gc.collect()
    alive = sorted(name for name, ref in used.items() if ref() is not None)
    Path(out_dir, f"rank{index}.json").write_text(json.dumps({"used": sorted(used), "alive": alive}))
