"""One job, several layouts (``parallel.modules``, issue 37): the config's rules, each module's
layout on its own ranks, its groups proven by collectives on 8 real gloo processes, its seeds by
the numbers drawn, and a job without modules making what it made before (a recording of the
release before modules, tests/fixtures/no_modules_before.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import parallelctx
from parallelctx import Config, NotLaunchedError, ParallelMode, gpc, plan
from parallelctx.config import ConfigValidationError
from parallelctx.planning.covering import covering_ranks
from parallelctx.planning.layout import LayoutError
from parallelctx.planning.modules import MAX_MODULES, ModulePlan
from parallelctx.runtime.mesh import mesh_plan
from parallelctx.runtime.seed import STREAM_SLOTS, STREAMS, mode_seed, stream_slot

HERE = Path(__file__).resolve().parent
WORLD = 8
DISJOINT = dict(vision=dict(ranks=2), language=dict(ranks=6, tensor=2, pipeline=3))
COLOCATED = dict(
    language=dict(ranks=8, tensor=2, pipeline=2), vision=dict(colocated_with="language", tensor=2)
)
EXPERTS = dict(
    vision=dict(ranks=4, tensor=2), language=dict(ranks=4, expert=dict(size=2, tensor=1), tensor=2)
)
THREE = dict(
    draft=dict(ranks=2, offset=6),
    language=dict(ranks=6, tensor=2, pipeline=3),
    vision=dict(colocated_with="language", tensor=3),
)
LAYOUTS = [dict(modules=m) for m in (DISJOINT, COLOCATED, EXPERTS, THREE)]


def _plan(modules: dict[str, Any], world: int = WORLD) -> ModulePlan:
    return Config(dict(parallel=dict(modules=modules))).parallel.module_plan(world)


# ----------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    ("modules", "says"),
    [
        (
            dict(v=dict(ranks=2), l=dict(ranks=6, offset=1)),
            ["'v' holds ranks 0-1", "'l' ranks 1-6", "colocated_with"],
        ),
        (dict(v=dict(ranks=2), l=dict(ranks=5, offset=3)), ["ranks 2-2 to no module"]),
        (dict(v=dict(ranks=2), l=dict(ranks=6, tensor=4)), ["parallel.modules.l", "tensor=4", "ranks=6"]),
        (dict(v=dict(tensor=2)), ["parallel.modules.v has neither ranks nor colocated_with"]),
        (dict(v=dict(ranks=2, colocated_with="x")), ["colocated_with='x' names no other module", "'v'"]),
        (dict(v=dict(ranks=2, tensr=2)), ["unknown key 'tensr'", "did you mean 'tensor'"]),
        (
            dict(a=dict(ranks=4), b=dict(colocated_with="a", ranks=2)),
            ["parallel.modules.b.ranks=2", "colocated with 'a'"],
        ),
        (dict(a=dict(colocated_with="b"), b=dict(colocated_with="a")), ["circle"]),
        (dict(a=dict(ranks=4, language=True), b=dict(colocated_with="a", language=True)), ["language=True"]),
        (dict(a=dict(ranks=4, data=3)), ["parallel.modules.a.data=3", "a.ranks=4"]),
        ({f"m{i}": dict(ranks=1) for i in range(MAX_MODULES + 1)}, [f"at most {MAX_MODULES}"]),
        ({}, ["parallel.modules is empty"]),
        ({"": dict(ranks=2)}, ["module name ''"]),
        ({"a:b": dict(ranks=2)}, ["module name 'a:b'", "without ':'"]),
        (dict(a=dict(ranks=1, offset=1), b=dict(ranks=2)), ["'b' ranks 0-1", "defaulted", "b=0"]),
    ],
)
def test_a_bad_modules_section_is_refused_naming_the_module_and_the_fix(
    modules: Any, says: list[str]
) -> None:
    with pytest.raises(ConfigValidationError) as err:
        Config(dict(parallel=dict(modules=modules)))
    for words in says:
        assert words in str(err.value)


def test_sizes_beside_modules_are_refused() -> None:
    with pytest.raises(ConfigValidationError, match="parallel.tensor is given beside parallel.modules"):
        Config(dict(parallel=dict(tensor=2, modules=DISJOINT)))


def test_a_modules_config_survives_pickle_dicts_and_files(tmp_path: Path) -> None:
    import pickle

    modules = dict(
        vision=dict(ranks=2, tensor=dict(size=1, note=3)), language=dict(ranks=6, tensor=2, pipeline=3)
    )
    cfg = Config(dict(parallel=dict(modules=modules)))
    for again in (pickle.loads(pickle.dumps(cfg)), Config(cfg.to_dict())):
        assert again.parallel == cfg.parallel
        assert again.parallel.module_plan(8) == cfg.parallel.module_plan(8)
        assert again.parallel.modules["vision"].tensor.note == 3
    (tmp_path / "m.toml").write_text(
        "[parallel.modules.vision]\nranks = 2\n[parallel.modules.language]\nranks = 6\ntensor = 2\npipeline = 3\n"
    )
    assert Config.from_file(tmp_path / "m.toml").parallel.module_plan(8) == cfg.parallel.module_plan(8)


def test_the_modules_must_cover_the_launched_world() -> None:
    par = Config(dict(parallel=dict(modules=DISJOINT))).parallel
    with pytest.raises(LayoutError, match="cover ranks 0-7 .8 ranks. but world_size=16"):
        par.module_plan(16)
    with pytest.raises(LayoutError, match="module_plan"):  # never one silent whole-job layout
        par.to_layout(8)


def test_each_module_lies_on_its_own_ranks() -> None:
    p = _plan(THREE)
    assert p.names == ("draft", "language", "vision") and p.language == "language"
    assert [(p.layouts[n].offset, p.layouts[n].world_size) for n in p] == [(6, 2), (0, 6), (0, 6)]
    assert p.of_rank(0) == ("language", "vision") and p.primary(0) == "language"
    assert p.of_rank(7) == ("draft",) and p.primary(7) == "draft"
    assert "vision: pipeline stage 0" not in p.where(0) and "language: pipeline stage 0" in p.where(0)
    with pytest.raises(LayoutError, match="rank=8 is outside"):
        p.of_rank(8)


@pytest.mark.parametrize("offset", [0, 3, 40])
def test_a_layout_with_an_offset_is_the_same_layout_on_other_ranks(offset: int) -> None:
    base = plan(24, tensor=2, pipeline=3, expert=2, expert_tensor=1)
    moved = plan(24, tensor=2, pipeline=3, expert=2, expert_tensor=1).__class__(
        24, tensor=2, pipeline=3, expert=2, expert_tensor=1, offset=offset
    )
    assert moved.ranks == range(offset, offset + 24)
    for mode in ParallelMode:
        assert moved.groups(mode) == [[r + offset for r in g] for g in base.groups(mode)], mode
        for rank in range(24):
            assert moved.group_of(mode, rank + offset) == [r + offset for r in base.group_of(mode, rank)]
    for rank in range(24):
        assert moved.coords(rank + offset) == base.coords(rank)
        assert mode_seed(moved, rank + offset, "tensor", 7) == mode_seed(base, rank, "tensor", 7)
    assert (mesh_plan(moved).ranks == mesh_plan(base).ranks + offset).all()
    assert covering_ranks(moved) == [r + offset for r in covering_ranks(base)]
    if offset:
        with pytest.raises(LayoutError, match=f"outside this layout's ranks \\[{offset}, {offset + 24}\\)"):
            moved.group_of("tensor", offset - 1)


def test_every_stream_of_every_module_has_its_own_seed_slot() -> None:
    slots = [stream_slot(key, module) for module in range(MAX_MODULES) for key in STREAMS]
    assert len(set(slots)) == len(slots) and max(slots) < 256
    assert [stream_slot(key, 0) for key in STREAMS] == [STREAM_SLOTS[key] for key in STREAMS]
    with pytest.raises(ValueError, match="at most 10 modules"):
        stream_slot(ParallelMode.TENSOR, MAX_MODULES)


# ----------------------------------------------------------------------------- a job without modules
GOLDEN = json.loads((HERE / "fixtures" / "no_modules_before.json").read_text())


def test_a_job_without_modules_makes_what_it_made_before_simulated() -> None:
    sys.path.insert(0, str(HERE))
    try:
        from modules_golden import record_simulated
    finally:
        sys.path.remove(str(HERE))
    for key, before in GOLDEN["simulated"].items():
        world, rank = map(int, key.split("/"))
        assert record_simulated(world, rank) == before, key


def _torchrun(script: str, out: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 8 tests/<script> <out>``, finished."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", str(WORLD), str(HERE / script), str(out)]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_a_job_without_modules_makes_what_it_made_before_under_torchrun(tmp_path: Path) -> None:
    done = _torchrun("modules_golden.py", tmp_path, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(WORLD):
        now = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert now == GOLDEN["torchrun"][str(rank)], rank


# ----------------------------------------------------------------------------- 8 real processes
def _membership(group: Any) -> list[int]:
    """The global ranks of ``group``, measured: a one-hot all-reduce over it."""
    hot = torch.zeros(dist.get_world_size())
    hot[dist.get_rank()] = 1.0
    dist.all_reduce(hot, group=group)
    return [r for r, v in enumerate(hot.tolist()) if v == 1.0]


@pytest.mark.parallel(world_size=WORLD, layouts=LAYOUTS)
def test_each_modules_groups_are_proven_by_collectives(parallel_layout: dict[str, Any]) -> None:
    p = _plan(parallel_layout["modules"])
    rank = gpc.get_global_rank()
    assert gpc.modules == p.of_rank(rank)
    for name in gpc.modules:
        ctx = gpc.module(name)
        layout = p.layouts[name]
        assert ctx.layout == layout
        for mode in ParallelMode:
            expected = layout.group_of(mode, rank)
            if not expected:
                assert not ctx.is_initialized(mode)
                continue
            assert ctx.get_ranks_in_group(mode) == expected, (name, mode)
            assert ctx.get_local_rank(mode) == expected.index(rank)
            assert _membership(ctx.get_group(mode)) == expected, (name, mode)
            assert _membership(ctx.get_cpu_group(mode)) == expected, (name, mode)
        assert ctx.world.ranks == list(layout.ranks)
        assert ctx.get_global_rank() == rank
    primary = p.primary(rank)
    assert gpc.layout == p.layouts[primary] and gpc.get_group("tensor") is gpc.module(primary).get_group(
        "tensor"
    )
    assert f"module {primary} of {', '.join(gpc.modules)}" in gpc.summary()
    for other in set(p.names) - set(gpc.modules):
        with pytest.raises(LayoutError, match=f"global rank {rank} is not in module '{other}'"):
            gpc.module(other)
    with pytest.raises(LayoutError, match="no module 'nope'"):
        gpc.module("nope")
    with pytest.raises(RuntimeError, match="answers queries only"):
        gpc.module(primary).destroy()


@pytest.mark.parallel(world_size=WORLD, modules=COLOCATED)
def test_colocated_modules_draw_distinct_streams_and_one_state_saves_them_all() -> None:
    vision, language = gpc.module("vision"), gpc.module("language")
    streams = ("tensor", "data", "pipeline", "replica", "global")
    draws: dict[tuple[str, str], list[float]] = {}
    for name, ctx in (("vision", vision), ("language", language)):
        for s in streams:
            with ctx.seed(s):
                draws[name, s] = torch.rand(3).tolist()
    values = [tuple(v) for v in draws.values()]
    assert len(set(values)) == len(values)  # no stream of the rank repeats another's numbers
    # the same stream agrees across the ranks its axes say it should: vision's tensor stream
    # differs along vision's tensor axis and nowhere else
    every: list[Any] = [None] * WORLD
    dist.all_gather_object(
        every, (gpc.get_global_rank(), draws["vision", "tensor"], draws["language", "tensor"])
    )
    for rank, v, lang in every:
        for rank2, v2, lang2 in every:
            vt = vision.layout.coords(rank)["tp"] == vision.layout.coords(rank2)["tp"]
            lt = [language.layout.coords(r)[k] for r in (rank,) for k in ("tp", "pp")] == [
                language.layout.coords(rank2)[k] for k in ("tp", "pp")
            ]
            assert (v == v2) == vt and (lang == lang2) == lt
    # one state holds every module's streams: a resume draws what an uninterrupted run draws
    state = gpc.get_rng_state()
    with vision.seed("tensor"):
        ahead = torch.rand(2).tolist()
    with language.seed("tensor"):
        ahead_l = torch.rand(2).tolist()
    gpc.set_rng_state(state)
    with vision.seed("tensor"):
        assert torch.rand(2).tolist() == ahead
    with language.seed("tensor"):
        assert torch.rand(2).tolist() == ahead_l
    assert vision.get_seed("tensor") != language.get_seed("tensor")


@pytest.mark.parallel(world_size=WORLD, modules=DISJOINT)
def test_module_contexts_follow_gpcs_launches(tmp_path: Path) -> None:
    rank = gpc.get_global_rank()
    mine = gpc.module(gpc.modules[0])
    assert mine is gpc.module(gpc.modules[0])
    config, group = gpc.config, mine.get_group("data")
    gpc.destroy()
    with pytest.raises(NotLaunchedError):
        mine.get_group("data")
    with pytest.raises(NotLaunchedError):
        gpc.module("vision")
    parallelctx.launch(
        config, rank=rank, world_size=WORLD, local_rank=rank, init_method=f"file://{tmp_path}/rendezvous"
    )
    assert mine.get_group("data") is not group
    assert _membership(mine.get_group("data")) == gpc.module(gpc.modules[0]).get_ranks_in_group("data")
    assert gpc.get_global_rank() == rank


@pytest.mark.parallel(world_size=WORLD, modules=DISJOINT)
def test_a_kept_module_context_says_when_a_relaunch_left_the_rank_out(tmp_path: Path) -> None:
    # A relaunch that moves vision to ranks 6-7: a query kept from gpc.module("vision") on ranks
    # 0-1 said "not available yet: call parallelctx.launch..." though gpc was launched.
    rank = gpc.get_global_rank()
    config = gpc.config
    vision = gpc.module("vision") if "vision" in gpc.modules else None
    world_size = vision.get_world_size if vision is not None else None
    moved = dict(language=dict(ranks=6, tensor=2, pipeline=3), vision=dict(ranks=2))
    gpc.destroy()
    try:
        parallelctx.launch(
            {**config.to_dict(), "parallel": {"modules": moved}},
            rank=rank,
            world_size=WORLD,
            local_rank=rank,
            init_method=f"file://{tmp_path}/moved",
        )
        if world_size is not None:
            with pytest.raises(
                LayoutError,
                match=r"get_world_size\(\): global rank [01] is not in module 'vision' \(ranks 6-7\)",
            ):
                world_size("data")
    finally:
        gpc.destroy()
        parallelctx.launch(
            config, rank=rank, world_size=WORLD, local_rank=rank, init_method=f"file://{tmp_path}/back"
        )
    if world_size is not None:
        assert world_size("data") == gpc.module("vision").get_world_size("data") == 2


@pytest.mark.parallel(
    world_size=WORLD,
    modules=dict(vision=dict(ranks=4, data=dict(replicate=2)), language=dict(ranks=4, tensor=2)),
    local=True,
)
def test_a_modules_device_meshes_lie_on_its_own_ranks() -> None:
    pytest.importorskip("torchtitan")
    from parallelctx.torchtitan import parallel_dims

    (name,) = gpc.modules
    ctx = gpc.module(name)
    assert ctx.device_mesh.mesh.flatten().tolist() == mesh_plan(ctx.layout).ranks.flatten().tolist()
    assert sorted(ctx.device_mesh.mesh.flatten().tolist()) == list(ctx.layout.ranks)
    dims = parallel_dims(ctx=ctx)
    for dim, mode in (("tp", "tensor"), ("dp_shard", "data_shard"), ("dp_replicate", "data_replicate")):
        if ctx.get_world_size(mode) > 1:
            assert dist.get_process_group_ranks(dims.get_mesh(dim).get_group()) == ctx.get_ranks_in_group(
                mode
            )
            assert _membership(dims.get_mesh(dim).get_group()) == ctx.get_ranks_in_group(mode)


@pytest.mark.faults
@pytest.mark.timeout(300)
def test_a_hang_on_another_modules_group_is_reported(tmp_path: Path) -> None:
    done = _torchrun("torchrun_modules_hang.py", tmp_path, 240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    for row in rows:
        assert "module language of language, vision" in row["primary"]
        if row["rank"] in (1, 5, 7):
            (report,) = row["reports"]
            assert (report["mode"], report["op"], report["missing"]) == ("data", "all_reduce", [3]), report
            # vision's data group (language's holding rank 1 is [1, 3]): the module's, not gpc's
            assert "on the data group (ranks 1, 3, 5, 7): rank 3 never entered it" in report["text"], report
            assert row["raised"]
        else:
            assert row["reports"] == [], row


@pytest.mark.parallel(world_size=WORLD, modules=COLOCATED, local=True)
def test_activation_checkpointing_replays_a_modules_streams() -> None:
    from parallelctx.checkpoint import checkpoint

    vision, language = gpc.module("vision"), gpc.module("language")
    w = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def block(x: torch.Tensor) -> torch.Tensor:
        with vision.seed("tensor"):  # dropout on vision's stream inside the region
            keep = (torch.rand(x.shape) >= 0.5).to(x.dtype)
        with language.seed("tensor"):
            keep = keep * (torch.rand(x.shape) >= 0.25).to(x.dtype)
        return (x @ w) * keep

    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    state = gpc.get_rng_state()
    plain = block(x)
    plain.sum().backward()
    want, after = x.grad.clone(), gpc.get_rng_state()
    x.grad = None
    gpc.set_rng_state(state)
    with vision.seed("data"):  # the region runs inside another module stream
        got = checkpoint(block, x, use_reentrant=False)
    got.sum().backward()  # recomputed outside it
    torch.testing.assert_close(got, plain, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)
    with vision.seed("tensor"):  # every stream is where the run without checkpointing left it
        a = torch.rand(3)
    gpc.set_rng_state(after)
    with vision.seed("tensor"):
        assert torch.equal(a, torch.rand(3))


# ----------------------------------------------------------------------------- what a skeptic found
PIPES = dict(language=dict(ranks=8, pipeline=8), vision=dict(colocated_with="language", pipeline=4))


@pytest.mark.parallel(world_size=WORLD, modules=PIPES, local=True)
def test_colocated_pipelines_of_different_lengths_make_embedding_groups_that_meet() -> None:
    # language's embedding group [0, 7] is made on its ends only; vision's [0, 6] then met under
    # two names (rank 6, a middle stage of language, held one group fewer): a hang
    for name in gpc.modules:
        ctx = gpc.module(name)
        if ctx.is_initialized("embedding"):
            assert _membership(ctx.get_group("embedding")) == ctx.get_ranks_in_group("embedding")
    # every rank holds as many groups as the others: a later group across stages meets too
    counts: list[Any] = [None] * WORLD
    dist.all_gather_object(counts, len(dist.distributed_c10d._world.pg_names))
    assert len(set(counts)) == 1, counts
    across = (
        dist.new_group([0, 1, 2, 3], use_local_synchronization=True) if gpc.get_global_rank() < 4 else None
    )
    if across is not None:
        assert _membership(across) == [0, 1, 2, 3]


@pytest.mark.parallel(world_size=WORLD, modules=DISJOINT, local=True)
def test_the_step_methods_count_every_rank_of_the_job_on_the_node() -> None:
    # run_local launches by the InternLM steps, whose host names come from an all-gather: it
    # went over the primary module's ranks, and ranks 6, 7 took node 1, local ranks 0, 1
    assert list(gpc.hostnames) == [gpc.hostnames[0]] * WORLD
    assert gpc.num_processes_on_current_node == WORLD and gpc.num_nodes == 1 and gpc.node_rank == 0
    assert gpc.local_rank == gpc.get_global_rank()


@pytest.mark.parallel(world_size=WORLD, modules=COLOCATED, local=True)
def test_a_non_primary_modules_stream_nests_in_itself() -> None:
    vision = gpc.module("vision")
    state = gpc.get_rng_state()
    with vision.seed("tensor"):
        flat = [torch.rand(2).tolist() for _ in range(3)]
    gpc.set_rng_state(state)
    with vision.seed("tensor"):
        a = torch.rand(2).tolist()
        with vision.seed("tensor"):  # the same stream: it goes on, never repeats
            b = torch.rand(2).tolist()
        c = torch.rand(2).tolist()
    assert [a, b, c] == flat


@pytest.mark.parallel(world_size=4, modules=dict(vision=dict(ranks=2), language=dict(ranks=2)), local=True)
def test_engine_checkpoints_refuse_a_job_with_modules(tmp_path: Path) -> None:
    from parallelctx.engines import save

    with pytest.raises((RuntimeError, ValueError), match="parallel.modules"):
        save(tmp_path / "ckpt", torch.nn.Linear(2, 2))
