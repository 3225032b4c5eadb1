"""gpc in one process: errors before launch, a world of one, seeds, destroy and relaunch."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import parallelctx
from parallelctx import LayoutError, NotLaunchedError, ParallelMode, gpc
from parallelctx.startup import resolve_backend


@pytest.fixture
def launched(world_of_one: Any) -> parallelctx.ParallelContext:
    return world_of_one({"model": {"hidden_size": 8}, "seed": 7})


QUERIES = [
    lambda: gpc.get_global_rank(),
    lambda: gpc.get_local_rank(ParallelMode.TENSOR),
    lambda: gpc.get_world_size("data"),
    lambda: gpc.get_group("pipeline"),
    lambda: gpc.get_cpu_group("pipeline"),
    lambda: gpc.get_ranks_in_group("tensor"),
    lambda: gpc.is_first_rank("tensor"),
    lambda: gpc.is_pipeline_last_stage(),
    lambda: gpc.get_next_global_rank("pipeline"),
    lambda: gpc.tensor.rank,
    lambda: gpc.world.size,
    lambda: gpc.config,
    lambda: gpc.layout,
    lambda: gpc.num_processes_on_current_node,
    lambda: gpc.get_seed("tensor"),
    lambda: gpc.device_mesh,
]


@pytest.mark.parametrize("query", QUERIES)
def test_queries_before_launch_say_what_to_do(query) -> None:
    with pytest.raises(NotLaunchedError, match="call parallelctx.launch_from_torch"):
        query()


def test_world_of_one_answers_every_mode(launched) -> None:
    assert not gpc.is_initialized("embedding") or gpc.get_world_size("embedding") == 1
    for mode in ParallelMode:
        assert gpc.is_initialized(mode)
        assert gpc.get_local_rank(mode) == 0
        assert gpc.get_world_size(mode) == 1
        assert gpc.get_ranks_in_group(mode) == [0]
        assert gpc.is_first_rank(mode) and gpc.is_last_rank(mode)
        assert gpc.get_next_global_rank(mode) == gpc.get_prev_global_rank(mode) == 0
        assert gpc.get_group(mode) is dist.group.WORLD  # in a world of one, the one-rank group
        assert gpc.get_group(mode=mode) is gpc.get_cpu_group(mode=mode)
        assert gpc.get_local_rank(mode=mode) == 0 and gpc.get_world_size(mode=mode) == 1
    assert gpc.get_group(ParallelMode.GLOBAL) is dist.group.WORLD
    assert gpc.tensor.rank == 0 and gpc.tensor.size == 1 and gpc.tensor.group is dist.group.WORLD
    assert gpc.is_rank_for_log()
    assert gpc.num_processes_on_current_node == 1 and gpc.num_nodes == 1 and gpc.node_rank == 0
    assert gpc.config.model.hidden_size == 8
    assert gpc.device == torch.device("cpu") and gpc.backend == "gloo"


def test_unknown_mode_is_named(launched) -> None:
    with pytest.raises(LayoutError, match="unknown parallel mode 'tensr'"):
        gpc.get_local_rank("tensr")
    with pytest.raises(LayoutError):
        gpc.is_initialized("tensr")


def test_launch_twice_is_refused(launched) -> None:
    with pytest.raises(RuntimeError, match="already launched"):
        parallelctx.launch()


def test_destroy_resets_and_relaunches() -> None:
    parallelctx.launch({"seed": 5})
    gpc.destroy()
    assert not dist.is_initialized()
    with pytest.raises(NotLaunchedError):
        gpc.get_world_size("tensor")
    with pytest.raises(NotLaunchedError):
        gpc.config
    gpc.destroy()  # twice is harmless
    parallelctx.launch({"seed": 6})
    try:
        assert gpc.config.seed == 6 and gpc.get_world_size("global") == 1
    finally:
        gpc.destroy()


def test_failed_launch_leaves_nothing_behind() -> None:
    with pytest.raises(
        LayoutError, match="tensor=2 x pipeline=1 x context=1 = 2 does not divide world_size=1"
    ):
        parallelctx.launch({"parallel": {"tensor": 2}})
    assert not dist.is_initialized()
    with pytest.raises(NotLaunchedError):
        gpc.config
    parallelctx.launch()
    gpc.destroy()


def test_adopts_an_existing_default_group_and_leaves_it() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallelctx.launch()
        assert gpc.get_group(ParallelMode.GLOBAL) is dist.group.WORLD
        gpc.destroy()
        assert dist.is_initialized(), "a group parallelctx did not make is not torn down"
        with pytest.raises(RuntimeError, match="already initialised as rank 0 of 1, not rank 1 of 2"):
            gpc.init_global_dist(1, 2)
    finally:
        gpc.destroy()
        dist.destroy_process_group()


def test_init_global_dist_twice_keeps_the_default_group_gpcs() -> None:
    # The second call used to adopt the group the first made: destroy() then left it alive, and
    # the next launch failed on a stale group name (skeptic-34).
    gpc.load_config({"seed": 3})
    gpc.init_global_dist(0, 1, "gloo")
    world = dist.group.WORLD
    gpc.init_global_dist(0, 1, "gloo")
    assert dist.group.WORLD is world and gpc.launched.owns_default_group
    gpc.init_parallel_groups()
    gpc.destroy()
    assert not dist.is_initialized(), "the default group gpc made is torn down by destroy()"
    parallelctx.launch({"parallel": {"tensor": 1}})
    assert gpc.get_world_size(ParallelMode.GLOBAL) == 1
    gpc.destroy()


def test_seed_streams(launched) -> None:
    seeds = {m: gpc.get_seed(m) for m in ParallelMode}
    assert len(set(seeds.values())) == len(seeds)
    assert seeds[ParallelMode.GLOBAL] == 7
    torch.manual_seed(99)
    outside = torch.get_rng_state()
    with gpc.seed(ParallelMode.TENSOR):
        a = torch.rand(3)
        with gpc.seed("data"):
            d = torch.rand(3)
        b = torch.rand(3)
        with gpc.seed(ParallelMode.TENSOR):  # re-entering the active stream is a no-op
            c = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside), "the outer stream is restored untouched"
    tensor = torch.Generator().manual_seed(seeds[ParallelMode.TENSOR])
    assert torch.equal(torch.cat([a, b, c]), torch.rand(9, generator=tensor))
    data = torch.Generator().manual_seed(seeds[ParallelMode.DATA])
    assert torch.equal(d, torch.rand(3, generator=data))
    with gpc.seed(ParallelMode.TENSOR):
        e = torch.rand(3)
    assert torch.equal(e, torch.rand(3, generator=tensor)), "the stream continues where it stopped"


def test_stream_is_restored_after_an_exception(launched) -> None:
    before = torch.get_rng_state()
    with pytest.raises(ZeroDivisionError), gpc.seed("tensor"):
        torch.rand(2)
        1 / 0
    assert torch.equal(torch.get_rng_state(), before)


def test_set_seed_rejects_bad_values(launched) -> None:
    with pytest.raises(ValueError, match=r"seed=-1 must be an integer in \[0, 2\*\*32\)"):
        gpc.set_seed(-1)


def test_launch_arguments_checked() -> None:
    with pytest.raises(ValueError, match=r"rank=3 must lie in \[0, world_size-1 = 1\]"):
        parallelctx.launch(rank=3, world_size=2, port=29999)
    with pytest.raises(ValueError, match="port=None: a world of 2 needs a rendezvous port"):
        parallelctx.launch(rank=0, world_size=2)
    with pytest.raises(TypeError, match="must be seconds"):
        parallelctx.launch(timeout="5")
    # wired into launch: no silent truncation or string ranks
    with pytest.raises(ValueError, match=r"port=2.5 is of type float"):
        parallelctx.launch(rank=0, world_size=2, port=2.5)
    with pytest.raises(TypeError, match="rank='0' is of type str"):
        parallelctx.launch(rank="0", world_size=2, port=29999)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        parallelctx.launch(timeout=float("nan"))
    assert not dist.is_initialized()


def test_timeout_reaches_default_group() -> None:
    parallelctx.launch(timeout=timedelta(seconds=42))
    try:
        assert gpc._timeout == timedelta(seconds=42)
    finally:
        gpc.destroy()


def test_resolve_backend() -> None:
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    assert resolve_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="backend='mpi' must be 'auto', 'nccl' or 'gloo'"):
        resolve_backend("mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            resolve_backend("nccl")


def _four_ranks(worker: Any, tmp_path: Any, *args: Any) -> list[dict[str, Any]]:
    """Run ``worker(index, 4, init_method, out_dir, *args)`` on 4 spawned ranks; return each
    rank's ``rank<i>.json`` record."""
    import json

    import torch.multiprocessing as mp

    from parallelctx.launch import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.start_processes(
        worker, args=(4, init, str(tmp_path), *args), nprocs=4, join=False, start_method="spawn"
    )
    try:
        while not ctx.join(timeout=120):
            pass
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_relaunch_on_an_adopted_default_group_is_refused_clearly(tmp_path) -> None:
    # torch would give the re-made groups the names of the destroyed ones (stale rendezvous
    # keys, a hang until the timeout); parallelctx refuses with a message instead.
    from mp_workers import adopted_relaunch

    for rank, result in enumerate(_four_ranks(adopted_relaunch, tmp_path)):
        assert result["first_sum"] == 2.0
        assert result["default_alive"] is True
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert f"already made a process group of ranks {pair}" in result["relaunch"]


