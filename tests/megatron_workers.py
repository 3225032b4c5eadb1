"""Worker functions for tests/test_megatron_bridge.py (module level, so spawned children import them).

One 8-rank spawn runs every layout in the same processes: for each, Megatron-core's own
``initialize_model_parallel`` answers every public getter of ``parallel_state``; then gpc is
relaunched with the same sizes, ``parallelctx.megatron.install()`` runs and the same getters
answer again. Groups are described by their members (never object identity) and the installed
extra groups are proven with a one-hot all-reduce. A last layout runs Megatron-core's
tensor-parallel layers through the installed state. Each rank writes one JSON file.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import parallelctx
import parallelctx.megatron as bridge
from parallelctx import ParallelMode, gpc

warnings.simplefilter("ignore")

from megatron.core import ModelParallelConfig, tensor_parallel  # noqa: E402 - after the warnings filter (megatron warns at import)
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402

# Public functions of parallel_state that are not state getters, and why (docs/migration.md).
NOT_GETTERS: dict[str, str] = {
    "initialize_model_parallel": "lifecycle: replaced by install()",
    "destroy_model_parallel": "lifecycle: replaced by uninstall() / gpc.destroy()",
    "destroy_global_memory_buffer": "mutator",
    "destroy_global_symmetric_memory_buffer": "mutator",
}
MUTATOR_PREFIXES = ("set_", "create_", "initialize_", "destroy_", "update_", "overwrite_", "generate_")
# Values tried for the getters' non-boolean keyword arguments.
EXTRA_ARGS: dict[str, tuple[Any, ...]] = {"vp_stage": (None, 0, 1), "group_size": (None, 1, 2, 4, 8)}


def discover() -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Every public getter of parallel_state with every combination of its keyword arguments,
    and every public function left out with the reason."""
    getters: dict[str, list[dict[str, Any]]] = {}
    excluded: dict[str, str] = {}
    for name, fn in sorted(vars(ps).items()):
        if name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != ps.__name__:
            continue
        params = inspect.signature(fn).parameters.values()
        if name in NOT_GETTERS:
            excluded[name] = NOT_GETTERS[name]
        elif name.startswith(MUTATOR_PREFIXES):
            excluded[name] = "mutator or group factory"
        elif any(p.default is inspect.Parameter.empty for p in params):
            excluded[name] = "helper with required arguments (pure or a group factory), not a state getter"
        else:
            choices = []
            for p in params:
                if isinstance(p.default, bool):
                    choices.append([(p.name, False), (p.name, True)])
                elif p.name in EXTRA_ARGS:
                    choices.append([(p.name, v) for v in EXTRA_ARGS[p.name]])
                else:
                    raise AssertionError(f"parallel_state.{name}: no values known for argument {p.name!r}")
            getters[name] = [dict(combo) for combo in itertools.product(*choices)]
    return getters, excluded


def describe(value: Any) -> Any:
    """A JSON description of a getter's answer: a group by its members and backend."""
    if isinstance(value, dist.ProcessGroup):
        return {"group": dist.get_process_group_ranks(value), "backend": str(dist.get_backend(value))}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"object": type(value).__name__}


