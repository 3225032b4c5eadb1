"""Run under torchrun by tests/test_hang.py: ``torchrun ... tests/torchrun_hang.py OUT SCENARIO``.

Scenarios (parallel.tensor=2, so the data groups are {0,2,4,6} and {1,3,5,7}):

* ``skip``: ranks 1, 5 and 7 all-reduce on the data group; rank 3 never enters it (it sleeps).
  ``dist.hang_report.after`` is 4 s and ``store_wait`` 8 s; a handler records each report and
  calls ``report.abort()`` 11 s later (``ABORT_LATE``: a report can come up to 1 s +
  ``store_wait`` late when the store is slow), which ends the waiting ranks' all-reduce. Every
  rank then destroys, relaunches in the same process and proves the relaunch with a data-group
  all-reduce against the serial sum.
* ``mismatch``: on the tensor group {0, 1} rank 0 calls ``all_reduce`` and rank 1 ``broadcast``;
  each is reported with the other as mismatched, then aborted (``ABORT_LATE``) and relaunched as
  above.
* ``slow`` (4 ranks, 6 cycles in the same processes): on the global group ranks 0 and 3
  all-reduce at once, rank 1 only after ``after - 0.02`` s (slow, but it arrives before anyone
  has waited ``after``), rank 2 never. Rank 2 is missing; rank 1 must never be named.
* ``async`` (4 ranks): on the global group rank 0 starts two all-reduces with
  ``async_op=True`` and waits for both; ranks 2 and 3 call the same two all-reduces one after
  the other (so they wait in the first); rank 1 never comes. Every report is about the first
  all-reduce and names rank 1 alone: the others entered it.
* ``per_rank_shapes`` (4 ranks, one launch per cycle in the same processes): on the global
  group rank 3 sleeps while ranks 0-2 enter a call whose shapes legitimately differ by rank:
  ``all_to_all_single`` with rank-dependent split sizes (as an MoE dispatch), ``gather`` to
  rank 0 (only the root passes a list), ``scatter`` from rank 0. Rank 3 alone is missing; no
  rank may be named mismatched.
* ``shape_mismatch`` (4 ranks, cycles as above, rank 3 asleep): ranks 0 and 1 all-reduce
  ``float32[4]`` and rank 2 ``float32[8]``; then ranks 0 and 1 broadcast from rank 0 and rank
  2 from rank 1. Rank 3 is missing and rank 2 (to ranks 0 and 1) is mismatched.
* ``functional`` (4 ranks; tensor groups {0, 1} and {2, 3}): a tensor-parallel step written
  with DTensor and torch's functional collectives. Every rank reduces a partial sum over the
  tensor group with ``funcol.all_reduce`` and then with ``dist.all_reduce`` (the count mixes
  both); then ranks 1, 2 and 3 gather a row-sharded weight (``DTensor.redistribute`` to
  ``Replicate``: a functional all-gather) while rank 0 sleeps. Rank 1 names rank 0 missing in
  the tensor group's third call, ``all_gather_into_tensor``; ranks 2 and 3 complete.
* ``healthy``: 200 steps of all-reduces on the data, tensor and global groups and a CPU-group
  all_gather_object, with ``after`` = 8 s, then idle past ``after``: no report may come (a call
  the watch wrongly kept pending would be reported while idle).

Writes OUT/rank-<R>.json: the reports (as dicts, with the seconds from the call's entry to the
report), what the pending call raised and when, and the relaunch's all-reduce.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import parallelctx
from parallelctx import HangReport, ParallelMode, gpc

AFTER = {
    "skip": 4.0,  # a 2-core CI machine running 8 ranks has been seen to start a rank ~3 s late
    "mismatch": 2.0,
    "healthy": 8.0,  # at 1 s and 3 s, full faults runs here (8 ranks, 2 cores) drew reports of healthy calls
    "slow": 1.0,
    "async": 1.0,
    "per_rank_shapes": 1.0,
    "shape_mismatch": 1.0,
    "functional": 2.0,
}
# dist.hang_report.store_wait: a report whose read of the progress timed out (a loaded
# machine's store can be silent for seconds) reads again this long, so it may come up to the
# read's own wait (1 s) + STORE_WAIT later than a prompt one.
STORE_WAIT = 8.0
ABORT_LATE = 2.0 + 1.0 + STORE_WAIT
SHAPE_CYCLES = {
    "per_rank_shapes": ["all_to_all_single", "gather", "scatter"],
    "shape_mismatch": ["all_reduce", "broadcast"],
}


def main() -> int:
    """Run SCENARIO on this rank; return 0 (the test reads the JSON file)."""
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    hang = {"after": AFTER[scenario], "store_wait": STORE_WAIT}
    config = {"parallel": {"tensor": 2}, "dist": {"timeout": 60, "hang_report": hang}}
    record: dict = {"rank": rank, "reports": []}
    entered: dict[str, float] = {}

    def on_hang(report: HangReport) -> None:
        row = {f.name: getattr(report, f.name) for f in dataclasses.fields(report) if f.name != "aborter"}
        row["mode"] = report.mode.value
        row["modes"] = [m.value for m in report.modes]
        row["mismatched"] = {str(k): v for k, v in report.mismatched.items()}
        row["flight_recorder"] = {str(k): list(v) for k, v in report.flight_recorder.items()}
        row["where"] = {str(k): v for k, v in report.where.items()}
        row["after_entry_s"] = time.perf_counter() - entered.get("t", time.perf_counter())
        row["text"] = str(report)
        record["reports"].append(row)
        if scenario != "healthy":
            # Abort 2 s later: every waiting rank reports first (one rank's abort may end the
            # others' calls too; report.abort() then leaves their relaunch alone). ``skip`` and
            # ``mismatch`` wait ABORT_LATE: a report whose read of the store timed out comes up
            # to 1 s + STORE_WAIT late, and on a loaded machine a waiting rank had its call ended
            # unreported (skip) or reported without the others' progress (mismatch).
            delay = ABORT_LATE if scenario in ("skip", "mismatch") else 2.0
            threading.Timer(delay, report.abort).start()

    gpc.on_hang(on_hang)
    if scenario == "slow":
        record["cycles"] = [slow_cycle(config, rank, record, entered) for _ in range(6)]
        (out / f"rank-{rank}.json").write_text(json.dumps(record))
        return 0
    if scenario in SHAPE_CYCLES:
        record["cycles"] = {call: shape_cycle(config, rank, record, call) for call in SHAPE_CYCLES[scenario]}
        (out / f"rank-{rank}.json").write_text(json.dumps(record))
        return 0
    if scenario == "async":
        parallelctx.launch_from_torch(config)
        dist.barrier()
        try:
            if rank == 0:
                first = dist.all_reduce(torch.ones(4), async_op=True)
                second = dist.all_reduce(torch.ones(2), async_op=True)
                first.wait()
                second.wait()
            elif rank in (2, 3):
                dist.all_reduce(torch.ones(4))
                dist.all_reduce(torch.ones(2))
            else:
                time.sleep(AFTER["async"] + 6)  # never enters them
        except RuntimeError:
            pass  # the handler's abort
        time.sleep(3)  # every report comes before the teardown
        gpc.destroy()
        (out / f"rank-{rank}.json").write_text(json.dumps(record))
        return 0
    if scenario == "functional":
        functional_step(config, rank, record, entered)
        (out / f"rank-{rank}.json").write_text(json.dumps(record))
        return 0
    parallelctx.launch_from_torch(config)
    print(f"rank {rank} timeline: launched at {time.time():.3f}", file=sys.stderr, flush=True)
    # Every rank has launched (its watch armed) before any enters the call under test. In CI two
    # ranks once returned from the launch 5 s after the others (a store connection's reverse DNS
    # lookup waiting out the resolver, docs/performance.md), entered the all-reduce that late, and
    # were rightly named missing by a report made before their watch posted.
    dist.barrier()
    data = gpc.get_group(ParallelMode.DATA)
    if scenario == "healthy":
        for step in range(200):
            x = torch.full((64,), float(rank))
            dist.all_reduce(x, group=data)
            dist.all_reduce(x, group=gpc.get_group(ParallelMode.TENSOR))
            dist.all_reduce(x)
            if step % 50 == 0:
                names: list = [None] * gpc.get_world_size(ParallelMode.DATA)
                dist.all_gather_object(names, step, group=gpc.get_cpu_group(ParallelMode.DATA))
        dist.barrier()
        time.sleep(AFTER["healthy"] + 1.0)  # nothing pending now: a call left pending would be reported
        record["steps"] = 200
    else:
        stuck = rank in (1, 5, 7) if scenario == "skip" else rank in (0, 1)
        if stuck:
            entered["t"] = time.perf_counter()
            try:
                if scenario == "mismatch" and rank == 1:
                    dist.broadcast(torch.ones(3), src=1, group=gpc.get_group(ParallelMode.TENSOR))
                elif scenario == "mismatch":
                    dist.all_reduce(torch.ones(4), group=gpc.get_group(ParallelMode.TENSOR))
                else:
                    dist.all_reduce(torch.ones(4), group=data)
                record["raised"] = None
            except RuntimeError as exc:
                record["raised"] = str(exc).splitlines()[0][:200]
            record["ended_s"] = time.perf_counter() - entered["t"]
        elif scenario == "skip" and rank == 3:
            time.sleep(AFTER[scenario] + 1.0 + STORE_WAIT + ABORT_LATE + 2)  # stays past the aborts
        elif scenario == "skip":
            entered["t"] = time.perf_counter()
            dist.all_reduce(torch.ones(4), group=data)  # the other data group completes
            took = time.perf_counter() - entered["t"]
            print(f"rank {rank} timeline: data all-reduce took {took:.3f} s", file=sys.stderr, flush=True)
        else:
            time.sleep(AFTER[scenario] + 6)
        gpc.destroy()
        parallelctx.launch_from_torch(config)
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=gpc.get_group(ParallelMode.DATA))
        record["relaunch_sum"] = x.item()
        record["relaunch_expected"] = float(sum(r + 1 for r in gpc.get_ranks_in_group(ParallelMode.DATA)))
    gpc.destroy()
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    return 0


def functional_step(config: dict, rank: int, record: dict, entered: dict[str, float]) -> None:
    """The ``functional`` scenario, as a user's DTensor model code would make it."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    parallelctx.launch_from_torch(config)
    tensor = gpc.get_group(ParallelMode.TENSOR)
    partial = torch.full((4,), float(rank + 1))
    total = funcol.all_reduce(partial, "sum", tensor).wait()
    dist.all_reduce(partial, group=tensor)
    record["sums"] = [total.tolist(), partial.tolist()]
    weight = distribute_tensor(torch.arange(64.0).reshape(8, 8), gpc.device_mesh["tp"], [Shard(0)])
    dist.barrier()
    if rank == 0:
        time.sleep(AFTER["functional"] + 6)  # never gathers the weight
    else:
        entered["t"] = time.perf_counter()
        try:
            full = weight.redistribute(placements=[Replicate()]).to_local()
            record["gathered"] = bool(torch.equal(full, torch.arange(64.0).reshape(8, 8)))
        except RuntimeError as exc:
            record["raised"] = str(exc).splitlines()[0][:200]
    time.sleep(max(0.0, entered.get("t", 0.0) + AFTER["functional"] + 4 - time.perf_counter()))
    gpc.destroy()