def test_gloo_lazy_init_is_scoped(launched) -> None:
    import os

    assert gpc.config.dist.gloo_lazy_init is True
    assert "TORCH_GLOO_LAZY_INIT" not in os.environ, "the variable is set only while groups are made"


@pytest.mark.parametrize(
    ("adopt", "bridge"), [(True, False), (False, False), (False, True)], ids=["adopted", "owned", "megatron"]
)
def test_no_group_outlives_destroy(tmp_path, adopt: bool, bridge: bool) -> None:
    # gpc kept the adopted default group alive after destroy() (Meetings held it to know which
    # group names were used on it): its worker threads ran into the interpreter's exit, and 1 in
    # 10 Fabric/Accelerate runs died there of "terminate called without an active exception".
    # With the Megatron bridge: a cache of its release check must not hold parallel_state's
    # groups (it held every parallel_state value once, 2026-12-05, before it was committed).
    from mp_workers import groups_left_alive

    for rank, result in enumerate(_four_ranks(groups_left_alive, tmp_path, adopt, bridge)):
        assert {"global", "tensor", "data", "cpu tensor"} <= set(result["used"])
        assert not bridge or "megatron tp" in result["used"]
        assert result["alive"] == [], f"rank {rank}: groups alive after destroy: {result['alive']}"


