"""Local worlds (issue 36): every rank of a layout as a thread of one process, with the numbers
the real ranks compute. Groups are proved by collectives against the pure layout; draws are
checked against the documented seed formula (what a real rank's generators give); the model
tests compare with serial references; the slow tests compare with real torchrun processes bit
for bit."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import parallelctx
from parallelctx import ParallelMode, gpc, plan
from parallelctx.local import LocalRankError, run_local
from parallelctx.runtime.seed import mode_seed
from parallelctx.testing import gather_across

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "tp_mlp"))
sys.path.insert(0, str(ROOT / "tests"))

import local_traps  # noqa: E402
from tp_mlp import ParallelMLP, serial_mlp  # noqa: E402

M = ParallelMode


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------ groups and queries
def test_every_group_at_64_ranks_is_proved_by_a_collective() -> None:
    modes = [M.TENSOR, M.PIPELINE, M.CONTEXT, M.DATA, M.MODEL, M.GLOBAL]

    def members() -> dict:
        out = {}
        for mode in modes:
            onehot = torch.zeros(64)
            onehot[dist.get_rank()] = 1.0
            dist.all_reduce(onehot, group=gpc.get_group(mode))
            out[mode] = (
                onehot.nonzero().flatten().tolist(),
                gpc.get_local_rank(mode),
                gpc.get_next_global_rank(mode),
            )
        return out

    results = run_local(members, 64, tensor=4, pipeline=2, context=2)
    layout = plan(64, tensor=4, pipeline=2, context=2)
    for rank, seen in enumerate(results):
        for mode in modes:
            group = layout.group_of(mode, rank)
            assert seen[mode][0] == list(group), (rank, mode)
            index = list(group).index(rank)
            assert seen[mode][1] == index
            assert seen[mode][2] == group[(index + 1) % len(group)]


# ------------------------------------------------------------------------------ the traps
def _seed(layout, rank: int, mode) -> int:
    return mode_seed(layout, rank, mode, local_traps.CONFIG["seed"])


LAYOUT8 = plan(8, tensor=2, pipeline=2)


def _traps(trap) -> list:
    return run_local(trap, 8, local_traps.CONFIG)


def test_the_list_form_of_all_gather_gives_each_rank_its_own_group() -> None:
    for rank, got in enumerate(_traps(local_traps.list_all_gather)):
        for mode in (M.TENSOR, M.DATA):
            group = LAYOUT8.group_of(mode, rank)
            want = torch.tensor([[float(r), float(i)] for i, r in enumerate(group)])
            assert torch.equal(got[mode.name], want), (rank, mode)


def test_a_branch_on_the_rank_takes_each_ranks_own_way() -> None:
    for rank, got in enumerate(_traps(local_traps.rank_branch)):
        src = LAYOUT8.group_of(M.TENSOR, rank)[0]  # only it drew, from its own default stream
        assert got["first"] == (rank == src)
        want = torch.rand(3, generator=_gen(_seed(LAYOUT8, src, M.GLOBAL))) + src
        assert torch.equal(got["value"], want), rank


def test_a_save_and_restore_of_the_rng_state_across_a_collective_is_per_rank() -> None:
    for rank, got in enumerate(_traps(local_traps.save_and_restore)):
        base = _seed(LAYOUT8, rank, M.GLOBAL)
        first = torch.rand(4, generator=_gen(base))
        assert torch.equal(got["first"], first) and torch.equal(got["again"], first), rank
        assert got["python"] == random.Random(base).random()
        assert got["numpy"] == float(np.random.RandomState(base).rand())


def test_fork_rng_across_a_collective_is_per_rank() -> None:
    for rank, got in enumerate(_traps(local_traps.fork_rng)):
        inside = _gen(1000 + rank)
        assert torch.equal(got["inside"], torch.rand(2, generator=inside))
        assert torch.equal(got["inside_after"], torch.rand(2, generator=inside))
        default = _gen(_seed(LAYOUT8, rank, M.GLOBAL))  # outside goes on as if never forked
        assert torch.equal(got["outside"], torch.rand(2, generator=default)), rank


def test_gpcs_streams_draw_the_documented_formula_on_every_rank() -> None:
    for rank, got in enumerate(_traps(local_traps.streams)):
        for mode in (M.TENSOR, M.DATA, M.PIPELINE, "replica"):
            want = torch.rand(3, generator=_gen(_seed(LAYOUT8, rank, mode)))
            assert torch.equal(got[str(mode)], want), (rank, mode)
        assert got["replayed"] is True


# ------------------------------------------------------------------------------ failures are named
def test_a_rank_that_skips_a_collective_is_named_not_hung() -> None:
    def skip() -> None:
        if gpc.get_global_rank() != 3:
            dist.all_reduce(torch.ones(2), group=gpc.get_group(M.TENSOR))

    with pytest.raises(LocalRankError) as info:
        run_local(skip, 4, tensor=2)
    text = str(info.value)
    assert "rank 2 waits for all_reduce[SUM] of float32[2] (its call 1 on the tensor group [2, 3])" in text
    assert "the real job would hang" in text and "ranks finished: 0, 1, 3" in text


def test_different_collectives_at_one_place_are_named_on_both_ranks() -> None:
    def mixed() -> None:
        group = gpc.get_group(M.TENSOR)
        if gpc.get_local_rank(M.TENSOR) == 0:
            dist.all_reduce(torch.ones(2), group=group)
        else:
            dist.broadcast(torch.ones(2), src=gpc.get_ranks_in_group(M.TENSOR)[0], group=group)

    with pytest.raises(LocalRankError) as info:
        run_local(mixed, 2, tensor=2)
    text = str(info.value)
    assert "2 of 2 simulated ranks failed" in text and "LocalMismatch" in text
    want = "rank 1 called broadcast[root 0] of float32[2] as its call 1 on the world group [0, 1], where rank 0 called"
    assert want in text


def test_a_raising_rank_is_named_with_its_place_and_its_peers_are_released() -> None:
    def boom() -> None:
        if gpc.get_global_rank() == 5:
            raise ValueError("bad shard")
        dist.all_reduce(torch.ones(1))

    with pytest.raises(LocalRankError) as info:
        run_local(boom, 8, tensor=2, pipeline=2)
    text = str(info.value)
    assert (
        text.splitlines()[1] == "rank 5 (pipeline stage 1, tensor rank 1, data rank 0): ValueError: bad shard"
    )
    assert "rank 0 (" in text and "ranks that raised: 5 (ValueError: bad shard)" in text
    assert isinstance(info.value.__cause__, ValueError)
    assert type(gpc) is parallelctx.ParallelContext and not gpc.is_initialized(M.GLOBAL)


def test_point_to_point_mismatches_and_any_source_are_refused_by_name() -> None:
    def sizes() -> None:
        if dist.get_rank() == 0:
            dist.send(torch.ones(3), dst=1)
        else:
            dist.recv(torch.ones(4), src=0)

    with pytest.raises(
        LocalRankError, match=r"rank 1 receives \(4,\) torch.float32 from rank 0, which sent \(3,\)"
    ):
        run_local(sizes, 2)

    def anyone() -> None:
        if dist.get_rank() == 1:
            dist.recv(torch.ones(1))
        else:
            dist.send(torch.ones(1), dst=1)

    with pytest.raises(LocalRankError, match="no recv from any source"):
        run_local(anyone, 2, timeout=30)


def test_a_rank_that_never_reaches_a_collective_is_named_and_stopped_at_the_timeout() -> None:
    def spin() -> None:
        dist.all_reduce(torch.ones(1))
        if dist.get_rank() == 1:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # never reaches the next collective in time
                pass
        dist.all_reduce(torch.ones(1))

    begin = time.monotonic()
    with pytest.raises(
        LocalRankError,
        match=r"within 1 s \(2 ranks left\): rank 1 runs; ranks 0 can run once it reaches a collective",
    ):
        run_local(spin, 2, timeout=1)
    assert time.monotonic() - begin < 10  # the spinning rank was stopped, not waited for
    assert not [t for t in threading.enumerate() if t.name.startswith("parallelctx-local-rank")]
    assert type(gpc) is parallelctx.ParallelContext and not dist.is_initialized()


def test_a_local_world_needs_gpc_unlaunched_and_does_not_nest() -> None:
    def nested() -> None:
        run_local(lambda: None, 2)

    with pytest.raises(LocalRankError, match="no other local world"):
        run_local(nested, 2)
    parallelctx.launch(rank=0, world_size=1, port=None)
    try:
        with pytest.raises(RuntimeError, match="needs gpc unlaunched"):
            run_local(lambda: None, 2)
    finally:
        gpc.destroy()


# ------------------------------------------------------------------------------ as a real backend
def test_messages_on_two_groups_between_the_same_ranks_do_not_mix() -> None:
    def cross() -> tuple[float, float] | None:
        pair = dist.new_group([0, 1])
        if dist.get_rank() == 0:
            works = [
                dist.isend(torch.tensor([1.0]), dst=1),
                dist.isend(torch.tensor([2.0]), dst=1, group=pair),
            ]
            for w in works:
                w.wait()
            return None
        a, b = torch.zeros(1), torch.zeros(1)
        dist.recv(a, src=0, group=pair)  # the pair's message first, as gloo delivers per group
        dist.recv(b, src=0)
        return a.item(), b.item()

    assert run_local(cross, 2)[1] == (2.0, 1.0)


def test_two_ranks_that_both_send_first_are_named_as_a_hang() -> None:
    def head_to_head() -> None:
        other = 1 - dist.get_rank()
        dist.send(torch.ones(4), dst=other)  # gloo's send waits for the recv: this hangs for real
        dist.recv(torch.ones(4), src=other)

    with pytest.raises(
        LocalRankError, match=r"rank 0 waits for its send to rank 1 \(tag 0\) on the world group"
    ):
        run_local(head_to_head, 2)


def test_async_collectives_on_two_groups_in_opposite_orders_complete_as_on_gloo() -> None:
    def crossed() -> tuple[float, float]:
        a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
        x, y = torch.tensor([1.0 + dist.get_rank()]), torch.tensor([10.0 + 10 * dist.get_rank()])
        order = [(a, x), (b, y)] if dist.get_rank() == 0 else [(b, y), (a, x)]
        works = [dist.all_reduce(t, group=g, async_op=True) for g, t in order]
        for w in works:
            w.wait()
        return x.item(), y.item()

    assert run_local(crossed, 2) == [(3.0, 30.0), (3.0, 30.0)]


WRONG = {
    "dtype": r"all_reduce\[SUM\] of float64\[2\] as its call 1 .*called all_reduce\[SUM\] of float32\[2\]: the members must agree",
    "shape": r"broadcast\[root 0\] of float32\[4\] as its call 1 .*called broadcast\[root 0\] of float32\[1\]",
    "op": r"all_reduce\[SUM\] of float32\[1\] as its call 1 .*called all_reduce\[MAX\] of float32\[1\]",
    "view": r"all_reduce got a non-contiguous tensor float32\[3\] \(strides \(2,\)\): gloo reads and writes the wrong",
    "gather": r"all_gather: an output is float32\[3\] where float32\[1\] is needed",
}


@pytest.mark.parametrize("case", list(WRONG))
def test_what_a_real_backend_would_garble_is_refused_by_name(case: str) -> None:
    def wrong() -> None:
        me = dist.get_rank()
        if case == "dtype":
            dist.all_reduce(torch.ones(2, dtype=torch.float64 if me else torch.float32))
        elif case == "shape":
            dist.broadcast(torch.ones(4 if me else 1), src=0)
        elif case == "op":
            dist.all_reduce(torch.ones(1), op=dist.ReduceOp.SUM if me else dist.ReduceOp.MAX)
        elif case == "view":
            dist.all_reduce(torch.ones(3, 2)[:, 0])
        else:
            dist.all_gather([torch.zeros(3), torch.zeros(3)], torch.ones(1))

    with pytest.raises(LocalRankError, match=WRONG[case]):
        run_local(wrong, 2)


def test_the_coalesced_forms_give_each_calls_result() -> None:
    import torch.distributed._functional_collectives as funcol

    def coalesced() -> list:
        me, group = dist.get_rank(), gpc.get_group(M.GLOBAL)
        outs = [[torch.zeros(1) for _ in range(2)], [torch.zeros(2) for _ in range(2)]]
        dist.all_gather_coalesced(outs, [torch.tensor([float(me)]), torch.tensor([me, 10.0 * me])])
        gathered = funcol.all_gather_into_tensor_coalesced(
            [torch.tensor([1.0 + me]), torch.tensor([5.0 + me])], group
        )
        scattered = funcol.reduce_scatter_tensor_coalesced(
            [torch.arange(2.0) + me, torch.arange(4.0)], "sum", [0, 0], group
        )
        return [
            [t.tolist() for row in outs for t in row],
            [t.tolist() for t in gathered],
            [t.tolist() for t in scattered],
        ]

    got = run_local(coalesced, 2)
    assert got[0] == [[[0.0], [1.0], [0.0, 0.0], [1.0, 10.0]], [[1.0, 2.0], [5.0, 6.0]], [[1.0], [0.0, 2.0]]]
    assert got[1][2] == [[3.0], [4.0, 6.0]]


def test_a_wait_returns_only_once_its_own_call_is_done() -> None:
    # rank 2 waits on an irecv while its async all_reduce completes: that must not end the wait
    def spurious() -> tuple | None:
        pair = dist.new_group([1, 2])
        me = dist.get_rank()
        if me == 0:
            dist.recv(torch.zeros(1), src=1)
            dist.send(torch.tensor([10.0, 20.0, 30.0]), dst=2)
        elif me == 1:
            dist.recv(torch.zeros(1), src=2)
            dist.all_reduce(torch.ones(1), group=pair)
            dist.send(torch.ones(1), dst=0)
        else:
            pending = dist.all_reduce(torch.ones(1), group=pair, async_op=True)
            dist.send(torch.ones(1), dst=1)
            box = torch.full((3,), -1.0)
            work = dist.irecv(box, src=0)
            work.wait()
            done, got = work.is_completed(), box.clone()
            pending.wait()
            return got.tolist(), done
        return None

    assert run_local(spurious, 3)[2] == ([10.0, 20.0, 30.0], True)


def test_ranks_compute_on_one_thread_as_torchruns_do() -> None:
    threads = torch.get_num_threads()
    os.environ.pop("OMP_NUM_THREADS", None)
    got = run_local(lambda: (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]), 2)
    assert got == [(1, "1"), (1, "1")]
    assert torch.get_num_threads() == threads and "OMP_NUM_THREADS" not in os.environ


def test_outputs_that_alias_the_inputs_get_what_gloo_gives() -> None:
    def aliased() -> list[float]:
        me = dist.get_rank()
        xs = [torch.tensor([float(10 * me + j)]) for j in range(2)]
        dist.all_to_all(xs, xs)  # the outputs are the inputs
        return [x.item() for x in xs]

    assert run_local(aliased, 2) == [[0.0, 10.0], [1.0, 11.0]]


def test_each_rank_has_its_own_args_environment_and_dtype_and_the_process_gets_its_own_back() -> None:
    model = nn.Linear(2, 2)
    before = model.weight.detach().clone()
    os.environ.pop("LOCAL_TEST_VALUE", None)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)

    def step(m: nn.Linear) -> tuple:
        with torch.no_grad():
            m.weight += 1.0  # each rank's own copy, as each real rank unpickles its own
        os.environ["LOCAL_TEST_VALUE"] = str(dist.get_rank())
        if dist.get_rank() == 1:
            torch.set_default_dtype(torch.float64)
        dist.barrier()
        return (
            m.weight.detach().clone(),
            os.environ["LOCAL_TEST_VALUE"],
            os.environ["RANK"],
            torch.get_default_dtype(),
        )

    got = run_local(step, 2, args=(model,))
    for rank, (weight, value, env_rank, dtype) in enumerate(got):
        assert torch.equal(weight, before + 1.0) and value == env_rank == str(rank)
        assert dtype == (torch.float64 if rank == 1 else torch.float32)
    assert torch.equal(model.weight, before)
    assert "LOCAL_TEST_VALUE" not in os.environ and torch.get_default_dtype() == torch.float32
    assert torch.equal(torch.rand(3), expected)  # the process's generator as before the run


# ------------------------------------------------------------------------------ model code
class _Recorded(nn.Module):
    """A ParallelMLP that keeps the dropout masks of every forward (one per microbatch)."""

    def __init__(self, block: ParallelMLP) -> None:
        super().__init__()
        self.block = block
        self.masks: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        self.masks.append(self.block.masks)
        return y


HIDDEN, FFN, ROWS, MICRO, P = 8, 16, 8, 4, 0.5


def _weights(stage: int) -> list[torch.Tensor]:
    gen = _gen(300 + stage)
    return [
        torch.randn(s, generator=gen, dtype=torch.float64) * 0.5
        for s in [(FFN, HIDDEN), (FFN,), (HIDDEN, FFN), (HIDDEN,)]
    ]


def _data(replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _gen(70 + replica)
    return torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64), torch.randn(
        ROWS, HIDDEN, generator=gen, dtype=torch.float64
    )


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _one_f_one_b(reduce_data: bool = True) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage, stages = gpc.get_local_rank(M.PIPELINE), gpc.get_world_size(M.PIPELINE)
    replica, replicas = gpc.get_local_rank(M.DATA), gpc.get_world_size(M.DATA)
    model = _Recorded(ParallelMLP(*_weights(stage), p=P))
    piped = PipelineStage(model, stage, stages, gpc.device, group=gpc.get_group(M.PIPELINE))
    schedule = Schedule1F1B(piped, n_microbatches=MICRO, loss_fn=_mse)
    x, target = _data(replica)
    losses: list = []
    if gpc.is_pipeline_first_stage():
        schedule.step(x)
    elif gpc.is_pipeline_last_stage():
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    for p in model.parameters():
        if reduce_data:
            dist.all_reduce(p.grad, group=gpc.get_group(M.DATA))
        p.grad /= replicas

    # the serial reference: every replica's microbatches through every stage, with the masks drawn
    # (the stage's shape inference ran the block once more, first: its draws are skipped here)
    assert len(model.masks) == MICRO + 1
    masks = [(torch.cat(gather_across(M.TENSOR, h), dim=-1), y) for h, y in model.masks[-MICRO:]]
    by_stage: list = [None] * stages
    dist.all_gather_object(by_stage, masks, group=gpc.get_cpu_group(M.PIPELINE))
    everyone: list = [None] * replicas
    dist.all_gather_object(everyone, by_stage, group=gpc.get_cpu_group(M.DATA))
    params = [[t.requires_grad_(True) for t in _weights(s)] for s in range(stages)]
    total = torch.zeros((), dtype=torch.float64)
    serial_losses = []
    for d in range(replicas):
        xs, ts = (t.chunk(MICRO) for t in _data(d))
        for m in range(MICRO):
            out = xs[m]
            for s in range(stages):
                out = serial_mlp(out, params[s], everyone[d][s][m], P)
            loss = _mse(out, ts[m])
            serial_losses.append(loss.detach())
            total = total + loss / (MICRO * replicas)
    total.backward()
    if gpc.is_pipeline_last_stage():
        mine = serial_losses[replica * MICRO : (replica + 1) * MICRO]
        torch.testing.assert_close(torch.stack(losses), torch.stack(mine), rtol=1e-12, atol=1e-12)
    w1, b1, w2, b2 = params[stage]
    part = model.block.part
    torch.testing.assert_close(model.block.w1.grad, w1.grad[part], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.block.b1.grad, b1.grad[part], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.block.w2.grad, w2.grad[:, part], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.block.b2.grad, b2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.slow  # 6 s here: make test-slow (the cheaper mutation test below stays in make test)
def test_tensor4_pipeline4_data4_under_a_1f1b_schedule_equals_the_serial_model() -> None:
    run_local(_one_f_one_b, 64, tensor=4, pipeline=4)


def test_a_1f1b_schedule_without_the_data_all_reduce_is_caught() -> None:
    # the bug the test exists for: each data replica steps on its own gradient
    with pytest.raises(LocalRankError, match="Tensor-likes are not close"):
        run_local(functools.partial(_one_f_one_b, reduce_data=False), 16, tensor=2, pipeline=2)


def _stage_block(i: int) -> nn.Module:
    gen = _gen(100 + i)
    lin = nn.Linear(6, 6, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(6, 6, generator=gen, dtype=torch.float64) * 0.5)
        lin.bias.copy_(torch.randn(6, generator=gen, dtype=torch.float64) * 0.1)
    return nn.Sequential(lin, nn.Tanh())


def _interleaved() -> list:
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    from parallelctx.pipelining import num_stages, stage_indices

    blocks = {i: _stage_block(i) for i in stage_indices()}
    stages = [
        PipelineStage(m, i, num_stages(), gpc.device, group=gpc.get_group(M.PIPELINE))
        for i, m in blocks.items()
    ]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=_mse)
    x, target = (torch.randn(8, 6, generator=_gen(7), dtype=torch.float64) for _ in range(2))
    if gpc.is_pipeline_first_stage():
        schedule.step(x)
    elif gpc.is_pipeline_last_stage():
        schedule.step(target=target)
    else:
        schedule.step()
    return [(i, [p.grad for p in m.parameters()]) for i, m in blocks.items()]


@pytest.mark.slow  # 3 s: make test-slow
def test_an_interleaved_1f1b_schedule_with_virtual_stages_equals_the_serial_model() -> None:
    got = run_local(_interleaved, 4, dict(parallel=dict(tensor=1, pipeline=dict(size=4, virtual=2))))
    blocks = [_stage_block(i) for i in range(8)]
    x, target = (torch.randn(8, 6, generator=_gen(7), dtype=torch.float64) for _ in range(2))
    for xm, tm in zip(x.chunk(8), target.chunk(8)):
        out = xm
        for block in blocks:
            out = block(out)
        (_mse(out, tm) / 8).backward()
    seen = sorted(i for rank in got for i, _ in rank)
    assert seen == list(range(8))
    for rank in got:
        for i, grads in rank:
            for g, p in zip(grads, blocks[i].parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------ Megatron-core
@pytest.mark.parametrize("explicit", [False, True], ids=["getters", "pg_collection"])
def test_megatron_column_then_row_parallel_at_tensor_8_equals_serial(explicit: bool) -> None:
    pytest.importorskip("megatron.core")

    def megatron_mlp() -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        import parallelctx.megatron as bridge

        # the getters, as Megatron's own code reads them, answer per rank
        bridge.install()
        assert ps.get_tensor_model_parallel_rank() == gpc.get_local_rank(M.TENSOR)
        assert ps.get_data_parallel_rank() == gpc.get_local_rank(M.DATA)
        assert dist.get_process_group_ranks(ps.get_data_parallel_group()) == gpc.get_ranks_in_group(M.DATA)
        dist.barrier()  # every rank has installed: each still reads its own
        assert ps.get_tensor_model_parallel_group() is gpc.get_group(M.TENSOR)
        tp_group = bridge.process_groups().tp if explicit else None
        cfg = ModelParallelConfig(
            tensor_model_parallel_size=8,
            use_cpu_initialization=True,
            perform_initialization=False,
            params_dtype=torch.float64,
        )
        col = ColumnParallelLinear(
            8, 32, config=cfg, init_method=nn.init.zeros_, bias=True, gather_output=False, tp_group=tp_group
        )
        row = RowParallelLinear(
            32,
            8,
            config=cfg,
            init_method=nn.init.zeros_,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=tp_group,
        )
        gen = _gen(5)
        w1, b1, w2, b2 = (
            torch.randn(s, generator=gen, dtype=torch.float64) for s in [(32, 8), (32,), (8, 32), (8,)]
        )
        part = slice(4 * gpc.get_local_rank(M.TENSOR), 4 * gpc.get_local_rank(M.TENSOR) + 4)
        with torch.no_grad():
            col.weight.copy_(w1[part])
            col.bias.copy_(b1[part])
            row.weight.copy_(w2[:, part])
            row.bias.copy_(b2)
        x = torch.randn(6, 8, generator=_gen(9), dtype=torch.float64, requires_grad=True)
        h, _ = col(x)
        y, _ = row(F.gelu(h))
        y.sum().backward()
        refs = [t.clone().requires_grad_(True) for t in (x.detach(), w1, b1, w2, b2)]
        ref_y = F.linear(F.gelu(F.linear(refs[0], refs[1], refs[2])), refs[3], refs[4])
        ref_y.sum().backward()
        torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, refs[0].grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(col.weight.grad, refs[1].grad[part], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(row.weight.grad, refs[3].grad[:, part], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(row.bias.grad, refs[4].grad, rtol=1e-12, atol=1e-12)

    run_local(megatron_mlp, 16, tensor=8)
    from megatron.core import parallel_state as ps

    assert ps._TENSOR_MODEL_PARALLEL_GROUP is None  # nothing left in the process


# ------------------------------------------------------------------------------ the pytest marker
@pytest.mark.parallel(world_size=8, tensor=2, pipeline=2, local=True)
def test_the_marker_runs_every_rank_with_the_fixtures_made_once(tmp_path: Path) -> None:
    (tmp_path / f"rank-{dist.get_rank()}").write_text(str(gpc.get_local_rank(M.TENSOR)))
    dist.barrier()
    seen = sorted(p.name for p in tmp_path.iterdir())
    assert seen == [f"rank-{r}" for r in range(8)]
    assert gpc.get_world_size(M.DATA) == 2 and dist.get_world_size() == 8


@dataclasses.dataclass
class _Holder:
    tensor: torch.Tensor


@pytest.fixture
def holder() -> _Holder:
    return _Holder(torch.zeros(1))


@pytest.mark.parallel(world_size=2, local=True)
def test_the_marker_copies_fixture_values_per_rank_as_real_ranks_make_their_own(holder: _Holder) -> None:
    holder.tensor += 1 + dist.get_rank()  # a real rank's fixture object is its own
    dist.barrier()
    assert holder.tensor.item() == 1 + dist.get_rank()


# ------------------------------------------------------------------------------ against real ranks
def _torchrun(script: Path, out: Path, nproc: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(script), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


def _same(a: object, b: object, where: str) -> list[str]:
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) else [where]
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        return [bad for k in a for bad in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        return [bad for i, (x, y) in enumerate(zip(a, b)) for bad in _same(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


@pytest.mark.slow
def test_the_3d_mlp_trained_locally_equals_8_torchrun_processes_bit_for_bit(tmp_path: Path) -> None:
    import train_3d

    _torchrun(ROOT / "examples" / "tp_mlp" / "train_3d.py", tmp_path, 8)
    local = run_local(train_3d.train, 8, train_3d.CONFIG)
    differ = []
    for rank in range(8):
        real = torch.load(tmp_path / f"rank-{rank}.pt")
        assert len(real["masks"]) == train_3d.STEPS and real["params"]
        differ += _same(real, local[rank], f"rank {rank}")
    assert differ == []


@pytest.mark.slow
def test_every_trap_equals_8_torchrun_processes_bit_for_bit(tmp_path: Path) -> None:
    _torchrun(ROOT / "tests" / "local_traps.py", tmp_path, 8)
    local = run_local(local_traps.everything, 8, local_traps.CONFIG)
    differ = []
    for rank in range(8):
        differ += _same(
            torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False), local[rank], f"rank {rank}"
        )
    assert differ == []
