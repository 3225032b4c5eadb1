"""gpc.reform(): lose a rank for good and go on in the surviving processes (docs/reliability.md).

Under real torchrun with one agent per "node" (static rendezvous on 127.0.0.1), so that a
worker killed with SIGKILL takes only its own node down, as a dead host would: its agent stops
the node's other worker and exits, and the other agents keep theirs running. The survivors'
agents then wait for the lost one at torchrun's exit barrier (300 s), so the test stops them
once every survivor has written its record. The layout sums are checked by real all_gathers,
and the training by a fresh torchrun launch of the smaller layout from the same checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from torchrun_helpers import ROOT, TORCHRUN, run_torchrun

pytestmark = [pytest.mark.faults]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_agents(
    nodes: int, per_node: int, argv: list[str], out: Path, expect: list[str], timeout: float
) -> str:
    """Run ``nodes`` torchrun agents of ``per_node`` workers each; return their output once every
    file of ``expect`` exists in ``out`` (or every agent exited), stopping the agents left."""
    port = _free_port()
    logs = [open(out / f"agent-{n}.log", "w") for n in range(nodes)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [
                str(TORCHRUN),
                "--nnodes",
                str(nodes),
                "--node-rank",
                str(n),
                "--nproc-per-node",
                str(per_node),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                *argv,
            ],
            cwd=ROOT,
            stdout=logs[n],
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
        for n in range(nodes)
    ]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if all((out / name).exists() for name in expect) or all(p.poll() is not None for p in procs):
                break
            time.sleep(0.5)
        time.sleep(1.0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for log in logs:
            log.close()
    return "\n".join((out / f"agent-{n}.log").read_text()[-3000:] for n in range(nodes))


def records(out: Path, mode: str) -> dict[int, dict]:
    return {int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text()) for p in out.glob(f"{mode}-rank-*.json")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("bridge", ["plain", "megatron"])
def test_rank_killed_mid_step_survivors_reform_and_train_as_a_fresh_smaller_launch(
    tmp_path: Path, bridge: str
) -> None:
    # 8 ranks, tensor 2 x data 4, 4 agents of 2 (ranks 4 and 5 share one). Rank 5 is killed
    # (SIGKILL) between its forward and backward at step 3; its agent stops rank 4. The six
    # survivors call gpc.abort(); gpc.reform(exclude=[5]) and train steps 3-7 from the step-2
    # checkpoint at tensor 2 x data 3; a fresh 6-rank torchrun from the same checkpoint must give
    # the same groups, the same seeded draws and the same losses, bit for bit. With the Megatron
    # bridge installed, reform reinstalls it: every parallel_state getter and every
    # process_groups() field answers as a fresh install on the 6-rank launch does.
    survivors = [0, 1, 2, 3, 6, 7]
    extra = ["--megatron"] if bridge == "megatron" else []
    log = run_agents(
        4, 2, ["tests/torchrun_reform.py", "kill", str(tmp_path), "5", *extra], tmp_path,
        [f"kill-rank-{r}.json" for r in survivors], timeout=400,
    )  # fmt: skip
    got = records(tmp_path, "kill")
    left = got.pop(4, None)  # rank 4 leaves with rank 5: told so by reform, unless its agent stopped it first
    assert left is None or (left["reformed"]["rank"] is None and "losses" not in left), left
    assert sorted(got) == survivors, log
    fresh = run_torchrun(6, ["tests/torchrun_reform.py", "fresh", str(tmp_path), *extra], timeout=300)
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-3000:]
    want = records(tmp_path, "fresh")
    assert sorted(want) == list(range(6))
    for old, row in got.items():
        new = survivors.index(old)
        assert row["reformed"] == {"rank": new, "left": [4, 5], "world_size": 6}, row
        ref = want[new]
        keys = ["rank", "world_size", "tensor", "data", "tensor_seed_draw", "data_seed_draw", "losses"]
        for key in keys + (["megatron"] if extra else []):
            assert row[key] == ref[key], (old, key, row[key], ref[key])
        assert row["reform_s"] < 10.0, row
    print(
        f"reform took at most {max(r['reform_s'] for r in got.values()):.2f} s; losses after it "
        f"{got[0]['losses']} equal the fresh 6-rank launch's"
    )


@pytest.mark.timeout(900)
def test_ten_kills_in_a_row_each_reformed_leave_no_thread_or_group_behind(tmp_path: Path) -> None:
    # 12 ranks of data parallelism, one agent each. Ten rounds: the highest rank left is killed
    # between its forward and backward; the others abort, reform and take the next step on the
    # smaller world. After each reform: the groups are the smaller world's (all_gather), the step's
    # loss is the same on every rank, and the threads and process groups are those after the first
    # launch: nothing of the nine earlier worlds is left.
    rounds, world = 10, 12
    log = run_agents(
        world, 1, ["tests/torchrun_reform.py", "cycles", str(tmp_path), str(rounds)], tmp_path,
        [f"cycles-rank-{r}.json" for r in range(world - rounds)], timeout=800,
    )  # fmt: skip
    got = records(tmp_path, "cycles")
    assert sorted(got) == list(range(world - rounds)), log
    for old, row in got.items():
        sizes = [r["world_size"] for r in row["rounds"]]
        assert sizes == list(range(world - 1, world - rounds - 1, -1)), (old, sizes)
        threads = {tuple(r["threads"]) for r in row["rounds"]}
        assert len(threads) == 1, (old, threads)  # the same threads after every reform
        assert all("parallelctx-launch-bell" not in t for t in next(iter(threads))), threads
        assert {r["groups"] for r in row["rounds"]} == {row["rounds"][0]["groups"]}, row["rounds"]
        for r in row["rounds"]:
            assert r["rank"] == old and r["data"] == list(range(r["world_size"])), r
    for i in range(rounds):  # every rank saw the same losses in each round
        assert len({tuple(row["rounds"][i]["losses"]) for row in got.values()}) == 1, i
    print(f"{rounds} kills in a row from {world} ranks: worlds {[r['world_size'] for r in got[0]['rounds']]}")


@pytest.mark.timeout(300)
def test_a_survivor_that_comes_after_dist_timeout_is_still_taken_in(tmp_path: Path) -> None:
    # dist.timeout 3 s; rank 2 comes to reform 4.5 s after the others (as a rank whose collective
    # the abort did not reach comes when that collective times out): the default wait, twice
    # dist.timeout, takes it in, and the three survivors all-reduce on the new world
    proc = run_torchrun(4, ["tests/torchrun_reform_late.py", str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    assert [(r["old"], r["new"], r["world"], r["sum"]) for r in rows] == [(r, r, 3, 3.0) for r in range(3)]
    assert min(r["waited_s"] for r in (rows[0], rows[1])) > 3.0  # they waited past dist.timeout