def answer_all(getters: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Call every getter with every argument combination; record its answer or its exception."""
    out: dict[str, Any] = {}
    for name, combos in getters.items():
        fn = getattr(ps, name)
        for kwargs in combos:
            key = name + "(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
            try:
                out[key] = describe(fn(**kwargs))
            except Exception as exc:
                out[key] = {"raises": type(exc).__name__}
    return out


def onehot(group: Any) -> list[int]:
    """All-reduce this rank's one-hot vector over ``group``: the sum marks its members."""
    vec = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    vec[dist.get_rank()] = 1
    dist.all_reduce(vec, group=group)
    return vec.tolist()


def config(case: dict[str, Any]) -> dict[str, Any]:
    """The parallelctx config of a layout case."""
    parallel = {
        "tensor": case["tp"],
        "pipeline": case["pp"],
        "context": case["cp"],
        "expert": {"size": case["ep"], "tensor": case["etp"]},
        "order": case["order"],
    }
    if "gtp" in case:  # megatron-core 0.19's generalized tensor parallelism
        parallel["gtp_remat"] = case["gtp"]
        parallel["expert"]["gtp_remat"] = case.get("egtp", 1)
    return {"parallel": parallel, "dist": {"timeout": 120, "backend": "gloo"}, "seed": 1234}


def collection(pgc: Any) -> dict[str, Any]:
    """Every field of a ProcessGroupCollection by members ("unset" where it has no value)."""
    return {f.name: describe(getattr(pgc, f.name, "unset")) for f in dataclasses.fields(pgc)}


def megatron_init(case: dict[str, Any]) -> None:
    """Megatron's own initialize_model_parallel for a case."""
    ps.initialize_model_parallel(
        **case.get("options", {}),
        tensor_model_parallel_size=case["tp"],
        pipeline_model_parallel_size=case["pp"],
        virtual_pipeline_model_parallel_size=case.get("vpp"),
        context_parallel_size=case["cp"],
        expert_model_parallel_size=case["ep"],
        expert_tensor_parallel_size=case["etp"],
        order=case["order"],
        distributed_timeout_minutes=2,
        **(
            {"gtp_remat_size": case["gtp"], "expert_gtp_remat_size": case.get("egtp", 1)}
            if "gtp" in case
            else {}
        ),
    )


def _release_globals() -> list[str]:
    """The parallel_state globals of the installed release that the bridge fills."""
    have = bridge.release.detect().globals
    return [n for n in bridge.release.known_globals() if n in have]


def non_pristine() -> list[str]:
    """parallel_state globals that differ from their import-time value."""
    return [n for n in _release_globals() if getattr(ps, n) != bridge.release.pristine(n)]


def _established() -> set[int]:
    """The inodes of this process's connected TCP sockets (gloo pairs, the store client)."""
    from parallelctx.abort import _tcp_sockets

    return {inode for inode, _, _, _, state in _tcp_sockets() if state == "01"}


def compare_layout(
    case: dict[str, Any], relaunch: Any, getters: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """Megatron's answers, then parallelctx's, for one layout (gpc launched with it on entry)."""
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # Megatron's groups connect on first use only
    try:
        megatron_init(case)
        theirs = answer_all(getters)
        their_collection = collection(ProcessGroupCollection.use_mpu_process_groups())
        ps.destroy_model_parallel()
    finally:
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    relaunch(case)
    options = case.get("options", {})
    # the pg_collection route: no install, parallel_state left alone
    globals_before = {name: getattr(ps, name) for name in _release_globals()}
    dist.barrier()  # every earlier collective done: no peer connects to this rank meanwhile
    connected = _established()
    pgc = bridge.process_groups(**options)
    new_connections = len(_established() - connected)
    dist.barrier()  # ... and none uses the new groups before every rank has counted
    groups_after_first = len(dist.distributed_c10d._world.pg_names)
    our_collection = collection(pgc)
    route = {
        "changed": [name for name, value in globals_before.items() if getattr(ps, name) is not value],
        "is_initialized": ps.is_initialized(),
        "same_object": bridge.process_groups(**options) is pgc,
        "made_again": len(dist.distributed_c10d._world.pg_names) - groups_after_first,
        "tp_dp_cp": onehot(pgc.tp_dp_cp),
        "tp_cp": onehot(pgc.tp_cp),
        "new_connections": new_connections,  # before their first collective (dist.gloo_lazy_init)
    }
    before = len(dist.distributed_c10d._world.pg_names)
    calls = bridge.install(virtual_pipeline_model_parallel_size=case.get("vpp"), **options)
    made = len(dist.distributed_c10d._world.pg_names) - before
    ours = answer_all(getters)
    proofs = {
        "tp-dp-cp": onehot(ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
        "tp-dp": onehot(ps.get_tensor_and_data_parallel_group()),
        "tp-cp": onehot(ps.get_tensor_and_context_parallel_group()),
        "expert-tensor": onehot(ps.get_expert_tensor_parallel_group()),
    }
    if options.get("create_gloo_process_groups", True) and case.get("gtp", 1) == 1:  # 0.19: none with GTP
        proofs["dp-cp-gloo"] = onehot(ps.get_data_parallel_group_gloo(with_context_parallel=True))
    if options.get("create_all_gather_group"):
        proofs["all-gather"] = onehot(
            ps.get_data_parallel_group(with_context_parallel=True, independent_all_gather=True)
        )
    for level, group in enumerate(ps.get_hierarchical_context_parallel_groups(check_initialized=False) or []):
        proofs[f"hcp{level}"] = onehot(group)
    if ps.is_rank_in_position_embedding_group():
        proofs["position-embedding"] = onehot(ps.get_position_embedding_group())
    created = list(bridge._state.created) if bridge._state is not None else []
    if case.get("uninstall_by") == "uninstall":
        bridge.uninstall()
    else:
        gpc.destroy()
    registry = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    restored = {
        "non_pristine": non_pristine(),
        "installed": bridge.is_installed(),
        "is_initialized": ps.is_initialized(),
        "tracker_is_ours": tensor_parallel.random._CUDA_RNG_STATE_TRACKER is bridge.rng._TRACKER,
        "created_alive": sum(1 for g in created if g in registry),
    }
    restored_collections = len(bridge._collections)
    return {
        "theirs": theirs,
        "ours": ours,
        "their_collection": their_collection,
        "our_collection": our_collection,
        "route": route,
        "calls": calls,
        "made": made,
        "proofs": proofs,
        "restored": restored,
        "collections_after": restored_collections,
    }


def layers(out: dict[str, Any]) -> None:
    """Megatron-core's tensor-parallel layers, the RNG tracker and checkpoint on the installed state."""
    bridge.install()
    tp = ps.get_tensor_model_parallel_world_size()
    cfg = ModelParallelConfig(
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float64
    )
    gen = torch.Generator().manual_seed(7)  # the same full weights on every rank
    hidden, ffn, vocab = 8, 12, 16
    # Megatron's CPU initialisation builds the full weight in float32 before the cast: draw
    # float32 weights so both models hold exactly the same float64 values.
    w1 = torch.randn(ffn, hidden, generator=gen).double()
    w2 = torch.randn(hidden, ffn, generator=gen).double()
    emb = torch.randn(vocab, hidden, generator=gen).double()
    x = torch.randn(5, 3, hidden, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (3, 5), generator=gen)

    def copy_from(full: torch.Tensor) -> Any:
        return lambda w: w.copy_(full)

    col = tensor_parallel.ColumnParallelLinear(
        hidden, ffn, config=cfg, init_method=copy_from(w1), bias=False, gather_output=False
    )
    row = tensor_parallel.RowParallelLinear(
        ffn,
        hidden,
        config=cfg,
        init_method=copy_from(w2),
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    vemb = tensor_parallel.VocabParallelEmbedding(vocab, hidden, init_method=copy_from(emb), config=cfg)
    xp = x.clone().requires_grad_(True)
    y, _ = row(torch.relu(col(xp)[0]))
    e = vemb(ids)
    (y.square().sum() + e.square().sum()).backward()
    # serial torch model with the same full weights
    lin1 = torch.nn.Linear(hidden, ffn, bias=False, dtype=torch.float64)
    lin2 = torch.nn.Linear(ffn, hidden, bias=False, dtype=torch.float64)
    semb = torch.nn.Embedding(vocab, hidden, dtype=torch.float64)
    with torch.no_grad():
        lin1.weight.copy_(w1)
        lin2.weight.copy_(w2)
        semb.weight.copy_(emb)
    xs = x.clone().requires_grad_(True)
    ys = lin2(torch.relu(lin1(xs)))
    es = semb(ids)
    (ys.square().sum() + es.square().sum()).backward()
    rank = ps.get_tensor_model_parallel_rank()
    shard = ffn // tp
    vshard = vocab // tp
    assert lin1.weight.grad is not None and lin2.weight.grad is not None and semb.weight.grad is not None
    diffs = {
        "column_row_forward": (y - ys).abs().max().item(),
        "input_grad": (xp.grad - xs.grad).abs().max().item(),  # type: ignore[operator]
        "column_weight_grad": (col.weight.grad - lin1.weight.grad[rank * shard : (rank + 1) * shard])
        .abs()
        .max()
        .item(),
        "row_weight_grad": (row.weight.grad - lin2.weight.grad[:, rank * shard : (rank + 1) * shard])
        .abs()
        .max()
        .item(),
        "embedding_forward": (e - es).abs().max().item(),
        "embedding_grad": (vemb.weight.grad - semb.weight.grad[rank * vshard : (rank + 1) * vshard])
        .abs()
        .max()
        .item(),
    }
    out["layer_diffs"] = diffs
    out["layer_tp_group"] = dist.get_process_group_ranks(col.tp_group)  # taken from parallel_state

    # dropout under Megatron's tracker, on the CPU
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tensor_parallel.model_parallel_cuda_manual_seed(4321)
    out["seed_after_manual_seed"] = [gpc.get_seed(ParallelMode.TENSOR), gpc.get_seed(ParallelMode.DATA)]
    ones = torch.ones(64, dtype=torch.float64)
    with tracker.fork():
        tp_mask = (torch.nn.functional.dropout(ones, 0.5) > 0).int().tolist()
    with tracker.fork(tensor_parallel.get_data_parallel_rng_tracker_name()):
        dp_mask = (torch.nn.functional.dropout(ones, 0.5) > 0).int().tolist()
    with tracker.fork(tensor_parallel.get_expert_parallel_rng_tracker_name()):
        ep_mask = (torch.nn.functional.dropout(ones, 0.5) > 0).int().tolist()
    default_mask = (torch.nn.functional.dropout(ones, 0.5) > 0).int().tolist()
    out["masks"] = {"tp": tp_mask, "dp": dp_mask, "ep": ep_mask, "default": default_mask}

    # tensor_parallel.checkpoint recomputes the same masks
    seen: list[list[int]] = []

    def block(inp: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            dropped = torch.nn.functional.dropout(inp, 0.5)
        seen.append((dropped != 0).int().tolist())
        return (dropped * 3).sin()

    start = tracker.get_states()
    a = torch.randn(32, dtype=torch.float64, generator=gen).requires_grad_(True)
    tensor_parallel.checkpoint(block, False, a).sum().backward()
    after_checkpoint = tracker.get_states()
    tracker.set_states(start)
    b = a.detach().clone().requires_grad_(True)
    block(b).sum().backward()
    out["checkpoint"] = {
        "masks_equal": seen[0] == seen[1] == seen[2],
        "calls": len(seen),
        "grad_diff": (a.grad - b.grad).abs().max().item(),  # type: ignore[operator]
        "streams_after_equal": all(
            torch.equal(
                after_checkpoint["parallelctx"].states[k][0], tracker.get_states()["parallelctx"].states[k][0]
            )
            for k in after_checkpoint["parallelctx"].states
        ),
    }
    seeding(out)
    try:
        tracker.fork("no-such-rng")
        out["unknown_fork"] = "no error"
    except ValueError as exc:
        out["unknown_fork"] = str(exc)


def seeding(out: dict[str, Any]) -> None:
    """Megatron's seeding on the bridge, as a Megatron training script does it: draws from each
    tracker stream and from gpc's matching stream, interleaved, after
    model_parallel_cuda_manual_seed(1234) with and without force_reset_rng; then a
    parallelctx.checkpoint region under the tracker after a forced reset."""
    names = {
        "tp": (tensor_parallel.random._MODEL_PARALLEL_RNG_TRACKER_NAME, ParallelMode.TENSOR),
        "ep": (tensor_parallel.get_expert_parallel_rng_tracker_name(), ParallelMode.EXPERT),
        "dp": (tensor_parallel.get_data_parallel_rng_tracker_name(), ParallelMode.DATA),
    }
    draws: dict[str, Any] = {}
    for reset in (False, True):
        with torch.no_grad():
            torch.rand(5)  # the default stream moves on: the seeded streams must not care
        tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=reset)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        got: dict[str, list[float]] = {}
        for key, (name, mode) in names.items():
            seq: list[float] = []
            with tracker.fork(name):
                seq += torch.rand(3).tolist()
            with gpc.seed(mode):
                seq += torch.rand(3).tolist()
            with tracker.fork(name):
                seq += torch.rand(2).tolist()
            got[key] = seq
        got["tracker_class"] = type(tracker).__name__  # type: ignore[assignment]
        draws[f"reset={reset}"] = got
    out["seeding"] = draws
    out["seeding_ranks"] = {
        "tp": ps.get_tensor_model_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
    }

    # after initialize_rng_tracker(force_reset=True) gpc's checkpoint still replays the tracker's
    # stream: the gradient of a checkpointed dropout block equals the plain run's.
    tensor_parallel.random.initialize_rng_tracker(force_reset=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()

    def block(inp: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return torch.nn.functional.dropout(inp, 0.5).sin()

    x = torch.linspace(-1, 1, 64, dtype=torch.float64)
    state = gpc.get_rng_state()
    a = x.clone().requires_grad_(True)
    parallelctx.checkpoint(block, a, use_reentrant=True).sum().backward()
    gpc.set_rng_state(state)
    b = x.clone().requires_grad_(True)
    block(b).sum().backward()
    assert a.grad is not None and b.grad is not None
    out["forced_reset_checkpoint"] = {
        "tracker_class": type(tracker).__name__,
        "grad_diff": (a.grad - b.grad).abs().max().item(),
        "grad_nonzero": int((b.grad != 0).sum().item()),
    }


def run(out_dir: str, cases: list[dict[str, Any]], layer_case: dict[str, Any], port: int) -> None:
    """Worker main for spawn: every layout case, then the layer checks, in the same processes."""
    rank = gpc.get_global_rank()
    world = gpc.get_world_size(ParallelMode.GLOBAL)
    local = gpc.local_rank

    def relaunch(case: dict[str, Any]) -> None:
        gpc.destroy()
        parallelctx.launch(config(case), rank=rank, world_size=world, port=port, local_rank=local)

    getters, excluded = discover()
    record: dict[str, Any] = {"rank": rank, "getters": getters, "excluded": excluded, "cases": []}
    for i, case in enumerate(cases):
        if i > 0:
            relaunch(case)
        record["cases"].append(compare_layout(case, relaunch, getters))
    relaunch(layer_case)
    layers(record)
    # errors a user meets
    try:
        bridge.install()
        record["install_twice"] = "no error"
    except RuntimeError as exc:
        record["install_twice"] = str(exc)
    gpc.destroy()
    try:
        bridge.install()
        record["install_before_launch"] = "no error"
    except parallelctx.NotLaunchedError as exc:
        record["install_before_launch"] = str(exc)
    record["after_destroy_non_pristine"] = non_pristine()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