def slow_cycle(config: dict, rank: int, record: dict, entered: dict[str, float]) -> dict:
    """One launch of the ``slow`` scenario; returns this rank's reports and its entry time."""
    record["reports"] = []
    parallelctx.launch_from_torch(config)
    dist.barrier()
    row: dict = {}
    if rank == 2:
        time.sleep(AFTER["slow"] + 5)  # never enters the all-reduce
    else:
        if rank == 1:
            time.sleep(AFTER["slow"] - 0.02)  # slow, but here before anyone waited `after`
        entered["t"] = time.perf_counter()
        row["entered"] = time.time()
        try:
            dist.all_reduce(torch.ones(4))
        except RuntimeError:
            pass  # the handler's abort
    row["reports"] = record["reports"]
    gpc.destroy()
    return row


def shape_cycle(config: dict, rank: int, record: dict, call: str) -> dict:
    """One launch of ``per_rank_shapes`` or ``shape_mismatch``: rank 3 sleeps, ranks 0-2 enter
    ``call`` on the global group; returns this rank's reports and how its call ended."""
    record["reports"] = []
    parallelctx.launch_from_torch(config)
    dist.barrier()
    start = time.monotonic()
    row: dict = {}
    if rank != 3:
        try:
            collective(call, rank)
            row["ended"] = "completed"
        except RuntimeError:
            row["ended"] = "raised"  # the handler's abort
    # Every rank, rank 3 included, stays until the reports and aborts are done.
    time.sleep(max(0.0, start + AFTER["per_rank_shapes"] + 5 - time.monotonic()))
    row["reports"] = record["reports"]
    gpc.destroy()
    return row


