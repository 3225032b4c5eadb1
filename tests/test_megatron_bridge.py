"""``parallelctx.megatron.install()``: Megatron-core's ``parallel_state`` answering from gpc.

One 8-rank spawn (a module-scoped fixture) runs, in the same processes, for each layout below:
Megatron-core's own ``initialize_model_parallel``, every public getter of ``parallel_state``
with every combination of its keyword arguments (found with ``inspect``, see
tests/megatron_workers.py), ``destroy_model_parallel``; then gpc relaunched with the same sizes,
``install()``, the same getters again, a one-hot all-reduce over the installed groups, and
``uninstall()`` or ``gpc.destroy()``. Then Megatron-core's tensor-parallel layers, the RNG
tracker and ``tensor_parallel.checkpoint`` run through the installed state. Answers compare by
group members, never object identity. megatron-core is part of the test extra: never skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from megatron_workers import run

import parallelctx
from parallelctx import ParallelMode, plan
from parallelctx.launch import free_port
from parallelctx.megatron import release as _release

RELEASE = _release.detect()

WORLD = 8
D = "tp-cp-ep-dp-pp"
P = "tp-cp-ep-pp-dp"
CASES: list[dict[str, Any]] = [
    {"name": "dense", "tp": 2, "pp": 2, "cp": 1, "ep": 1, "etp": 2, "order": D, "uninstall_by": "uninstall"},
    {"name": "context", "tp": 2, "pp": 2, "cp": 2, "ep": 1, "etp": 2, "order": D},
    {
        "name": "expert_etp1",
        "tp": 2,
        "pp": 2,
        "cp": 1,
        "ep": 2,
        "etp": 1,
        "order": D,
        "uninstall_by": "uninstall",
    },
    {"name": "pp_not_last", "tp": 2, "pp": 2, "cp": 1, "ep": 2, "etp": 1, "order": P},
    {
        "name": "tp1_context_options",
        "tp": 1,
        "pp": 2,
        "cp": 2,
        "ep": 1,
        "etp": 1,
        "order": D,
        "options": {
            "create_all_gather_group": True,
            "hybrid_context_parallel": True,
            "hierarchical_context_parallel_sizes": [2, 1],
            "num_distributed_optimizer_instances": 1,
        },
    },
    {
        "name": "pp4_virtual_no_gloo",
        "tp": 1,
        "pp": 4,
        "cp": 1,
        "ep": 1,
        "etp": 1,
        "order": D,
        "vpp": 2,
        "options": {"create_gloo_process_groups": False, "hierarchical_context_parallel_sizes": [1]},
    },
    {"name": "tp4_cp2_world", "tp": 4, "pp": 1, "cp": 2, "ep": 2, "etp": 4, "order": P},
]
if "create_all_gather_group" not in RELEASE.options:  # 0.18 on: create_all_gather_groups() instead
    del CASES[4]["options"]["create_all_gather_group"]
if RELEASE.gtp:  # 0.19 on: generalized tensor parallelism, dense and expert
    CASES += [
        {"name": "gtp2", "tp": 2, "pp": 1, "cp": 1, "ep": 1, "etp": 2, "order": D, "gtp": 2},
        {
            "name": "gtp2_egtp2_expert",
            "tp": 1,
            "pp": 2,
            "cp": 1,
            "ep": 2,
            "etp": 1,
            "order": D,
            "gtp": 2,
            "egtp": 2,
            "uninstall_by": "uninstall",
        },
    ]
# parallel_state's getters and keyword combinations by release (found by inspect in the workers)
GETTER_COUNTS = {"0.16": (62, 131), "0.17": (59, 127), "0.18": (58, 122), "0.19": (66, 156)}
LAYER_CASE: dict[str, Any] = {"name": "layers", "tp": 2, "pp": 1, "cp": 1, "ep": 2, "etp": 2, "order": D}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from megatron_workers import config

    out = tmp_path_factory.mktemp("megatron_bridge")
    port = free_port()
    parallelctx.spawn(
        run,
        WORLD,
        dist_url=f"tcp://127.0.0.1:{port}",
        args=(str(out), CASES, LAYER_CASE, port),
        config=config(CASES[0]),
        backend="gloo",
        timeout=120,
        join_timeout=1200,
    )
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]


def _layout(case: dict[str, Any]) -> Any:
    return plan(
        WORLD,
        tensor=case["tp"],
        pipeline=case["pp"],
        context=case["cp"],
        expert=case["ep"],
        expert_tensor=case["etp"],
        order=case["order"],
        gtp_remat=case.get("gtp", 1),
        expert_gtp_remat=case.get("egtp", 1),
    )


def _megatron_ranks(case: dict[str, Any], token: str, rank: int, expert: bool = False) -> list[int]:
    """The group of ``rank`` for ``token`` from the installed release's pure RankGenerator
    (dense grid, or the expert grid), with gtp_remat placed as its initialize_model_parallel does.
    On 0.19 the tensor × data tokens span gtp_remat, as its initialize_model_parallel asks."""
    from megatron.core import parallel_state as ps

    gtp = {"gtp_remat": case.get("egtp" if expert else "gtp", 1)} if RELEASE.gtp else {}
    order = case["order"]
    if RELEASE.gtp:
        order = ps._inject_gtp_remat_axis(order, after="ep" if expert else "tp")
        token = {"tp-dp-cp": "tp-gtp_remat-dp-cp", "tp-dp": "tp-gtp_remat-dp"}.get(token, token)
    gtp_size = gtp.get("gtp_remat", 1)
    if expert:
        edp = WORLD // (case["etp"] * case["ep"] * case["pp"] * gtp_size)
        gen = ps.RankGenerator(tp=case["etp"], ep=case["ep"], dp=edp, pp=case["pp"], cp=1, order=order, **gtp)
    else:
        dp = WORLD // (case["tp"] * case["pp"] * case["cp"] * gtp_size)
        gen = ps.RankGenerator(tp=case["tp"], ep=1, dp=dp, pp=case["pp"], cp=case["cp"], order=order, **gtp)
    return next(g for g in gen.get_ranks(token) if rank in g)


@pytest.mark.slow
def test_getters_are_discovered(records: list[dict[str, Any]]) -> None:
    getters, excluded = records[0]["getters"], records[0]["excluded"]
    calls = sum(len(v) for v in getters.values())
    # every getter the bridge is about, found by inspect rather than listed by hand
    for name in (
        "get_tensor_and_data_parallel_group",
        "get_tensor_and_context_parallel_group",
        "get_position_embedding_group",
        "get_amax_reduction_group",
        "get_data_parallel_group_gloo",
        "get_expert_data_parallel_group_gloo",
        "is_pipeline_last_stage",
        "model_parallel_is_initialized",
        "get_intra_distributed_optimizer_instance_group",
        "get_virtual_pipeline_model_parallel_world_size",
    ):
        assert name in getters, name
    n_getters, n_calls = GETTER_COUNTS[RELEASE.version.rsplit(".", 1)[0]]
    assert len(getters) == n_getters, sorted(getters)
    assert calls == n_calls  # every keyword combination
    assert set(excluded) >= {
        "initialize_model_parallel",
        "destroy_model_parallel",
        "set_tensor_model_parallel_rank",
    }
    assert not any(
        name.startswith(("get_", "is_", "has_")) and "required" not in why for name, why in excluded.items()
    )


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
@pytest.mark.slow
def test_every_getter_matches_megatron(records: list[dict[str, Any]], index: int) -> None:
    for rec in records:
        found = rec["cases"][index]
        theirs, ours = found["theirs"], found["ours"]
        assert set(theirs) == set(ours)
        wrong = {k: (theirs[k], ours[k]) for k in theirs if theirs[k] != ours[k]}
        assert not wrong, f"rank {rec['rank']} {CASES[index]['name']}: {len(wrong)} differ: {wrong}"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
@pytest.mark.slow
def test_answers_are_the_real_layout(records: list[dict[str, Any]], index: int) -> None:
    # Two equal mistakes would pass the comparison: tie the answers to the pure layouts.
    case = CASES[index]
    layout = _layout(case)
    for rec in records:
        r, ours = rec["rank"], rec["cases"][index]["ours"]
        M = ParallelMode
        assert ours["get_tensor_model_parallel_group(check_initialized=True)"]["group"] == layout.group_of(
            M.TENSOR, r
        )
        edp = "get_expert_data_parallel_group(check_initialized=True, partial_expert_data_parallel=False)"
        if RELEASE.gtp:  # 0.19: with_gtp_remat=False is the plain expert-data group
            edp = edp.replace("True, ", "True, with_gtp_remat=False, ")
        assert ours[edp]["group"] == layout.group_of(M.EXPERT_DATA, r)
        tdc = "get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=True)"
        assert ours[tdc]["group"] == _megatron_ranks(case, "tp-dp-cp", r)
        tc = "get_tensor_and_context_parallel_group(check_initialized=True)"
        assert ours[tc]["group"] == _megatron_ranks(case, "tp-cp", r)
        first = layout.local_rank(M.PIPELINE, r) == 0
        assert ours["is_rank_in_position_embedding_group()"] is first
        assert ours["is_initialized()"] is True and ours["model_parallel_is_initialized()"] is True
        assert ours["get_virtual_pipeline_model_parallel_world_size()"] == case.get("vpp")


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
@pytest.mark.slow
def test_installed_groups_answer_a_collective(records: list[dict[str, Any]], index: int) -> None:
    case = CASES[index]
    for rec in records:
        r, proofs = rec["rank"], rec["cases"][index]["proofs"]
        for token in ("tp-dp-cp", "tp-dp", "tp-cp"):
            members = _megatron_ranks(case, token, r)
            assert proofs[token] == [int(i in members) for i in range(WORLD)], (r, token)
        if _layout(case).local_rank(ParallelMode.PIPELINE, r) == 0:
            assert proofs["position-embedding"] == [int(i == r) for i in range(WORLD)]
        else:
            assert "position-embedding" not in proofs
        options = case.get("options", {})
        dp_cp = [int(i in _megatron_ranks(case, "dp-cp", r)) for i in range(WORLD)]
        assert proofs.get("dp-cp-gloo", dp_cp) == dp_cp
        # Megatron 0.19 makes no gloo groups with gtp_remat > 1
        gloo = options.get("create_gloo_process_groups", True) and case.get("gtp", 1) == 1
        assert ("dp-cp-gloo" in proofs) is gloo
        if options.get("create_all_gather_group"):
            assert proofs["all-gather"] == dp_cp
        hcp = options.get("hierarchical_context_parallel_sizes", [])
        assert sum(k.startswith("hcp") for k in proofs) == len(hcp)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
@pytest.mark.slow
def test_install_makes_only_the_missing_groups(records: list[dict[str, Any]], index: int) -> None:
    import parallelctx.megatron as bridge

    case = CASES[index]
    layout = _layout(case)
    for rec in records:
        r, found = rec["rank"], rec["cases"][index]
        existing = {tuple(layout.group_of(m, r)) for m in ParallelMode if layout.group_of(m, r)}
        wanted = {tuple(_megatron_ranks(case, t, r)) for t in ("tp-dp-cp", "tp-dp", "tp-cp")}
        if RELEASE.gtp:  # 0.19's groups across gtp_remat
            wanted |= {tuple(_megatron_ranks(case, t, r)) for t in ("gtp_remat-dp", "gtp_remat-dp-cp")}
            wanted |= {
                tuple(_megatron_ranks(case, t, r, expert=True))
                for t in ("gtp_remat-dp", "tp-ep-gtp_remat-pp")
            }
        options = case.get("options", {})
        sizes = options.get("hierarchical_context_parallel_sizes", [])
        cp, dp_cp = layout.group_of(ParallelMode.CONTEXT, r), layout.group_of(ParallelMode.DATA_CONTEXT, r)
        for level in range(len(sizes)):  # Megatron's levels: a reused group where members agree
            wanted |= {tuple(g) for g in bridge.state._hierarchical_rows(cp, sizes, level) if r in g}
        if options.get("hybrid_context_parallel"):
            wanted |= {tuple(g) for rows in bridge.state._hybrid_rows(dp_cp).values() for g in rows if r in g}
        wanted -= existing
        expected = (
            len(wanted) + (0 if (r,) in existing else 1) + int(bool(options.get("create_all_gather_group")))
        )
        assert found["calls"] == expected, (r, found["calls"], wanted)
        assert found["made"] == found["calls"]  # torch's registry grew by exactly that


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
@pytest.mark.slow
def test_uninstall_and_destroy_restore_parallel_state(records: list[dict[str, Any]], index: int) -> None:
    for rec in records:
        restored = rec["cases"][index]["restored"]
        assert restored == {
            "non_pristine": [],
            "installed": False,
            "is_initialized": False,
            "tracker_is_ours": False,
            "created_alive": 0,
        }, (rec["rank"], CASES[index]["name"])


@pytest.mark.slow
def test_megatron_layers_match_serial_torch(records: list[dict[str, Any]]) -> None:
    for rec in records:
        diffs = rec["layer_diffs"]
        assert max(diffs.values()) < 1e-12, (rec["rank"], diffs)
        layout = _layout(LAYER_CASE)
        assert rec["layer_tp_group"] == layout.group_of(ParallelMode.TENSOR, rec["rank"])


@pytest.mark.slow
def test_tracker_dropout_differs_across_tensor_ranks_and_agrees_across_replicas(
    records: list[dict[str, Any]],
) -> None:
    layout = _layout(LAYER_CASE)
    masks = {rec["rank"]: rec["masks"] for rec in records}
    for r in range(WORLD):
        for peer in layout.group_of(ParallelMode.TENSOR, r):
            if peer != r:
                assert masks[r]["tp"] != masks[peer]["tp"]  # shards drop different elements
                assert masks[r]["dp"] == masks[peer]["dp"]  # duplicated weights: same
                assert masks[r]["default"] == masks[peer]["default"]
        for replica in layout.group_of(ParallelMode.DATA, r):
            assert masks[r]["tp"] == masks[replica]["tp"]  # data replicas: same shard masks
    for rec in records:  # Megatron's seeds, reported by gpc
        tp_rank = layout.local_rank(ParallelMode.TENSOR, rec["rank"])
        assert rec["seed_after_manual_seed"] == [4321 + 2718 + tp_rank, 4321]


def _draws(seed: int, n: int = 8) -> list[float]:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
def test_model_parallel_cuda_manual_seed_seeds_the_streams_as_megatron(records: list[dict[str, Any]]) -> None:
    # Draws (3 from the tracker, 3 from gpc's stream, 2 from the tracker again) equal a CPU
    # generator seeded with Megatron's formula: one stream, whichever way it is entered.
    layout = _layout(LAYER_CASE)
    ep_ranks = set()
    for rec in records:
        r = rec["rank"]
        tp = layout.local_rank(ParallelMode.TENSOR, r)
        ep = layout.local_rank(ParallelMode.EXPERT, r)
        etp = layout.local_rank(ParallelMode.EXPERT_TENSOR, r)
        ep_ranks.add((ep, etp))
        assert rec["seeding_ranks"] == {"tp": tp, "ep": ep, "etp": etp}
        for reset in ("reset=False", "reset=True"):
            got = rec["seeding"][reset]
            assert got["tracker_class"] == "GpcRNGTracker", reset
            assert got["tp"] == _draws(1234 + 2718 + tp), (r, reset)
            assert got["ep"] == _draws(1234 + 1024 + 100 * ep + etp), (r, reset)
            assert got["dp"] == _draws(1234), (r, reset)
    assert ep_ranks == {(0, 0), (0, 1), (1, 0), (1, 1)}  # every expert seed was exercised


@pytest.mark.slow
def test_forced_tracker_reset_keeps_gpc_checkpoint_replaying_it(records: list[dict[str, Any]]) -> None:
    for rec in records:
        found = rec["forced_reset_checkpoint"]
        assert found["tracker_class"] == "GpcRNGTracker"
        assert found["grad_nonzero"] > 10  # dropout kept some, dropped some
        assert found["grad_diff"] == 0.0, rec["rank"]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
@pytest.mark.slow
def test_process_groups_equal_use_mpu_process_groups(records: list[dict[str, Any]], index: int) -> None:
    # Every field of the collection, by members, None where Megatron leaves it unset.
    fields = set(RELEASE.fields)  # the installed release's ProcessGroupCollection
    for rec in records:
        found = rec["cases"][index]
        theirs, ours = found["their_collection"], found["our_collection"]
        assert set(theirs) == set(ours) == fields
        wrong = {k: (theirs[k], ours[k]) for k in fields if theirs[k] != ours[k]}
        assert not wrong, f"rank {rec['rank']} {CASES[index]['name']}: {wrong}"
        assert theirs["inter_dist_opt"] is None and theirs["tp"] is not None


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
@pytest.mark.slow
def test_pg_collection_route_leaves_parallel_state_alone(records: list[dict[str, Any]], index: int) -> None:
    case = CASES[index]
    for rec in records:
        r, route = rec["rank"], rec["cases"][index]["route"]
        assert route["changed"] == [] and route["is_initialized"] is False
        assert route["same_object"] is True and route["made_again"] == 0
        # its gloo groups connect on their first collective, as gpc's own (dist.gloo_lazy_init)
        assert route["new_connections"] == 0, f"rank {r} {case['name']}: {route['new_connections']}"
        for token in ("tp_dp_cp", "tp_cp"):  # the groups it made answer a collective
            members = _megatron_ranks(case, token.replace("_", "-"), r)
            assert route[token] == [int(i in members) for i in range(WORLD)]
        assert rec["cases"][index]["collections_after"] == (
            1 if case.get("uninstall_by") == "uninstall" else 0
        )


@pytest.mark.slow
def test_tensor_parallel_checkpoint_recomputes_the_same_masks(records: list[dict[str, Any]]) -> None:
    for rec in records:
        ck = rec["checkpoint"]
        assert ck["calls"] == 3 and ck["masks_equal"], ck
        assert ck["grad_diff"] == 0.0
        assert ck["streams_after_equal"]
        assert "no-such-rng" in rec["unknown_fork"] and "model-parallel-rng" in rec["unknown_fork"]


@pytest.mark.slow
def test_clear_errors(records: list[dict[str, Any]]) -> None:
    for rec in records:
        assert "already installed" in rec["install_twice"] and "uninstall()" in rec["install_twice"]
        assert "launch" in rec["install_before_launch"]
        assert rec["after_destroy_non_pristine"] == []


# --------------------------------------------------------------------------- one process
def test_missing_megatron_names_the_extra() -> None:
    code = "import sys; sys.modules['megatron'] = None\nimport parallelctx.megatron"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0
    assert "pip install 'parallelctx[megatron]'" in done.stderr


def test_other_megatron_globals_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core import parallel_state as ps

    import parallelctx.megatron as bridge

    bridge.check_megatron_version()
    monkeypatch.setattr(ps, "_SOME_NEW_GROUP", None, raising=False)
    with pytest.raises(bridge.MegatronVersionError, match="_SOME_NEW_GROUP"):
        bridge.check_megatron_version()
    monkeypatch.delattr(ps, "_SOME_NEW_GROUP")
    monkeypatch.delattr(ps, "_EMBEDDING_GROUP")
    with pytest.raises(bridge.MegatronVersionError, match="missing.*_EMBEDDING_GROUP"):
        bridge.check_megatron_version()


def test_world_of_one_install_destroy_and_virtual_pipeline_refusal() -> None:
    from megatron.core import parallel_state as ps

    import parallelctx.megatron as bridge
    from parallelctx import gpc

    parallelctx.launch({"seed": 3})
    try:
        with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size=2 needs a pipeline"):
            bridge.install(virtual_pipeline_model_parallel_size=2)
        assert not bridge.is_installed()
        assert bridge.install() == 0  # everything is the default group of a world of one
        assert ps.get_data_parallel_world_size() == 1 and ps.is_rank_in_position_embedding_group()
    finally:
        gpc.destroy()
    assert not bridge.is_installed() and not ps.is_initialized()
    have = bridge.release.detect().globals
    assert all(
        getattr(ps, n) == bridge.release.pristine(n) for n in bridge.release.known_globals() if n in have
    )
    assert bridge.uninstall() is False


def test_migration_doc_lists_every_global_install_sets() -> None:
    import parallelctx.megatron as bridge

    doc = (Path(__file__).resolve().parent.parent / "docs" / "migration.md").read_text()
    section = doc.split("## Keep your Megatron-core model, switch the context", 1)[1]
    for name, source in bridge.sources().items():
        assert f"| `{name}` | {source}" in section, name
    for name, mode in bridge.RNG_STREAMS.items():
        assert f"| `{name}`" in section and f"| `{mode.name}` |" in section


def test_destroy_hooks_run_first_once_and_their_error_surfaces_after_teardown() -> None:
    from parallelctx import NotLaunchedError, gpc

    parallelctx.launch({})
    seen: list[Any] = []

    def hook() -> None:
        seen.append(gpc.get_world_size(ParallelMode.TENSOR))  # groups still there

    def broken() -> None:
        raise KeyError("boom")

    gpc.add_destroy_hook(hook)
    gpc.add_destroy_hook(hook)  # kept once
    gpc.add_destroy_hook(broken)
    with pytest.raises(TypeError, match="function of no arguments"):
        gpc.add_destroy_hook(42)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="boom"):
        gpc.destroy()
    assert seen == [1]
    with pytest.raises(NotLaunchedError):  # the teardown happened despite the failing hook
        gpc.get_global_rank()
    gpc.destroy()  # hooks were forgotten
    assert seen == [1]


def test_install_options_by_megatron_name_are_given_or_refused_with_the_reason() -> None:
    import parallelctx.megatron as bridge
    from parallelctx import gpc

    parallelctx.launch({"seed": 3, "dist": {"timeout": 60}})
    try:
        refused = {
            "num_distributed_optimizer_instances": (2, "replicate x shard"),
            "use_sharp": (True, "SHARP"),
            "sharp_enabled_group": ("dp", "use_sharp"),
            "nccl_communicator_config_path": ("/tmp/nccl.yaml", "communicator options"),
            "high_priority_stream_groups": (["dp_cp"], "stream priority"),
            "pipeline_model_parallel_comm_backend": ("ucc", "'ucc'"),
            "tensor_model_parallel_size": (2, "parallel.tensor=1"),
            "expert_tensor_parallel_size": (2, "parallel.expert.tensor=1"),
            "order": ("tp-pp-dp-cp-ep", None),  # a world of one: every order gives the same groups
            "distributed_timeout_minutes": (30, "dist.timeout"),
            "hybrid_context_parallel": (True, "even number"),
            "hierarchical_context_parallel_sizes": ([2], "multiply to 2"),
            "get_embedding_ranks": (lambda pp: [], "other ranks than Megatron's default"),
        }
        for name, (value, why) in refused.items():
            if why is None:
                bridge.install(**{name: value})
                bridge.uninstall()
                continue
            with pytest.raises(ValueError, match=name) as err:
                bridge.install(**{name: value})
            assert why in str(err.value), (name, str(err.value))
            assert not bridge.is_installed()
        # options some releases have: the sizes checked against gpc, the sub-world ones refused
        extra = {
            "gtp_remat_size": (2, "parallel.gtp_remat=1"),  # 0.19 on
            "expert_gtp_remat_size": (2, "parallel.expert.gtp_remat=1"),  # 0.19 on
            "rank_offset": (4, "sub-world"),  # 0.17 on
            "local_world_size": (4, "whole world"),  # 0.17 on
        }
        for name, (value, why) in extra.items():
            if name not in RELEASE.options:
                continue
            with pytest.raises(ValueError, match=name) as err:
                bridge.install(**{name: value})
            assert why in str(err.value), (name, str(err.value))
        with pytest.raises(TypeError, match="encoder_tensor_model_parallel_size"):
            bridge.install(encoder_tensor_model_parallel_size=1)
        # an option of another release is refused as that release's Megatron refuses it
        all_gather = "create_all_gather_group" in RELEASE.options  # 0.16 and 0.17
        other = "gtp_remat_size" if all_gather else "create_all_gather_group"
        with pytest.raises(TypeError, match=f"{other}.*{RELEASE.version}"):
            bridge.install(**{other: 1})
        accepted = dict(
            gtp_remat_size=1,
            expert_gtp_remat_size=1,
            rank_offset=0,
            local_world_size=1,
            create_all_gather_group=True,
        )
        by_release = {name: value for name, value in accepted.items() if name in RELEASE.options}
        assert (
            len(by_release) == {"0.16": 1, "0.17": 3, "0.18": 2, "0.19": 4}[RELEASE.version.rsplit(".", 1)[0]]
        )
        # Megatron's defaults, and values equal to gpc's, are accepted by name
        bridge.install(
            **by_release,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=1,
            expert_model_parallel_size=1,
            expert_tensor_parallel_size=None,
            num_distributed_optimizer_instances=1,
            distributed_timeout_minutes=1,
            order="tp-cp-ep-dp-pp",
            use_sharp=False,
            high_priority_stream_groups=[],
            get_embedding_ranks=ps_default("default_embedding_ranks"),
            get_position_embedding_ranks=ps_default("default_position_embedding_ranks"),
        )
        from megatron.core import parallel_state as ps

        if all_gather:
            assert ps.has_separate_all_gather_group()
        # Megatron's tracker options: CUDA-graph-safe states are refused by name
        from megatron.core import tensor_parallel

        with pytest.raises(ValueError, match="use_cudagraphable_rng"):
            tensor_parallel.random.initialize_rng_tracker(use_cudagraphable_rng=True, force_reset=True)
    finally:
        gpc.destroy()


def ps_default(name: str) -> Any:
    from megatron.core import parallel_state as ps

    return getattr(ps, name)


def test_manual_seed_draws_on_a_world_of_one_and_reseed_leaves_other_streams() -> None:
    # The path of a Megatron training script on one CPU process: seeding, then dropout on the
    # tracker's stream; the draws are a CPU generator's seeded with Megatron's formula.
    from megatron.core import tensor_parallel

    import parallelctx.megatron as bridge
    from parallelctx import gpc

    parallelctx.launch({"seed": 3})
    try:
        bridge.install()
        start = gpc.get_rng_state()
        with gpc.seed(ParallelMode.PIPELINE):
            before = torch.rand(4)
        tensor_parallel.model_parallel_cuda_manual_seed(77, force_reset_rng=True)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            tp = torch.rand(4)
        with gpc.seed(ParallelMode.TENSOR):
            tp2 = torch.rand(4)
        assert torch.equal(
            torch.cat([tp, tp2]), torch.rand(8, generator=torch.Generator().manual_seed(77 + 2718))
        )
        assert gpc.get_seed(ParallelMode.EXPERT) == 77 + 1024 and gpc.get_seed(ParallelMode.DATA) == 77
        # a stream the tracker does not seed continues where it stopped
        with gpc.seed(ParallelMode.PIPELINE):
            after = torch.rand(4)
        gpc.set_rng_state(start)
        with gpc.seed(ParallelMode.PIPELINE):
            unseeded = torch.rand(8)
        assert torch.equal(torch.cat([before, after]), unseeded)
    finally:
        gpc.destroy()


@pytest.mark.parametrize("backward_under", ["outside", "data"])
def test_megatron_checkpoint_entered_under_the_tracker_replays_its_stream(backward_under: str) -> None:
    # Model code as Megatron writes it: tensor_parallel.checkpoint of a block entered inside
    # get_cuda_rng_tracker().fork(), backward outside it (or under another stream). The gradient
    # must be the one of the same block run without checkpointing.
    from megatron.core import tensor_parallel

    import parallelctx.megatron as bridge
    from parallelctx import gpc

    parallelctx.launch({"seed": 5})
    try:
        bridge.install()
        tensor_parallel.model_parallel_cuda_manual_seed(11)
        tracker = tensor_parallel.get_cuda_rng_tracker()

        def block(x: torch.Tensor) -> torch.Tensor:
            h = torch.nn.functional.dropout(x * 2.0, 0.5, training=True)  # the tracker's stream
            with gpc.seed(ParallelMode.DATA):  # and a nested one
                h = torch.nn.functional.dropout(h, 0.3, training=True)
            return torch.nn.functional.dropout(h, 0.2, training=True) * x  # the tracker's again

        def run(checkpointed: bool) -> torch.Tensor:
            x = torch.ones(64, requires_grad=True)
            with tracker.fork():
                y = tensor_parallel.checkpoint(block, False, x) if checkpointed else block(x)
            if backward_under == "data":
                with gpc.seed(ParallelMode.DATA):
                    y.sum().backward()
            else:
                y.sum().backward()
            assert x.grad is not None
            return x.grad

        start = gpc.get_rng_state()
        plain = run(False)
        after_plain = gpc.get_rng_state()
        gpc.set_rng_state(start)
        assert torch.equal(run(True), plain)
        # and every stream continues as after the plain run
        with tracker.fork():
            mine = torch.rand(8)
        gpc.set_rng_state(after_plain)
        with tracker.fork():
            assert torch.equal(torch.rand(8), mine)
    finally:
        gpc.destroy()


def test_detect_reads_a_patched_initialize_that_cannot_be_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    # detect() caches signatures per function object; a user's wrapper that defines __eq__ (so
    # is unhashable: a dataclass, say) must still be read, and read afresh.
    import dataclasses

    from megatron.core import parallel_state as ps

    import parallelctx.megatron as bridge

    original = ps.initialize_model_parallel

    @dataclasses.dataclass
    class Wrapper:
        calls: int = 0

        def __call__(self, tensor_model_parallel_size: int = 1, **kwargs: object) -> None:
            self.calls += 1
            original(tensor_model_parallel_size, **kwargs)

    monkeypatch.setattr(ps, "initialize_model_parallel", Wrapper())
    assert bridge.release.detect().options == ("tensor_model_parallel_size", "kwargs")
    monkeypatch.undo()
    assert "pipeline_model_parallel_size" in bridge.release.detect().options