def test_a_query_captured_by_model_code_answers_for_the_launch_of_the_moment() -> None:
    # Model code that keeps gpc's queries (`get_group = gpc.get_group`) got the destroyed
    # launch's groups after a relaunch: destroy() gave gpc new tables, not the captured ones.
    get_group, get_world_size = gpc.get_group, gpc.get_world_size
    parallelctx.launch({"parallel": {"tensor": 1}})
    first = get_group(ParallelMode.TENSOR)
    assert first is gpc.get_group(ParallelMode.TENSOR)
    gpc.destroy()
    with pytest.raises(NotLaunchedError):
        get_group(ParallelMode.TENSOR)
    with pytest.raises(NotLaunchedError):
        get_world_size("data")
    parallelctx.launch({"parallel": {"tensor": 1}})
    try:
        assert get_group(ParallelMode.TENSOR) is gpc.get_group(ParallelMode.TENSOR) is not first
        t = torch.ones(1)
        dist.all_reduce(t, group=get_group("tensor"))
        assert t.item() == 1.0 and get_world_size("data") == 1
    finally:
        gpc.destroy()


def test_a_view_kept_past_destroy_raises_and_holds_no_group() -> None:
    # `tp = gpc.tensor` kept by a layer answered with the destroyed launch's size and group after
    # a relaunch (silently: the new launch may have another tensor size) and kept the group alive.
    import gc
    import weakref

    parallelctx.launch({"parallel": {"tensor": 1}})
    tp = gpc.tensor
    group = weakref.ref(tp.group)
    assert tp.size == 1 and tp.is_first
    gpc.destroy()
    gc.collect()
    assert group() is None, "a kept view holds no group"
    parallelctx.launch({"parallel": {"tensor": 1}})
    try:
        for field in ("size", "rank", "ranks", "group", "cpu_group", "is_first", "next_rank"):
            with pytest.raises(NotLaunchedError, match=r"gpc.tensor kept from a launch destroyed since"):
                getattr(tp, field)
        assert gpc.tensor.size == 1 and gpc.tensor.group is gpc.get_group("tensor")
        assert "destroyed" in repr(tp)
    finally:
        gpc.destroy()


