"""spawn, init_dist and the launch adapters, with real processes (gloo on 127.0.0.1).

Workers are module-level functions (spawned children import this module). Group membership is
proven by collectives (parallelctx.cli.verify.probe_groups) and compared with the pure layout.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import parallelctx
from parallelctx import LaunchEnvError, ParallelMode, SpawnError, gpc, init_dist, plan, spawn
from parallelctx.cli.verify import probe_groups, problems, verify
from parallelctx.launch import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_launcher_env(clean_launcher_env: pytest.MonkeyPatch) -> None:
    """Every test here starts from an environment without launcher variables."""


# ----------------------------------------------------------------------------- workers


def probe_worker(out_dir: str, tensor: int) -> None:
    """Prove this rank's groups by collectives; write them with what gpc counted."""
    rank = gpc.get_global_rank()
    world = gpc.get_world_size(ParallelMode.GLOBAL)
    errors = problems(verify(plan(world, tensor=tensor), {rank: probe_groups(gpc)}))
    info = {
        "rank": rank,
        "pid": os.getpid(),
        "errors": errors,
        "local_rank": gpc.local_rank,
        "procs_on_node": gpc.num_processes_on_current_node,
        "num_nodes": gpc.num_nodes,
        "tensor": gpc.get_ranks_in_group(ParallelMode.TENSOR),
    }
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(info))


def failing_worker(bad_rank: int) -> None:
    """Raise a ValueError on ``bad_rank``."""
    if gpc.get_global_rank() == bad_rank:
        raise ValueError(f"bad batch on rank {bad_rank}")


def exiting_worker(bad_rank: int) -> None:
    """Exit with code 7 on ``bad_rank`` without raising."""
    if gpc.get_global_rank() == bad_rank:
        os._exit(7)


def sleeping_worker() -> None:
    """Never finish (for join_timeout)."""
    time.sleep(3600)


def in_place_worker(seen: list[int]) -> None:
    """Record this process id and the world size (in place, the caller sees the list change)."""
    seen.extend([os.getpid(), gpc.get_world_size(ParallelMode.GLOBAL)])


def read(out_dir: Path, world: int) -> list[dict]:
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(world)]


# ----------------------------------------------------------------------------- spawn


def test_spawn_four_ranks(tmp_path: Path) -> None:
    # a Config object (not a dict) crosses the process boundary by pickling
    spawn(
        probe_worker,
        nprocs_per_node=4,
        args=(str(tmp_path), 2),
        config=parallelctx.Config({"parallel": {"tensor": 2}}),
        join_timeout=300,
    )
    rows = read(tmp_path, 4)
    assert all(r["errors"] == [] for r in rows), rows
    assert [r["local_rank"] for r in rows] == [0, 1, 2, 3]
    assert all(r["procs_on_node"] == 4 and r["num_nodes"] == 1 for r in rows)
    assert [r["tensor"] for r in rows] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert len({r["pid"] for r in rows} | {os.getpid()}) == 5  # four other processes
    assert not gpc.is_initialized(ParallelMode.GLOBAL)


def test_spawn_reraises_the_worker_exception_with_its_rank() -> None:
    with pytest.raises(ValueError, match="bad batch on rank 1") as info:
        spawn(failing_worker, nprocs_per_node=2, args=(1,), join_timeout=300)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised in spawned rank 1 (worker 1 on node 0)" in notes
    assert "failing_worker" in notes  # the worker's traceback


def test_spawn_names_the_rank_that_died() -> None:
    with pytest.raises(SpawnError, match=r"rank 1 \(worker 1 on node 0\) exited with code 7") as info:
        spawn(exiting_worker, nprocs_per_node=2, args=(1,), join_timeout=300)
    assert info.value.rank == 1


@pytest.mark.slow
def test_spawn_join_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="join_timeout=15"):
        spawn(sleeping_worker, nprocs_per_node=2, join_timeout=15)
    assert time.monotonic() - start < 60


def test_spawn_one_process_runs_in_place() -> None:
    seen: list[int] = []
    spawn(in_place_worker, nprocs_per_node=1, args=(seen,))
    assert seen == [os.getpid(), 1]
    assert not gpc.is_initialized(ParallelMode.GLOBAL)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nprocs_per_node": 2, "num_nodes": 2}, "dist_url='auto' .* cannot serve num_nodes=2"),
        ({"nprocs_per_node": 0}, "nprocs_per_node=0"),
        (
            {"nprocs_per_node": 1, "num_nodes": 2, "node_rank": 2, "dist_url": "tcp://127.0.0.1:1"},
            "node_rank=2",
        ),
        (
            {"nprocs_per_node": 2, "dist_url": "http://x"},
            "must be 'auto', 'tcp://host:port' or 'file:///path'",
        ),
        ({"nprocs_per_node": 2, "join_timeout": 0}, "join_timeout=0 must be positive"),
    ],
)
def test_spawn_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spawn(in_place_worker, args=([],), **kwargs)


