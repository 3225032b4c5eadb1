"""The Megatron bridge for a job of several layouts (``parallel.modules``, docs/modules.md).

One torchrun run of 8 CPU ranks (gloo; tests/megatron_modules_worker.py) launches gpc for each
layout in turn, in the same processes:

- every release: ``process_groups(gpc.module(name))`` for each module, against Megatron's own
  ``initialize_model_parallel`` + ``use_mpu_process_groups()`` (colocated modules span the world)
  or its ``RankGenerator`` on the module's sub-world (``rank_offset``, disjoint modules); the
  groups the bridge made are destroyed by ``gpc.destroy()`` (on a default group gpc adopted,
  which stays) and a collective hung on one ends at ``gpc.abort()`` (the last case);
- megatron-core 0.19 on (``HyperCommGrid`` views, ``MultiModuleProcessGroupCollection``):
  ``multi_module_process_groups()``, ``hyper_comm_grids()``, ``RankRole`` and
  ``manual_seed_ranks()`` against Megatron's MIMO topology on the same layout, field by field, on
  every rank, for a colocated, a disjoint, an expert and a gtp_remat layout, by two references:
  ``wheel`` (always, CI included), the topology of Megatron-LM's
  ``examples/mimo/training/topology.py`` (core_v0.19.0) built from the megatron-core wheel's own
  ``HyperCommGrid`` (with its expert view), ``create_pg`` for each dims combination the example
  creates, and ``parallel_state.default_embedding_ranks`` / ``default_position_embedding_ranks``
  over the grid's pp rows (the example's field -> dims facts restated in the worker), and
  ``create_topology``, the example's own function, where the file is at hand (there the two
  references must agree exactly); and a vision model's output through Megatron's
  ``BridgeCommunicator`` to a 3-stage language model and back under ``forbid_globals()``, against
  a serial run.

Groups are compared by their members as ``torch.distributed.get_process_group_ranks`` gives
them, and each of gpc's is proven by a one-hot all-reduce. The example file comes, first found
first, from ``$MEGATRON_LM_TOPOLOGY`` (the file), ``$MEGATRON_LM`` (a Megatron-LM clone holding
the tag: ``git show core_v0.19.0:examples/mimo/training/topology.py``), ``.cache/megatron-lm/``
or GitHub; without any, the ``create_topology`` cases are skipped, saying so and that the
``wheel`` ones ran. Under megatron-core before 0.19 the MIMO tests are skipped with that reason;
the ``ctx=`` part runs on every release. The in-process tests (a world of one, the grid's rule
against Megatron's own enumeration, the getters refused) are fast.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.hyper_comm_grid import HyperCommGrid

import parallelctx
import parallelctx.megatron as bridge
from parallelctx import LayoutError, NotLaunchedError, gpc, plan
from parallelctx.megatron import release as _release

ROOT = Path(__file__).resolve().parent.parent
RELEASE = _release.detect()
NEXT = hasattr(HyperCommGrid, "register_view")  # 0.19 on
WORLD = 8
TAG = "core_v0.19.0"
TOPOLOGY = "examples/mimo/training/topology.py"
URL = f"https://raw.githubusercontent.com/NVIDIA/Megatron-LM/{TAG}/{TOPOLOGY}"
CTX_CASES = ("ctx_colocated", "ctx_disjoint")
MIMO_CASES = ("colocated", "bridge", "experts", "gtp")

needs_next = pytest.mark.skipif(
    not NEXT,
    reason=f"megatron-core {RELEASE.version} has no HyperCommGrid views nor MultiModuleProcessGroupCollection "
    "(Megatron's MIMO grids, 0.19 on): run `make test-megatron-next`",
)


def _topology_file(tmp: Path) -> Path | str:
    """Megatron-LM's examples/mimo/training/topology.py at core_v0.19.0 (see the module
    docstring), or why there is none (a sentence)."""
    given = os.environ.get("MEGATRON_LM_TOPOLOGY")
    clone = os.environ.get("MEGATRON_LM")
    cached = ROOT / ".cache" / "megatron-lm" / TAG / TOPOLOGY
    if given:
        return Path(given).expanduser()
    if clone:
        shown = subprocess.run(
            ["git", "-C", str(Path(clone).expanduser()), "show", f"{TAG}:{TOPOLOGY}"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if shown.returncode != 0:
            pytest.fail(
                f"MEGATRON_LM={clone!r}: `git show {TAG}:{TOPOLOGY}` failed ({shown.stderr.strip()}); set "
                f"MEGATRON_LM to a Megatron-LM clone holding the tag {TAG}, or unset it",
                pytrace=False,
            )
        target = tmp / "topology.py"
        target.write_text(shown.stdout)
        return target
    if not cached.exists():
        try:
            with urllib.request.urlopen(URL, timeout=30) as response:
                text = response.read().decode()
        except OSError as exc:
            return (
                f"no copy of Megatron-LM's {TOPOLOGY} at {TAG}: MEGATRON_LM (a clone with the tag) and "
                f"MEGATRON_LM_TOPOLOGY (the file) are unset, {cached} does not exist, and GitHub is "
                f"unreachable ({exc})"
            )
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(text)
    return cached


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Path | str:
    """The example file, or why there is none (megatron-core 0.19 on; "-" before)."""
    return _topology_file(tmp_path_factory.mktemp("megatron_lm")) if NEXT else "-"


@pytest.fixture(scope="module")
def records(
    tmp_path_factory: pytest.TempPathFactory, topology: Path | str
) -> dict[str, list[dict[str, Any]]]:
    """Every rank's record of every case, ``{case: [rank 0, ..., rank 7]}``."""
    from torchrun_helpers import run_torchrun

    out = tmp_path_factory.mktemp("megatron_modules")
    cases = list(CTX_CASES)
    if NEXT:
        cases += MIMO_CASES
    cases += ["adopted", "abort"]  # the abort case ends the processes: last
    given = str(topology) if isinstance(topology, Path) else "-"
    proc = run_torchrun(WORLD, ["tests/megatron_modules_worker.py", str(out), given, *cases], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return {
        case: [json.loads((out / f"{case}-rank{r}.json").read_text()) for r in range(WORLD)] for case in cases
    }


def _reference(topology: Path | str, reference: str) -> str:
    """``reference``, after skipping, saying so, the create_topology one without the example file."""
    if reference == "create_topology" and not isinstance(topology, Path):
        pytest.skip(
            f"create_topology not compared: {topology}. The wheel-based reference ran instead (the "
            "[wheel] cases of these tests): Megatron's own HyperCommGrid, create_pg and "
            "default_embedding_ranks / default_position_embedding_ranks from the megatron-core wheel "
            "(tests/megatron_modules_worker.py)"
        )
    return reference


# ------------------------------------------------------------------ process_groups(ctx): every release
@pytest.mark.slow
@pytest.mark.parametrize("case", CTX_CASES)
def test_a_modules_process_groups_equal_megatrons_for_its_layout_on_its_ranks(
    records: dict[str, list[dict[str, Any]]], case: str
) -> None:
    for rank, rec in enumerate(records[case]):
        assert rec["rank"] == rank
        for module, fields in rec["ours"].items():
            assert fields == rec["theirs"][module], (case, rank, module)
            for field, proven in rec["onehot"][module].items():
                assert proven == fields[field], (case, rank, module, field)
        assert rec["bridge_state_after_destroy"] == 0  # gpc.destroy() dropped every entry


@pytest.mark.slow
@pytest.mark.parametrize("case", CTX_CASES)
def test_two_modules_never_share_an_entry_and_plain_gpc_is_its_primary_module(
    records: dict[str, list[dict[str, Any]]], case: str
) -> None:
    for rec in records[case]:
        assert rec["plain_is_primary"] and rec["again_is_same"] and rec["distinct_objects"]
        assert rec["entries"] == sorted(rec["modules"])
        if len(rec["modules"]) == 2:  # colocated: the two modules' data groups differ
            vision, language = rec["ours"]["vision"], rec["ours"]["language"]
            assert vision["dp"] != language["dp"] and vision["pp"] != language["pp"]
    # the one group neither module has a mode for (language's tensor x data, 4 ranks) is made
    # once, on its members; the vision one is the world
    calls = [rec["bridge_new_group_calls"] for rec in records[case]]
    assert calls == ([1] * WORLD if case == "ctx_colocated" else [0] * WORLD)


@pytest.mark.slow
def test_gpc_destroy_destroys_the_groups_the_bridge_made_on_an_adopted_default_group(
    records: dict[str, list[dict[str, Any]]],
) -> None:
    for rank, rec in enumerate(records["adopted"]):
        language = [0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7]  # its tensor x data group
        assert rec["made"] == rec["made_proven"] == [language] and rec["tp_dp_cp"] == language
        assert rec["alive_after_destroy"] == 0 and rec["default_alive"]


@pytest.mark.slow
def test_gpc_abort_ends_a_collective_hung_on_a_group_the_bridge_made(
    records: dict[str, list[dict[str, Any]]],
) -> None:
    first = records["abort"][0]  # rank 1 never joins; rank 0's watchdog aborts after 2 s
    assert first["group"] == [0, 1, 2, 3] and not first["hung"], first
    assert first["raised"] is not None and 1.9 < first["raised"] < 10, first


# ------------------------------------------------------------------ MIMO: megatron-core 0.19 on
# Each MIMO comparison runs against two references of Megatron's (tests/megatron_modules_worker.py):
# "wheel", the example's topology built from the megatron-core wheel's own HyperCommGrid, create_pg
# and embedding-rank functions (always: CI has no Megatron-LM clone), and "create_topology", the
# example file itself (skipped, saying so, where no copy is at hand).
REFERENCES = ("wheel", "create_topology")


def _differences(rec: dict[str, Any], reference: str) -> dict[tuple[str, str], tuple[Any, Any]]:
    """``{(module, field): (ours, the reference's)}`` for every field whose members differ."""
    ours, theirs = rec["ours"], rec["references"][reference]["collection"]
    assert list(ours["modules"]) == list(theirs["modules"]) == rec["modules"]
    assert ours["language"] == theirs["language"]
    out = {}
    for module, facts in ours["modules"].items():
        assert facts["fields"].keys() == theirs["modules"][module]["fields"].keys()
        for field, members in facts["fields"].items():
            if members != theirs["modules"][module]["fields"][field]:
                out[module, field] = (members, theirs["modules"][module]["fields"][field])
        for field, proven in facts["onehot"].items():
            assert proven == facts["fields"][field], (rec["rank"], module, field)
    return out


@pytest.mark.slow
@needs_next
@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("case", ["colocated", "bridge", "experts"])
def test_multi_module_process_groups_equal_megatrons_field_by_field(
    records: dict[str, list[dict[str, Any]]], topology: Path | str, case: str, reference: str
) -> None:
    _reference(topology, reference)
    for rec in records[case]:
        assert _differences(rec, reference) == {}, (case, rec["rank"])
        theirs = rec["references"][reference]["collection"]["modules"]
        for module, facts in rec["ours"]["modules"].items():
            assert facts["set"] == theirs[module]["set"]  # the same attributes set
            assert (
                sum(m is not None for m in theirs[module]["fields"].values()) >= len(bridge.MIMO_FIELDS) + 1
            )
        assert rec["same_object"] and rec["shares_process_groups"]
        assert rec["bridge_state_after_destroy"] == 0
    # the language module's embedding groups, where Megatron puts them
    language = [r for r in records[case] if "language" in r["modules"]]
    assert all(r["ours"]["language"] == "language" for r in language)
    assert any(r["ours"]["modules"]["language"]["fields"]["pos_embd"] for r in language)
    assert all(
        r["ours"]["modules"][m]["fields"]["embd"] is None
        for r in records[case]
        for m in r["modules"]
        if m != "language"
    )


@pytest.mark.slow
@needs_next
@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("case", ["colocated", "bridge", "experts"])
def test_hyper_comm_grids_and_rank_roles_equal_megatrons(
    records: dict[str, list[dict[str, Any]]], topology: Path | str, case: str, reference: str
) -> None:
    _reference(topology, reference)
    for rec in records[case]:
        theirs = rec["references"][reference]
        assert rec["grid_error"] is None
        assert rec["our_grids"] == theirs["grids"], (case, rec["rank"])
        assert rec["our_role"] == theirs["role"]
        for name, grid in rec["our_grids"].items():  # groups on member ranks, None elsewhere
            assert grid["in_grid"] == (name in rec["modules"])
            assert all((members is None) != grid["in_grid"] for members in grid["pgs"].values())


@pytest.mark.slow
@needs_next
@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("case", ["colocated", "bridge", "experts", "gtp"])
def test_manual_seed_ranks_are_the_ranks_megatrons_collection_gives(
    records: dict[str, list[dict[str, Any]]], topology: Path | str, case: str, reference: str
) -> None:
    _reference(topology, reference)
    for rec in records[case]:
        assert rec["seed_ranks"] == rec["references"][reference]["seed_ranks"], (case, rec["rank"])
    # not all zero: the tensor and expert ranks vary across the ranks
    assert {tuple(s.values()) for rec in records[case] for s in rec["seed_ranks"].values()} != {(0, 0, 0)}


@pytest.mark.slow
@needs_next
@pytest.mark.parametrize("reference", REFERENCES)
def test_a_gtp_module_equals_megatrons_sub_world_groups_and_the_grid_refuses_it(
    records: dict[str, list[dict[str, Any]]], topology: Path | str, reference: str
) -> None:
    """Megatron's MIMO grid has no gtp dimension: on the gtp_remat=2 module its ``dp`` spans gtp
    x data (our ``dp_cp_gtp_remat``) and its ``mp`` tensor x pipeline only; every other field
    agrees, and every field agrees with Megatron 0.19's RankGenerator on the module's sub-world
    (what its ``initialize_model_parallel(gtp_remat_size=, rank_offset=)`` builds)."""
    _reference(topology, reference)
    gtp_fields = {
        "tp_ep_pp_with_egtp_remat",
        "dp_cp_gtp_remat",
        "gtp_remat",
        "expt_gtp_remat",
        "expt_dp_gtp_remat",
    }
    for rec in records["gtp"]:
        found = _differences(rec, reference)
        if "language" not in rec["modules"]:
            assert found == {}
            assert "module 'language' has gtp_remat=2" in rec["grid_error"]
            continue
        assert {f for _, f in found} == {"dp", "dp_cp", "intra_dp_cp", "mp"} | gtp_fields
        assert all(theirs is None for (_, f), (_, theirs) in found.items() if f in gtp_fields)
        fields = rec["ours"]["modules"]["language"]["fields"]
        theirs = rec["references"][reference]["collection"]["modules"]["language"]["fields"]
        assert theirs["dp"] == fields["dp_cp_gtp_remat"] and len(fields["gtp_remat"]) == 2
        assert all(fields[f] == members for f, members in rec["rank_generator"].items()), rec["rank"]
        assert "gpc.module('language') has gtp_remat=2" in rec["grid_error"]
        assert "process_groups(gpc.module('language'))" in rec["grid_error"]


@pytest.mark.slow
@needs_next
@pytest.mark.parametrize("case", MIMO_CASES)
def test_the_wheel_reference_is_create_topology(
    records: dict[str, list[dict[str, Any]]], topology: Path | str, case: str
) -> None:
    """Where the example file is at hand, the wheel-based reference (the example's facts restated
    in tests/megatron_modules_worker.py) gives, on every rank, exactly create_topology's fields,
    attributes set, grids, rank role, seed ranks and number of new_group calls."""
    _reference(topology, "create_topology")
    for rec in records[case]:
        wheel, theirs = (
            {k: v for k, v in rec["references"][r].items() if k != "s"} for r in ("wheel", "create_topology")
        )
        assert wheel == theirs, (case, rec["rank"])


@pytest.mark.slow
@needs_next
@pytest.mark.parametrize("reference", REFERENCES)
def test_the_field_comparison_fails_on_a_swapped_field_or_another_modules_group(
    records: dict[str, list[dict[str, Any]]], topology: Path | str, reference: str
) -> None:
    """The comparison is not vacuous: our record with two fields swapped, or with a field holding
    the other module's group, differs from Megatron's in exactly those fields."""
    _reference(topology, reference)
    for rec in records["colocated"]:  # both modules on every rank
        fields = rec["ours"]["modules"]["language"]["fields"]
        vision = rec["ours"]["modules"]["vision"]["fields"]
        for mutate, expected in (
            ({"tp": fields["dp"], "dp": fields["tp"]}, {"tp", "dp"}),
            ({"pp": vision["pp"]}, {"pp"}),
            ({"dp": vision["dp"]}, {"dp"}),
        ):
            bad = copy.deepcopy(rec)
            bad["ours"]["modules"]["language"]["fields"].update(mutate)
            bad["ours"]["modules"]["language"]["onehot"].update(mutate)
            assert {f for _, f in _differences(bad, reference)} == expected, (rec["rank"], mutate)


@pytest.mark.slow
@needs_next
def test_vision_through_the_bridge_communicator_to_the_language_model_equals_serial(
    records: dict[str, list[dict[str, Any]]],
) -> None:
    runs = records["bridge"]
    for rec in runs:
        result = rec["bridge"]
        diffs = [v for k, v in result.items() if k in ("wv", "w1", "w2", "loss")]
        assert diffs and max(abs(d) for d in diffs) < 1e-12, (rec["rank"], result)
        assert rec["bridge_pg"] == ([0, 1, 2] if rec["rank"] in (0, 1, 2) else None)
        assert rec["refused_getters"] > 40 and rec["getter_restored"]
        assert "use_mpu_process_groups" in rec["forbid_construction"]
        # megatron-core 0.19.2's ColumnParallelLinear reads the gtp group from parallel_state
        # when it is built, even with tp_group= given: built outside, it runs inside
        assert "tensor_parallel/layers.py" in rec["forbid_construction_with_tp_group"]
    assert [r["bridge"].get("activation_rows") for r in runs[:2]] == [[2, 3, 8]] * 2  # each vision replica
    assert [r["bridge"].get("received_rows") for r in runs[2:4]] == [[4, 3, 8]] * 2  # the whole batch
    assert [r["bridge"]["stage"] for r in runs[2:]] == [0, 0, 1, 1, 2, 2]
    assert all("loss" in r["bridge"] for r in runs[6:])


@pytest.mark.slow
@needs_next
@pytest.mark.parametrize("case", ["colocated", "bridge", "experts"])
def test_gpc_makes_a_fraction_of_the_groups_create_topology_makes(
    records: dict[str, list[dict[str, Any]]], case: str
) -> None:
    """Every rank takes part in every group creation of create_topology (new_group without local
    synchronization, members or not): the wheel-based reference makes the same calls (equal where
    the example file is at hand, test_the_wheel_reference_is_create_topology), docs/modules.md's
    count; gpc makes only the rank's own groups."""
    for rec in records[case]:
        ours = rec["gpc_new_group_calls"] + rec["bridge_new_group_calls"]
        theirs = rec["references"]["wheel"]["new_group_calls"]
        assert ours <= 8 and theirs == {"colocated": 122, "bridge": 81, "experts": 86}[case], rec


# ------------------------------------------------------------------ in-process
@needs_next
def test_the_grid_holds_a_layout_exactly_when_megatrons_enumeration_gives_gpcs_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """For many sizes and orders, Megatron's own HyperCommGrid (dims tp, cp, dp, pp and the
    expert view) enumerates each dim's groups as gpc's layout does exactly when
    check_expressible accepts the layout; a refusal names the order and the dim."""
    from parallelctx.megatron.grid import DENSE_DIMS, EXPERT_DIMS, check_expressible

    monkeypatch.setenv("WORLD_SIZE", "64")  # HyperCommGrid asks the world size
    orders = (
        "tp-cp-ep-dp-pp",
        "tp-cp-ep-pp-dp",
        "tp-pp-dp",
        "pp-tp-cp-ep-dp",
        "cp-tp-ep-dp-pp",
        "ep-tp-cp-dp-pp",
    )
    outcomes = {True: 0, False: 0}
    for world, offset, tp, pp, cp, ep, etp, order in itertools.product(
        (8, 16), (0, 4), (1, 2), (1, 2), (1, 2), (1, 2), (1, 2), orders
    ):
        try:
            layout = plan(
                world, tensor=tp, pipeline=pp, context=cp, expert=ep, expert_tensor=etp, order=order
            )
        except LayoutError:
            continue
        layout = parallelctx.Layout(**{**_args(layout), "offset": offset})
        grid = HyperCommGrid([tp, cp, layout.data, pp], list(DENSE_DIMS), rank_offset=offset)
        grid.register_view("expert", [etp, ep, layout.expert_data, pp], list(EXPERT_DIMS), shared_dims=["pp"])
        same = all(
            sorted(map(sorted, grid.get_rank_enum(dim, view=view))) == layout.axes_groups(kind, [token])
            for view, kind, pairs in (
                (None, "dense", zip(DENSE_DIMS, ("tp", "cp", "dp", "pp"))),
                ("expert", "expert", zip(EXPERT_DIMS, ("tp", "ep", "dp", "pp"))),
            )
            for dim, token in pairs
        )
        try:
            check_expressible("module 'x'", layout)
            accepted = True
        except LayoutError as exc:
            accepted = False
            assert f"order={order!r}" in str(exc) and "module 'x'" in str(exc), str(exc)
        assert accepted == same, (world, offset, tp, pp, cp, ep, etp, order)
        outcomes[accepted] += 1
    assert outcomes[True] > 50 and outcomes[False] > 50, outcomes
    with pytest.raises(LayoutError, match="gtp_remat=2.*no gtp_remat axis.*process_groups"):
        check_expressible("gpc.module('language')", plan(8, gtp_remat=2))


def _args(layout: Any) -> dict[str, Any]:
    names = ("world_size", "tensor", "pipeline", "context", "expert", "expert_tensor", "order")
    return {n: getattr(layout, n) for n in names}


def test_forbid_globals_refuses_the_ratchets_getters_wherever_they_are_held_and_restores_them() -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import layers

    names = bridge.forbidden_getters()
    for name in (
        "get_tensor_model_parallel_group",
        "get_data_parallel_rank",
        "get_pipeline_model_parallel_world_size",
    ):
        assert name in names
    for name in ("get_global_memory_buffer", "get_virtual_pipeline_model_parallel_rank", "is_initialized"):
        assert name not in names
    # every other get_ function of parallel_state is one Megatron's ratchet leaves alone
    others = {
        n
        for n, f in vars(ps).items()
        if n.startswith("get_") and getattr(f, "__module__", None) == ps.__name__ and n not in names
    }
    assert all(
        n in bridge.forbid.NOT_DEPRECATED or not n.endswith(bridge.forbid.DEPRECATED_SUFFIXES) for n in others
    )
    before = {n: getattr(ps, n) for n in names}
    held = layers.get_tensor_model_parallel_rank  # imported by name in Megatron's layers
    with bridge.forbid_globals() as refused, bridge.forbid_globals():
        assert refused == names
        for name in names:
            with pytest.raises(bridge.MegatronGlobalsError, match=f"parallel_state.{name}\\(\\) reads"):
                getattr(ps, name)()
        with pytest.raises(
            bridge.MegatronGlobalsError, match="get_tensor_model_parallel_rank.*pg_collection="
        ):
            layers.get_tensor_model_parallel_rank()
        with pytest.raises(
            bridge.MegatronGlobalsError, match="use_mpu_process_groups.*test_megatron_modules.py"
        ):
            ProcessGroupCollection.use_mpu_process_groups()
    assert layers.get_tensor_model_parallel_rank is held  # the outer exit restored
    with pytest.raises(ZeroDivisionError), bridge.forbid_globals():
        1 / 0
    assert {n: getattr(ps, n) for n in names} == before
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    assert isinstance(
        ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"]), ProcessGroupCollection
    )


def test_a_world_of_one_with_two_modules() -> None:
    """Bad arguments, the caches, the grid's rules and the collection on one rank (two colocated
    modules), in-process; the multi-rank truths are the torchrun tests above."""
    with pytest.raises(NotLaunchedError, match="process_groups"):
        bridge.process_groups()
    parallelctx.launch(
        dict(parallel=dict(modules=dict(vision=dict(ranks=1), language=dict(colocated_with="vision"))))
    )
    try:
        vision, language = gpc.module("vision"), gpc.module("language")
        with pytest.raises(LayoutError, match="global rank 0, which runs modules vision, language"):
            bridge.install()  # parallel_state holds one layout: the other model would read it
        assert not bridge.is_installed()
        with pytest.raises(TypeError, match="ctx=gpc or ctx=gpc.module"):
            bridge.process_groups("vision")  # type: ignore[arg-type]
        ours = bridge.process_groups(vision)
        assert ours is not bridge.process_groups(
            language
        ) and bridge.process_groups() is bridge.process_groups(language)
        assert dist.get_process_group_ranks(ours.tp) == [0]
        assert bridge.manual_seed_ranks(vision) == {"tp_rank": 0, "ep_rank": 0, "etp_rank": 0}
        if not NEXT:
            with pytest.raises(bridge.MegatronVersionError, match="0.19 or later"):
                bridge.hyper_comm_grid(vision)
            with pytest.raises(bridge.MegatronVersionError, match="0.19 or later"):
                bridge.multi_module_process_groups()
            return
        grid = bridge.hyper_comm_grid(vision)
        assert grid is bridge.hyper_comm_grids()["vision"] and grid is not bridge.hyper_comm_grid(language)
        assert grid.get_pg("tp") is vision.get_group("tensor")  # gpc's own group, no second one
        assert grid.get_pg("ep", view="expert") is vision.get_group("expert")
        assert grid.get_pg("pp", view="expert") is grid.get_pg("pp")  # a shared dim: the base view's
        with pytest.raises(KeyError, match="already in this grid"):
            grid.create_pg("tp")
        with pytest.raises(TypeError, match="pg_options=.*gpc's timeout"):
            grid.create_pg(["cp", "pp"], pg_options=None)
        assert dist.get_process_group_ranks(grid.create_pg(["cp", "pp"])) == [0]
        with pytest.raises(KeyError, match="hasn't been created"):
            grid.get_pg(["cp", "tp", "pp"])
        with pytest.raises(ValueError, match="'ep' is not in view 'base'"):
            grid.get_pg("ep")
        grid.destroy()
        with pytest.raises(KeyError):
            grid.get_pg("tp")
        assert bridge.hyper_comm_grid(vision) is not grid  # a new grid on the same groups
        multi = bridge.multi_module_process_groups()
        assert (
            list(multi.module_pgs) == ["vision", "language"]
            and multi.language_model_module_name == "language"
        )
        assert multi.module_pgs["vision"].embd is None and multi.module_pgs["language"].embd is not None
        assert multi is bridge.multi_module_process_groups()
    finally:
        gpc.destroy()
    assert not bridge._sources and not bridge._collections and not bridge._grids and not bridge._multi
    parallelctx.launch({"seed": 3})
    try:
        if NEXT:
            with pytest.raises(LayoutError, match="needs parallel.modules"):
                bridge.multi_module_process_groups()
            with pytest.raises(LayoutError, match="needs parallel.modules"):
                bridge.hyper_comm_grids()
            grid = bridge.hyper_comm_grid()  # a job without modules: gpc's one layout
            assert (grid.shape, grid.rank_offset) == ([1, 1, 1, 1], 0) and grid.get_pg("dp") is gpc.get_group(
                "data"
            )
        assert dist.get_process_group_ranks(bridge.process_groups(gpc).dp) == [0]
    finally:
        gpc.destroy()


def test_manual_seed_ranks_refuses_a_rank_argument_it_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def seeded(seed: int, tp_rank: int | None = None, gtp_rank: int | None = None) -> None: ...

    parallelctx.launch({"seed": 3})
    try:
        monkeypatch.setattr(mrandom, "model_parallel_cuda_manual_seed", seeded)
        with pytest.raises(bridge.MegatronVersionError, match="gtp_rank"):
            bridge.manual_seed_ranks()
    finally:
        gpc.destroy()