def collective(call: str, rank: int) -> None:
    """Rank ``rank`` (0, 1 or 2 of 4) enters ``call`` on the default group, as a user's script."""
    if call == "all_to_all_single":
        # Rank r sends SENDS[r][j] rows of 4 to rank j (an MoE dispatch: each rank routes its
        # own number of tokens to each expert), and receives SENDS[j][r] rows from rank j.
        sends = [[1, 2, 3, 1], [2, 1, 1, 2], [3, 3, 1, 1], [1, 1, 2, 2]]
        input_splits = sends[rank]
        output_splits = [sends[j][rank] for j in range(4)]
        out = torch.empty(sum(output_splits), 4)
        inp = torch.full((sum(input_splits), 4), float(rank))
        dist.all_to_all_single(out, inp, output_split_sizes=output_splits, input_split_sizes=input_splits)
    elif call == "gather":
        gather_list = [torch.empty(2) for _ in range(4)] if rank == 0 else None
        dist.gather(torch.full((2,), float(rank)), gather_list, dst=0)
    elif call == "scatter":
        scatter_list = [torch.full((2,), float(j)) for j in range(4)] if rank == 0 else None
        dist.scatter(torch.empty(2), scatter_list, src=0)
    elif call == "all_reduce":
        dist.all_reduce(torch.ones(8 if rank == 2 else 4))
    elif call == "broadcast":
        dist.broadcast(torch.ones(4), src=1 if rank == 2 else 0)
    else:
        raise ValueError(
            f"unknown call {call!r}; give one of {[c for calls in SHAPE_CYCLES.values() for c in calls]}"
        )


if __name__ == "__main__":
    sys.exit(main())