def test_spawn_two_nodes_over_a_file_url(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # node 1 runs in another process; node 0 here. A file:// URL across nodes logs a warning.
    url = f"file://{tmp_path / 'rendezvous'}"
    out = tmp_path / "out"
    out.mkdir()
    node1 = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
        import parallelctx, test_spawn
        parallelctx.spawn(test_spawn.probe_worker, nprocs_per_node=1, num_nodes=2, node_rank=1,
                          dist_url={url!r}, args=({str(out)!r}, 1), join_timeout=300)
    """)
    other = subprocess.Popen(
        [sys.executable, "-c", node1],
        cwd=ROOT,
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with caplog.at_level(logging.WARNING, logger="parallelctx"):
            spawn(
                probe_worker,
                nprocs_per_node=1,
                num_nodes=2,
                node_rank=0,
                dist_url=url,
                args=(str(out), 1),
                join_timeout=300,
            )
        output, _ = other.communicate(timeout=300)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait(timeout=30)
    assert other.returncode == 0, output
    assert "needs a file system that every node shares" in caplog.text
    rows = read(out, 2)
    assert all(r["errors"] == [] and r["local_rank"] == 0 for r in rows), rows


# ----------------------------------------------------------------------------- init_dist


def test_init_dist_rejects_unknown_launcher_and_bad_timeout() -> None:
    with pytest.raises(
        ValueError, match="launcher='pbs' is not one of 'torchrun', 'pytorch', 'torch', 'mpi'"
    ):
        init_dist("pbs")
    with pytest.raises(TypeError, match=r"timeout='60' must be seconds .* or a datetime.timedelta"):
        init_dist("pytorch", timeout="60")
    assert not gpc.is_initialized(ParallelMode.GLOBAL)


SLURM_ONE = {
    "SLURM_PROCID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_JOB_ID": "5",
}
TORCH_ONE = {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29999",
    "TORCHELASTIC_RUN_ID": "x",
}
OMPI_ONE = {
    "OMPI_COMM_WORLD_RANK": "0",
    "OMPI_COMM_WORLD_SIZE": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
}


@pytest.mark.parametrize(
    ("launcher", "env", "timeout"),
    [("slurm", SLURM_ONE, 90), ("pytorch", TORCH_ONE, 12.5), ("mpi", OMPI_ONE, timedelta(minutes=2))],
)
def test_init_dist_launches(monkeypatch: pytest.MonkeyPatch, launcher: str, env: dict, timeout) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        ctx = init_dist(launcher, config={"seed": 7}, timeout=timeout)
        assert ctx is gpc
        assert gpc.get_world_size(ParallelMode.GLOBAL) == 1 and gpc.local_rank == 0
        assert gpc.config.seed == 7
        # the timeout reached torch: the default group's backend holds it
        held = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
        assert held == (timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout))
    finally:
        gpc.destroy()


def test_init_dist_slurm_outside_srun() -> None:
    with pytest.raises(LaunchEnvError, match="SLURM_STEP_ID is not set"):
        init_dist("slurm")
    with pytest.raises(LaunchEnvError, match="no MPI rank variable is set"):
        init_dist("mpi")


def test_launch_from_env_refuses_sbatch_without_srun(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "9"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LaunchEnvError, match="Start the script with srun"):
        parallelctx.launch_from_env()
    assert not gpc.is_initialized(ParallelMode.GLOBAL)


# ----------------------------------------------------------------------------- mismatch report

FAKE_SRUN_TASK = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
import parallelctx
from parallelctx import gpc
parallelctx.launch_from_env(timeout=120)
print("RESULT", gpc.get_global_rank(), gpc.local_rank, gpc.num_processes_on_current_node, gpc.num_nodes)
gpc.destroy()
"""


def test_launcher_counts_that_disagree_with_the_hosts_are_reported() -> None:
    # Two real processes on this one host, with the variables srun would set for one task on
    # each of two nodes: the node and per-node counts disagree with the hosts gpc counts.
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(
            {
                "SLURM_PROCID": str(rank),
                "SLURM_STEP_ID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": str(rank),
                "SLURM_STEP_NUM_NODES": "2",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
                "SLURM_STEP_NODELIST": "localhost,127.0.0.1",
                "SLURM_JOB_ID": "77",
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "lo",
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", FAKE_SRUN_TASK],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, output
        assert f"RESULT {rank} 0 2 1" in output, output  # local rank 0 from SLURM_LOCALID
        assert "the launcher says 1 processes run on this node, but 2 ranks share host" in output
        assert "slurm says the job spans 2 nodes, but its ranks run on 1 distinct hosts" in output
