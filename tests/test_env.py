"""Launcher detection with fabricated environments (what each launcher really set on the test
machine, per ../shared/launchers/README.md), including the traps: torchrun inside srun, mpirun
and mpiexec inside an allocation, sbatch without srun, mpiexec -pmi-port."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallelctx.env import (
    SLURM_PORT_RANGE,
    LaunchEnv,
    LaunchEnvError,
    detect,
    from_mpi,
    from_slurm,
    from_torchrun,
    slurm_port,
)

ROOT = Path(__file__).resolve().parents[1]


def torchrun_env(rank: int = 2, local: int = 0, node: int = 1) -> dict[str, str]:
    """torchrun --nnodes 2 --nproc-per-node 2, static rendezvous."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "GROUP_RANK": str(node),
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29555",
        "TORCHELASTIC_RUN_ID": "none",
    }


def srun_env(procid: int = 3, localid: int = 1, nodeid: int = 1, job: int = 42) -> dict[str, str]:
    """srun -N2 --ntasks-per-node=2 on nodes n1, n2."""
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURMD_NODENAME": f"n{nodeid + 1}",
        "SLURM_NTASKS": "4",
        "SLURM_NPROCS": "4",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODELIST": "n[1-2]",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_JOB_ID": str(job),
        "SLURM_JOBID": str(job),
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
    }


def batch_shell_env() -> dict[str, str]:
    """The sbatch -N2 --ntasks-per-node=2 batch script itself: one process, no step."""
    return {
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_NPROCS": "4",
        "SLURM_TASKS_PER_NODE": "2(x2)",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_ID": "17",
        "SLURM_JOBID": "17",
        "SLURM_NNODES": "2",
    }