def test_no_query_answers_while_the_groups_are_torn_down(monkeypatch) -> None:
    # A thread that asks gpc for a group while destroy() runs gets NotLaunchedError, not a group
    # already torn down: the tables are emptied before the teardown starts.
    from parallelctx.runtime import startup

    seen: list[str] = []
    real_end = startup.end

    def end(launched, guard) -> None:
        for query in (
            lambda: gpc.get_group("tensor"),
            lambda: gpc.tensor.size,
            lambda: gpc.get_global_rank(),
        ):
            try:
                query()
                seen.append("answered")
            except NotLaunchedError:
                seen.append("not launched")
        real_end(launched, guard)

    monkeypatch.setattr(startup, "end", end)
    parallelctx.launch({"parallel": {"tensor": 1}})
    gpc.destroy()
    assert seen == ["not launched"] * 3
    assert not dist.is_initialized()


def test_a_view_kept_across_launch_steps_stays_the_same_and_is_retired_at_destroy() -> None:
    # set_seed (and every later step) made new views: a view kept from before it was never
    # retired and answered, with the destroyed launch's group, after destroy() (skeptic-35).
    parallelctx.launch({"parallel": {"tensor": 1}}, seed=1)
    tp, world = gpc.tensor, gpc.world
    gpc.set_seed(5)
    gpc.detect_num_processes_on_current_node()
    assert gpc.tensor is tp and gpc.world is world and tp.size == 1
    gpc.destroy()
    for view in (tp, world):
        with pytest.raises(NotLaunchedError, match="kept from a launch destroyed since"):
            view.group


def test_queries_answer_throughout_a_reseed_in_another_thread() -> None:
    # Each step refilled the tables by emptying them first: a query from another thread during
    # a set_seed() raised NotLaunchedError on a launched rank (about 1 in 6,000, skeptic-35).
    import threading

    parallelctx.launch({"parallel": {"tensor": 1}}, seed=1)
    failures: list[BaseException] = []
    done = threading.Event()

    def ask() -> None:
        while not done.is_set():
            try:
                assert gpc.get_world_size("tp") == 1 and gpc.get_group("tp") is not None
                assert gpc.tensor.size == 1
            except BaseException as exc:
                failures.append(exc)
                return

    thread = threading.Thread(target=ask)
    thread.start()
    try:
        for seed in range(3000):
            gpc.set_seed(seed)
    finally:
        done.set()
        thread.join()
        gpc.destroy()
    assert not failures, failures[0]
