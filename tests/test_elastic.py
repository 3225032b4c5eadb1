"""Elastic restarts, abort and in-process restart (issue 21), marker ``faults``.

Under ``torchrun --max-restarts N`` every attempt's processes are new but torchrun's agent keeps
its store (MASTER_ADDR:MASTER_PORT), so a launch that reads keys of an earlier attempt fails;
torch alone (``init_process_group`` from torchrun's variables) does, which the comparison test
shows. Here: the issue's "done when" case with one agent and with two agents on a c10d
rendezvous (two "nodes" on this machine, only one agent's worker dies); 20 restarts with a worker
killed at a random point each time, every attempt proven; ``gpc.abort()`` ending a hung
collective; the in-process restart recipe (examples/inprocess_restart.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrun_helpers import ROOT, TORCHRUN, run_torchrun

from parallelctx.env import free_port

pytestmark = pytest.mark.faults

SCRIPT = "tests/torchrun_restart.py"


def attempts(out: Path) -> dict[int, dict[int, dict]]:
    """The records written, by attempt and rank."""
    found: dict[int, dict[int, dict]] = {}
    for path in out.glob("attempt-*-rank-*.json"):
        row = json.loads(path.read_text())
        found.setdefault(row["attempt"], {})[row["rank"]] = row
    return found


def assert_proven(rows: dict[int, dict], world: int) -> None:
    """Every rank of one attempt launched, proved every group, summed its tensor group right and
    met under the same prefix."""
    assert sorted(rows) == list(range(world)), rows
    for row in rows.values():
        assert row["errors"] == [], row
        assert row["tensor_sum"] == row["tensor_expected"], row
    assert len({row["prefix"] for row in rows.values()}) == 1, rows


def two_agents(
    out: Path, plan: dict, timeout: float, *extra: str, script: str = SCRIPT
) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents (2 workers each) on one c10d rendezvous, as two nodes would run
    ``script OUT PLAN``."""
    port = free_port()
    argv = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"elastic-{port}", "--max-restarts", "2",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    agents = [
        subprocess.Popen(
            [str(TORCHRUN), *argv, "--node-rank", str(node), *extra, script, str(out), json.dumps(plan)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    done = []
    for agent in agents:
        stdout, _ = agent.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(agent.args, agent.returncode, stdout, ""))
    return done


@pytest.mark.timeout(300)
def test_rank_3_dies_and_the_second_attempt_launches(tmp_path: Path) -> None:
    plan = {"0": {"rank": 3, "point": "after"}}
    proc = run_torchrun(4, ["--max-restarts", "2", SCRIPT, str(tmp_path), json.dumps(plan)], timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = attempts(tmp_path)
    assert sorted(found) == [0, 1], found.keys()
    assert_proven(found[0], 4)
    assert_proven(found[1], 4)
    assert found[0][0]["prefix"] != found[1][0]["prefix"]
    died = found[0][3]["launched_at"]  # rank 3 exits right after writing this
    print(
        f"rank 3 exited; attempt 1's processes started {min(r['started_at'] for r in found[1].values()) - died:.1f} s "
        f"later and launched {max(r['launched_at'] for r in found[1].values()) - died:.1f} s later "
        f"(launch itself {max(r['launch_s'] for r in found[1].values()):.2f} s)"
    )


@pytest.mark.timeout(300)
def test_rank_3_dies_under_two_agents_and_both_restart(tmp_path: Path) -> None:
    # Rank 3 runs under agent 1, whose TORCHELASTIC_RESTART_COUNT becomes 1. Agent 0's workers are
    # restarted too; their count stays 0 when agent 0 only sees the new round, and becomes 1 when
    # its own workers failed first (a collective with the dead rank 3): which one depends on
    # timing, so each rank's final record is its newest one, whatever attempt number it carries.
    plan = {"0": {"rank": 3, "point": "after"}}
    agents = two_agents(tmp_path, plan, timeout=280)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(a.stdout[-3000:] for a in agents)
    found = attempts(tmp_path)
    final = {
        r: max((rows[r] for rows in found.values() if r in rows), key=lambda row: row["launched_at"])
        for r in range(4)
    }
    assert_proven(final, 4)
    assert final[3]["attempt"] == 1  # rank 3's agent restarted it
    assert final[0]["prefix"] != found[0][3]["prefix"]  # the restart met under a new prefix
    assert final[0]["hosts"] == [final[0]["hosts"][0]] * 4


def _kill_plan(restarts: int, world: int, seed: int) -> dict[str, dict]:
    """Per attempt, a random rank dies at the next of the five points (a random delay for
    ``launch``: it then dies wherever the launch is, or just after it)."""
    rng = random.Random(seed)
    points = ["before", "launch", "after", "collective", "destroy"]
    return {
        str(a): {
            "rank": rng.randrange(world),
            "point": points[a % len(points)],
            "delay": round(rng.uniform(0.0, 0.6), 2),
        }
        for a in range(restarts)
    }


@pytest.mark.timeout(900)
def test_twenty_restarts_with_a_worker_killed_at_random_points(tmp_path: Path) -> None:
    # Two ranks (tensor=2), so that the 21 attempts' process start-ups stay within minutes.
    restarts, world = 20, 2
    plan = _kill_plan(restarts, world, seed=21)
    start = time.monotonic()
    proc = run_torchrun(
        world, ["--max-restarts", str(restarts), SCRIPT, str(tmp_path), json.dumps(plan)], timeout=880
    )
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = attempts(tmp_path)
    assert max(found) == restarts, sorted(found)  # attempt 20, the last, completed
    assert_proven(found[restarts], world)
    prefixes = []
    for attempt, rows in found.items():
        # Every rank that got through the launch proved it; a rank killed during the launch left
        # no record, and so may a rank whose peers died first.
        for row in rows.values():
            assert row["errors"] == [] and row["tensor_sum"] == row["tensor_expected"], (attempt, row)
        assert len({row["prefix"] for row in rows.values()}) == 1, (attempt, rows)
        prefixes.append(next(iter(rows.values()))["prefix"])
    assert len(set(prefixes)) == len(prefixes), prefixes  # no attempt met under an earlier one's keys
    full = [a for a, rows in found.items() if len(rows) == world]
    assert len(full) >= 10, sorted(full)  # the kills after the launch leave full attempts
    print(f"{len(found)} of {restarts + 1} attempts launched, {len(full)} on every rank; {took:.0f} s in all")


@pytest.mark.timeout(900)
def test_torch_alone_fails_after_the_restart(tmp_path: Path) -> None:
    # The comparison: init_process_group from torchrun's variables, rank 3 dies after the launch
    # on attempt 0. The agent store keeps attempt 0's keys and the restarted ranks read them.
    # torch alone does not always fail: a restarted rank that reads a fresh key before a stale one
    # meets the others (make test-faults saw rc 0 once, on a machine loaded by another job), so the
    # job runs up to three times and the comparison is the first run that failed.
    plan = {"0": {"rank": 3, "point": "after"}}
    for tries in range(3):
        out = tmp_path / f"try-{tries}"
        out.mkdir()
        proc = run_torchrun(
            4, ["--max-restarts", "1", SCRIPT, str(out), json.dumps(plan), "--plain"], timeout=280
        )
        if proc.returncode != 0:
            break
    assert proc.returncode != 0, "torch alone survived the restart three times in a row"
    found = attempts(out)
    assert all(row["launched"] for row in found[0].values()), found[0]
    failed = [row for row in found.get(1, {}).values() if not row["launched"]]
    assert failed, found.get(1)
    # A restarted rank that reads attempt 0's addresses fails to connect ("connectFullMesh
    # failed"); under load a rank can instead connect to the ranks whose keys were fresh and wait
    # out dist.timeout in the first all-reduce for a peer that went away (CI saw that shape).
    shapes = ("Gloo connectFullMesh failed", "Timed out waiting")
    assert all(any(shape in row["error"] for shape in shapes) for row in failed), failed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("who", ["all-but-3", "only-0"])
def test_abort_ends_a_hung_collective_and_the_relaunch_works(tmp_path: Path, who: str) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "abort_worker.py"),
                str(r),
                "4",
                str(port),
                str(tmp_path),
                who,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(4)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(log[-2000:] for log in logs)
    rows = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    stuck = [r for r in rows if "raised" in r]
    assert [r["rank"] for r in stuck] == ([0, 1, 2] if who == "all-but-3" else [0])
    for row in stuck:
        assert row["raised"] is not None and "Connection closed" in row["raised"], row
        assert row["after_abort_s"] < 5.0, row  # dist.timeout is 60 s: without abort it waits that long
        assert row["abort_s"] < 5.0, row
    for row in rows:
        for launch in ("first", "second"):
            assert row[launch]["errors"] == [], row
            assert row[launch]["tensor_sum"] == row[launch]["tensor_expected"], row
    print(
        f"{who}: collective raised {max(r['after_abort_s'] for r in stuck):.2f} s after abort(); "
        f"abort() took {max(r['abort_s'] for r in stuck):.2f} s; relaunch {max(r['relaunch_s'] for r in rows):.2f} s"
    )


@pytest.mark.timeout(600)
def test_inprocess_restart_recipe(tmp_path: Path) -> None:
    # examples/inprocess_restart.py: rank 3 hangs at step 10 of 30; the hang reports name it, the
    # handlers abort, ranks 0-2 relaunch in their own processes and a new rank 3 (the rank the
    # reports named) joins; the weight matches serial.
    out = tmp_path / "inprocess.json"
    proc = subprocess.run(
        [sys.executable, "examples/inprocess_restart.py", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    times, events = result["times"], result["events"]
    # only the hung rank, replaced as soon as a hang report named it missing; each report names
    # it (the global group, the all-reduce), at most once a rank. A survivor whose own report had
    # not come yet when a peer aborted is woken by that abort (its all-reduce raises) and reports
    # nothing: every survivor raised, and at least one reported
    assert [r["rank"] for r in result["replaced"]] == [3], result["replaced"]
    assert result["replaced"][0]["named_by"] and set(result["replaced"][0]["named_by"]) <= {0, 1, 2}
    reports = sorted(
        (r["rank"], r["mode"], r["call"], r["missing"]) for r in events if r["event"] == "hang-report"
    )
    assert reports, events
    assert len({r[0] for r in reports}) == len(reports), reports
    assert all(r[0] in (0, 1, 2) and r[1:] == ("global", "all_reduce(float64[1])", [3]) for r in reports), (
        reports
    )
    assert sorted({r["rank"] for r in events if r["event"] == "raised"}) == [0, 1, 2], events
    assert set(times["final_weights"].values()) == {times["serial_weight"]}
    assert sorted(times["final_weights"]) == ["0", "1", "2", "3"]
    for rank in (0, 1, 2):  # the survivors relaunched in the same process
        pids = {(r["event"], r["pid"]) for r in events if r["rank"] == rank and r["event"] == "launched"}
        assert (
            len(pids) == 1 and len([r for r in events if r["rank"] == rank and r["event"] == "launched"]) == 2
        )
    assert times["abort_to_raise_s"] < 5.0, times
    print({k: round(v, 2) for k, v in times.items() if isinstance(v, float)})


def test_abort_ends_a_collective_on_a_group_the_megatron_bridge_made() -> None:
    # Groups parallelctx makes after launch (install(create_all_gather_group=True)) are aborted too.
    pytest.importorskip("megatron.core")
    proc = run_torchrun(4, ["tests/torchrun_abort_megatron.py"], timeout=200)
    raised = [line for line in proc.stdout.splitlines() if line.startswith("ABORT-")]
    assert raised and raised[0].startswith("ABORT-RAISED"), proc.stdout[-2000:] + proc.stderr[-3000:]
    assert float(raised[0].split()[1]) < 15, raised  # rank 3 sleeps 30 s: it was the abort


@pytest.mark.timeout(400)
def test_abort_ends_a_wait_on_a_lazy_bridge_group_10_cycles_and_leaves_user_servers_alone(
    tmp_path: Path,
) -> None:
    # A bridge group that never connected (gloo_lazy_init): only wake() ends the wait of the
    # rank with no socket. 10 cycles in the same processes (which rank waits with no socket
    # depends on the ports), a user thread opening and closing sockets all through, and a user
    # server opened after launch and before install(): abort() must not connect to it.
    pytest.importorskip("megatron.core")
    proc = run_torchrun(4, ["tests/torchrun_abort_megatron_lazy.py", str(tmp_path), "10"], timeout=360)
    # On failure the ranks' own lines first (torchrun's summary of the failure fills the tail)
    ours = [
        line for line in (proc.stdout + proc.stderr).splitlines() if "parallelctx" in line or "Error" in line
    ]
    assert proc.returncode == 0, "\n".join(ours)[-5000:] + "\n...\n" + proc.stderr[-2000:]
    # Every group's gloo loop found: the user thread opens more descriptors while a group is made
    # than the slots leave room for (seen in 2 of about 20 runs: a loop not found, so rank 3's
    # wait outlived the abort by dist.timeout and the next launch timed out; 25 groups a run missed)
    assert "was not found among" not in proc.stderr, "\n".join(ours)[-5000:]
    rows = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1, 2, 3], proc.stdout[-3000:]
    worst, pokes = 0.0, []
    for row in rows:
        assert row["sum"][0] == row["sum"][1], row  # the launch after the cycles works
        assert len(row["cycles"]) == 10
        for c in row["cycles"]:
            assert c["server_pokes"] == 0, (row["rank"], c)
            if c["waited"]:
                assert c["raised"] and "Connection closed" in c["raised"], (row["rank"], c)
                assert c["after_abort_s"] < 2.0, (row["rank"], c)
                worst = max(worst, c["after_abort_s"])
                pokes.append(c["pokes"])
    print(f"20 waits raised at most {worst:.2f} s after abort(); user-thread listeners poked {pokes}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dies", [1, 3])
def test_two_agents_restart_after_a_rank_died_before_launching_and_every_launch_pairs(
    tmp_path: Path, dies: int
) -> None:
    # The agent whose worker did not fail keeps TORCHELASTIC_RESTART_COUNT 0, which the dead
    # rank 0 had posted with its later launches: a new rank there that took the count as the
    # attempt's name stopped at once on the dead rank 0, and the launches went out of step (a
    # skeptic's 4 of 4 runs). Across nodes the attempt is not named: the new ranks wait for the
    # new rank 0 (1 s late) and pair.
    script = "tests/torchrun_restart_after_early_death.py"
    done = two_agents(tmp_path, {"dies": dies}, 240, script=script)
    assert all(p.returncode == 0 for p in done), done[0].stdout[-3000:] + done[1].stdout[-3000:]
    rows = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    for rank, row in enumerate(rows):
        assert row[0::2] == [10.0, 10.0], (rank, row)
        assert max(row[1::2]) < 8.0, (rank, row)  # met, not timed out