def ompi_env(rank: int = 3, local: int = 1, local_size: int = 2) -> dict[str, str]:
    """mpirun -np 4 on two fake hosts (2 slots each)."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_COMM_WORLD_NODE_RANK": str(local),
        "OMPI_UNIVERSE_SIZE": "6",
        "PMIX_RANK": str(rank),
        "OMPI_MCA_orte_num_nodes": "2",
    }


def mpich_env(rank: int = 2, local: int = 0) -> dict[str, str]:
    """mpiexec.mpich -n 4 on two fake hosts."""
    return {
        "PMI_RANK": str(rank),
        "PMI_SIZE": "4",
        "PMI_FD": "6",
        "MPI_LOCALRANKID": str(local),
        "MPI_LOCALNRANKS": "2",
        "HYDI_CONTROL_FD": "7",
    }


# ----------------------------------------------------------------------------- torchrun


def test_torchrun() -> None:
    found = detect(torchrun_env())
    assert (found.launcher, found.rank, found.world_size, found.local_rank) == ("torchrun", 2, 4, 0)
    assert (found.local_world_size, found.node_rank, found.num_nodes) == (2, 1, 2)
    assert (found.master_addr, found.master_port) == ("127.0.0.1", 29555)
    assert dict(found.variables)["GROUP_RANK"] == "1"


def test_torchrun_inside_srun_is_torchrun() -> None:
    # srun -N2 --ntasks-per-node=1 torchrun --nproc-per-node 2: the worker sees both sets
    env = {
        **srun_env(procid=1, localid=0, nodeid=1),
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        **torchrun_env(rank=3, local=1, node=1),
    }
    found = detect(env)
    assert (found.launcher, found.rank, found.world_size, found.local_rank) == ("torchrun", 3, 4, 1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": "4"}, r"RANK=4 must lie in \[0, WORLD_SIZE=4\)"),
        ({"LOCAL_RANK": "2"}, r"LOCAL_RANK=2 must lie in \[0, LOCAL_WORLD_SIZE=2\)"),
        ({"WORLD_SIZE": "four"}, "WORLD_SIZE='four' is not an integer; start the script with torchrun"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 must be a TCP port"),
        ({"GROUP_RANK": "2"}, r"GROUP_RANK=2 must lie in \[0, GROUP_WORLD_SIZE=2\)"),
    ],
)
def test_torchrun_inconsistent(change: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchEnvError, match=message):
        detect({**torchrun_env(), **change})


def test_torchrun_partial() -> None:
    env = torchrun_env()
    del env["MASTER_ADDR"]
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR is not set; start the script with torchrun"):
        detect(env)
    # only RANK set (no TORCHELASTIC_RUN_ID, no WORLD_SIZE): not torchrun, a world of one
    assert detect({"RANK": "3"}).launcher == "none"
    with pytest.raises(LaunchEnvError, match="RANK is not set"):
        from_torchrun({}, required=True)


# ----------------------------------------------------------------------------- Slurm


def test_srun() -> None:
    found = detect(srun_env())
    assert (found.launcher, found.rank, found.world_size, found.local_rank) == ("slurm", 3, 4, 1)
    assert (found.local_world_size, found.node_rank, found.num_nodes) == (2, 1, 2)
    assert found.master_addr == "n1"
    assert found.master_port == slurm_port(42, 0)
    assert SLURM_PORT_RANGE[0] <= found.master_port < SLURM_PORT_RANGE[1]


def test_srun_uneven_and_hostlist_forms() -> None:
    # srun -N2 -n4 without --ntasks-per-node gave SLURM_TASKS_PER_NODE=3,1
    env = {
        **srun_env(procid=3, localid=0, nodeid=1),
        "SLURM_STEP_TASKS_PER_NODE": "3,1",
        "SLURM_STEP_NODELIST": "gpu-a[07-08]",
        "SLURM_JOB_NODELIST": "gpu-a[07-08],cpu1",
    }
    found = detect(env)
    assert (found.local_world_size, found.master_addr) == (1, "gpu-a07")
    env0 = {**env, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}
    assert detect(env0).local_world_size == 3
    # no step node list: the job's
    del env["SLURM_STEP_NODELIST"]
    assert detect(env).master_addr == "gpu-a07"


def test_srun_master_overrides() -> None:
    env = {**srun_env(), "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "23456"}
    found = detect(env)
    assert (found.master_addr, found.master_port) == ("10.0.0.5", 23456)


def test_slurm_port_spreads_jobs_and_steps() -> None:
    ports = {slurm_port(job, step) for job in range(1000, 1900) for step in range(16)}
    assert len(ports) == 900 * 16  # 900 consecutive jobs x 16 steps: all distinct
    assert all(SLURM_PORT_RANGE[0] <= p < SLURM_PORT_RANGE[1] for p in ports)
    assert slurm_port(1000) != slurm_port(1001) and slurm_port(7, 0) != slurm_port(7, 1)
    assert SLURM_PORT_RANGE[1] <= 32768  # below Linux's ephemeral ports


def test_sbatch_without_srun_is_refused() -> None:
    with pytest.raises(LaunchEnvError, match=r"batch shell of Slurm job 17, .*Start the script with srun"):
        detect(batch_shell_env())
    # the shell salloc -N2 --ntasks-per-node=2 opens has no SLURM_PROCID either (seen on the test cluster)
    salloc = {
        "SLURM_JOB_ID": "1",
        "SLURM_NTASKS": "4",
        "SLURM_NPROCS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_NNODES": "2",
    }
    with pytest.raises(LaunchEnvError, match=r"salloc shell \(SLURM_NTASKS=4, no SLURM_STEP_ID\)"):
        detect(salloc)
    assert detect({"SLURM_JOB_ID": "2", "SLURM_JOB_NODELIST": "n1"}).launcher == "none"  # salloc -N1
    # a one-task batch job running python directly is a world of one
    one = {**batch_shell_env(), "SLURM_NTASKS": "1", "SLURM_NPROCS": "1"}
    assert detect(one).launcher == "none"
    with pytest.raises(LaunchEnvError, match="not started by srun"):
        from_slurm(one, required=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_PROCID": "4"}, r"SLURM_PROCID=4 must lie in \[0, SLURM_NTASKS=4\)"),
        ({"SLURM_LOCALID": "2"}, r"SLURM_LOCALID=2 must lie in \[0, SLURM_STEP_TASKS_PER_NODE=2\)"),
        ({"SLURM_NODEID": "2"}, r"SLURM_NODEID=2 must lie in \[0, SLURM_STEP_NUM_NODES=2\)"),
        ({"SLURM_STEP_NODELIST": "n[1-2"}, "SLURM_STEP_NODELIST: host list 'n\\[1-2': '\\[' is never closed"),
        ({"SLURM_STEP_NODELIST": "n[1-3]"}, "names 3 hosts but the step has 2 nodes"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(2)"}, "SLURM_STEP_TASKS_PER_NODE: task count list"),
        ({"SLURM_LOCALID": ""}, "SLURM_LOCALID is not set; start every task with srun"),
    ],
)
def test_srun_inconsistent(change: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchEnvError, match=message):
        detect({**srun_env(), **change})


def test_srun_without_node_list_or_job() -> None:
    env = srun_env()
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        del env[key]
    with pytest.raises(LaunchEnvError, match="export MASTER_ADDR"):
        detect(env)
    env = srun_env()
    del env["SLURM_JOB_ID"], env["SLURM_JOBID"]
    with pytest.raises(LaunchEnvError, match="export MASTER_PORT"):
        detect(env)


# ----------------------------------------------------------------------------- MPI


def test_openmpi() -> None:
    found = detect({**ompi_env(), "MASTER_ADDR": "nodeA", "MASTER_PORT": "29600"})
    assert (found.launcher, found.rank, found.world_size, found.local_rank) == ("openmpi", 3, 4, 1)
    assert (found.local_world_size, found.master_addr, found.master_port) == (2, "nodeA", 29600)
    assert found.node_rank is None  # OMPI_COMM_WORLD_NODE_RANK is not a node index
    assert detect(ompi_env()).master_addr is None


def test_mpich_and_mvapich() -> None:
    found = detect(mpich_env())
    assert (found.launcher, found.rank, found.world_size, found.local_rank, found.local_world_size) == (
        "mpich",
        2,
        4,
        0,
        2,
    )
    mv2 = {
        "MV2_COMM_WORLD_RANK": "1",
        "MV2_COMM_WORLD_SIZE": "2",
        "MV2_COMM_WORLD_LOCAL_RANK": "1",
        "MV2_COMM_WORLD_LOCAL_SIZE": "2",
    }
    found = detect(mv2)
    assert (found.launcher, found.rank, found.world_size, found.local_rank) == ("mvapich", 1, 2, 1)


def test_mpirun_inside_allocation_uses_mpi_ranks() -> None:
    # mpirun inside salloc -N2 --ntasks-per-node=2: SLURM_* describe the orted step (0,0,1,1 of 2)
    env = {
        **srun_env(procid=1, localid=0, nodeid=1),
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        **ompi_env(rank=3, local=1),
    }
    found = detect(env)
    assert (found.launcher, found.rank, found.world_size, found.local_rank) == ("openmpi", 3, 4, 1)
    # mpiexec.mpich inside salloc: PMI_RANK 0..3 beside SLURM_PROCID 0,0,1,1
    env = {**srun_env(procid=0, localid=0, nodeid=0), **mpich_env(rank=1, local=1)}
    found = detect(env)
    assert (found.launcher, found.rank, found.local_rank) == ("mpich", 1, 1)


def test_srun_mpi_pmi2_has_no_local_rank_variable() -> None:
    env = {**srun_env(), "PMI_RANK": "3", "PMI_SIZE": "4", "PMI_FD": "5", "PMI_JOBID": "42.0"}
    found = detect(env)
    assert (found.launcher, found.rank, found.world_size, found.local_rank) == ("mpich", 3, 4, None)


def test_mpi_errors() -> None:
    with pytest.raises(LaunchEnvError, match="-pmi-port"):
        detect({"PMI_ID": "0", "PMI_PORT": "127.0.0.1:5000"})
    with pytest.raises(
        LaunchEnvError, match=r"OMPI_COMM_WORLD_RANK=4 must lie in \[0, OMPI_COMM_WORLD_SIZE=4\)"
    ):
        detect(ompi_env(rank=4))
    with pytest.raises(LaunchEnvError, match="OMPI_COMM_WORLD_SIZE is not set; start the script with mpirun"):
        detect({"OMPI_COMM_WORLD_RANK": "0"})
    with pytest.raises(LaunchEnvError, match="no MPI rank variable is set"):
        from_mpi({}, required=True)
    with pytest.raises(LaunchEnvError, match="MPI_LOCALRANKID=2 must lie in"):
        detect(mpich_env(local=2))


# ----------------------------------------------------------------------------- order, CLI


def test_plain_process_is_a_world_of_one() -> None:
    found = detect({"HOME": "/root", "PATH": "/usr/bin"})
    assert found == LaunchEnv(
        launcher="none", rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0, num_nodes=1
    )
    assert found.as_dict()["variables"] == {}


def test_detectors_do_not_import_torch() -> None:
    for path in sorted((ROOT / "parallelctx" / "env").glob("*.py")):  # the env package, hostlist included
        tree = ast.parse(path.read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        imported |= {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 0
        }
        assert not imported & {"torch", "numpy", "parallelctx"}, (path.name, imported)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_", "TORCHELASTIC_"))
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        clean.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "parallelctx", "env", *args],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_env_table_and_json() -> None:
    out = _cli(srun_env())
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(None, 1) for line in out.stdout.splitlines()[2:] if len(line.split(None, 1)) == 2)
    assert lines["launcher"] == "slurm" and lines["rank"] == "3" and lines["master_addr"] == "n1"
    assert lines["local_world_size"] == "2" and lines["SLURM_STEP_NODELIST"] == "n[1-2]"
    out = _cli(ompi_env(), "--json")
    info = json.loads(out.stdout)
    assert info["launcher"] == "openmpi" and info["rank"] == 3 and info["master_addr"] is None
    assert info["variables"]["OMPI_COMM_WORLD_SIZE"] == "4"


def test_cli_env_refuses_batch_shell() -> None:
    out = _cli(batch_shell_env())
    assert out.returncode == 2
    assert "Start the script with srun" in out.stderr


# ----------------------------------------------------------------------------- damaged variables


@pytest.mark.parametrize("value", ["1_0", "+1", " 1", "1 ", "١", "0x1", "1e3", "", "9" * 19, "9" * 5000])
def test_only_plain_digits_are_integers(value: str) -> None:
    # int() reads '1_0' as 10 and '١' (Arabic-Indic one) as 1; a launcher writes plain digits
    env = {**torchrun_env(), "RANK": value}
    if value == "":
        with pytest.raises(LaunchEnvError, match="RANK is not set"):
            detect(env)
        return
    with pytest.raises(
        LaunchEnvError, match=r"RANK='.*' is not an integer; start the script with torchrun"
    ) as info:
        detect(env)
    assert "plain digits 0-9" in str(info.value) and len(str(info.value)) < 300


def test_world_size_beyond_the_maximum_is_refused() -> None:
    # WORLD_SIZE=2**40 used to reach torch and fail there with a pybind TypeError
    env = {**torchrun_env(rank=0), "WORLD_SIZE": str(2**40)}
    with pytest.raises(
        LaunchEnvError, match=r"WORLD_SIZE=1099511627776 is larger than .*MAX_WORLD_SIZE=16777216"
    ):
        detect(env)
    with pytest.raises(LaunchEnvError, match="OMPI_COMM_WORLD_SIZE=1099511627776 is larger"):
        detect({**ompi_env(), "OMPI_COMM_WORLD_SIZE": str(2**40)})


def test_local_rank_and_node_beyond_the_world_are_refused() -> None:
    env = {k: v for k, v in ompi_env().items() if k != "OMPI_COMM_WORLD_LOCAL_SIZE"}
    with pytest.raises(
        LaunchEnvError, match=r"OMPI_COMM_WORLD_LOCAL_RANK=99 must lie in \[0, OMPI_COMM_WORLD_SIZE=4\)"
    ):
        detect({**env, "OMPI_COMM_WORLD_LOCAL_RANK": "99"})
    env = {
        k: v
        for k, v in srun_env().items()
        if k not in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    }
    with pytest.raises(LaunchEnvError, match=r"SLURM_NODEID=7 must lie in \[0, SLURM_NTASKS=4\)"):
        detect({**env, "SLURM_NODEID": "7"})


def test_slurm_step_id_must_be_an_integer() -> None:
    # SLURM_STEP_ID=abc used to be read as step 0 silently
    with pytest.raises(
        LaunchEnvError, match="SLURM_STEP_ID='abc' is not an integer; start every task with srun"
    ):
        detect({**srun_env(), "SLURM_STEP_ID": "abc"})
    assert detect({**srun_env(), "SLURM_STEP_ID": "3", "SLURM_STEPID": "3"}).master_port == slurm_port(42, 3)


def test_huge_slurm_node_list_is_not_expanded() -> None:
    # SLURM_JOB_NODELIST='n[1-100000000]' used to be expanded in full (MemoryError after 7 s)
    import time

    env = {**srun_env(), "SLURM_JOB_NODELIST": "n[1-100000000]", "SLURM_TASKS_PER_NODE": "2(x100000000)"}
    del env["SLURM_STEP_NODELIST"], env["SLURM_STEP_TASKS_PER_NODE"]
    start = time.perf_counter()
    found = detect(env)
    assert time.perf_counter() - start < 1.0
    assert (found.master_addr, found.local_world_size) == ("n1", 2)
    env["SLURM_STEP_NODELIST"] = "n[1-100000000]"
    with pytest.raises(LaunchEnvError, match="names 100000000 hosts but the step has 2 nodes"):
        detect(env)


def test_two_mpi_families_that_disagree_are_refused() -> None:
    # an Open MPI job started inside an MPICH one: OMPI used to win silently
    env = {**ompi_env(rank=3), "PMI_RANK": "0", "PMI_SIZE": "1"}
    with pytest.raises(
        LaunchEnvError,
        match=(
            r"OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_SIZE=4 \(openmpi\) disagree with PMI_RANK=0, "
            r"PMI_SIZE=1 \(mpich\).*unset the stale mpich variables"
        ),
    ):
        detect(env)
    with pytest.raises(LaunchEnvError, match="MV2_COMM_WORLD_RANK=2"):
        detect({**ompi_env(rank=3), "MV2_COMM_WORLD_RANK": "2"})
    with pytest.raises(LaunchEnvError, match="PMI_RANK='x' is not an integer"):
        detect({**ompi_env(rank=3), "PMI_RANK": "x"})
    # agreeing families are fine (the first family wins; both are listed as read)
    found = detect({**ompi_env(rank=3), "PMI_RANK": "3", "PMI_SIZE": "4"})
    assert (found.launcher, found.rank) == ("openmpi", 3)
    assert dict(found.variables)["PMI_RANK"] == "3"


def test_free_port_draws_below_the_outgoing_connection_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port comes from below the range outgoing connections take their ports from (where a
    peer's next connect could take it before rank 0's store binds it), and binds; where that
    range starts too low to leave room, the OS picks one."""
    import socket

    from parallelctx.env import ports as env

    low = env._ephemeral_low()
    ports = {env.free_port() for _ in range(20)}
    assert all(env._PORT_FLOOR <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 1  # drawn, not one fixed port every job would collide on
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))
    monkeypatch.setattr(env, "_ephemeral_low", lambda: env._PORT_FLOOR + 10)
    assert not env._PORT_FLOOR <= env.free_port() < env._PORT_FLOOR + 10
