"""parallelctx under the real launchers (``make test-launchers``, marker ``launchers``).

torchrun (standalone, and two "hosts" made of two ``unshare --uts`` halves), Open MPI's mpirun
(one host and two fake hosts), MPICH's mpiexec (one host and two fake hosts), and a real Slurm
cluster with two fake nodes (srun, sbatch + srun, the sbatch-without-srun refusal, torchrun
inside srun, mpirun inside an allocation). Every rank runs tests/launchers/probe.py: it launches
from the environment, proves its groups with collectives and writes what it found; the tests
compare that with what the launcher was asked for.

Packages are installed with apt-get when missing; the Slurm daemons are started by the
``slurm`` fixture and stopped by PID when the module ends (also on failure). Every subprocess
runs in its own session with a timeout and is killed, with its whole process group, after it.
Needs root (apt-get, unshare).
"""

from __future__ import annotations

import atexit
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from parallelctx.env import is_launcher_variable
from parallelctx.launch import free_port

sys.path.insert(0, str(Path(__file__).parent / "launchers"))
from cluster import SlurmCluster, ensure_packages

pytestmark = pytest.mark.launchers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROBE = HERE / "launchers" / "probe.py"
FAKE_SSH = HERE / "launchers" / "fake_ssh.sh"
PY = sys.executable
RUN_TIMEOUT = float(os.environ.get("PARALLELCTX_LAUNCHER_TIMEOUT", "300"))
MPIRUN = [
    "mpirun",
    "--allow-run-as-root",
    "--oversubscribe",
    "--mca",
    "oob_tcp_if_include",
    "lo",
    "--mca",
    "btl_tcp_if_include",
    "lo",
]


@pytest.fixture(scope="module", autouse=True)
def packages() -> None:
    if os.geteuid() != 0:
        pytest.fail("the launcher tests need root (apt-get, unshare); run them as root or in CI")
    ensure_packages()


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    env.update(
        GLOO_SOCKET_IFNAME="lo",  # the fake host names do not resolve to an interface
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PATH=f"{Path(PY).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    env.update(extra)
    return env


def _end(proc: subprocess.Popen[str], grace: float = 5.0) -> None:
    """SIGTERM the process group (srun and mpirun pass it on to their tasks), SIGKILL after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


def run(
    cmd: Sequence[str] | str,
    env: dict[str, str],
    timeout: float = RUN_TIMEOUT,
    cleanup: Sequence[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session. On timeout (or an interrupt) end its process group and
    run ``cleanup`` (e.g. scancel of the job)."""
    shell = isinstance(cmd, str)
    proc = subprocess.Popen(
        cmd,
        shell=shell,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as exc:
        _end(proc)
        if cleanup:
            subprocess.run(list(cleanup), env=env, timeout=30, capture_output=True)
        if isinstance(exc, subprocess.TimeoutExpired):
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"{cmd} did not finish within {timeout} s; killed. Output:\n{out[-4000:]}")
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def results(out_dir: Path, world: int, output: str) -> list[dict[str, Any]]:
    """Read every rank's probe result; fail with the launcher's output when one is missing."""
    errors = [p.read_text() for p in out_dir.glob("error-*.txt")]
    assert not errors, "a rank failed to launch:\n" + "\n".join(errors) + "\n" + output[-3000:]
    files = sorted(out_dir.glob("rank-*.json"))
    assert len(files) == world, f"{len(files)} of {world} ranks reported:\n{output[-4000:]}"
    rows = [json.loads(f.read_text()) for f in files]
    return sorted(rows, key=lambda r: r["rank"])


def check(
    rows: list[dict[str, Any]],
    launcher: str,
    world: int,
    per_node: Sequence[int],
    hosts: Sequence[str] | None = None,
) -> None:
    """The checks every launcher test makes on the gathered probe results.

    ``per_node``: processes on each node in node order (the node of rank 0 first);
    ``hosts``: the expected host names in that order, when they are known.
    """
    assert [r["rank"] for r in rows] == list(range(world))
    for r in rows:
        assert r["errors"] == [], (r["rank"], r["errors"])  # groups proven by collectives
        assert r["launcher"] == launcher and r["world_size"] == world
        assert r["num_nodes"] == len(per_node), (r["rank"], r["num_nodes"], per_node)
        assert r["procs_on_node"] == per_node[r["node_rank"]], r
        if r["detected"]["local_world_size"] is not None:  # the launcher's own count agrees
            assert r["detected"]["local_world_size"] == r["procs_on_node"], r
        if r["detected"]["num_nodes"] is not None:
            assert r["detected"]["num_nodes"] == r["num_nodes"], r
        if r["detected"]["local_rank"] is not None:
            assert r["local_rank"] == r["detected"]["local_rank"]
        # the detector's rank is the rank torch got: all-gathered (rank, local rank, host)
        assert [g[0] for g in r["gathered"]] == list(range(world))
    # local ranks are 0..k-1 on each host, and each host has its expected count
    by_host: dict[str, list[int]] = {}
    for r in rows:
        by_host.setdefault(r["host"], []).append(r["local_rank"])
    assert sorted(sorted(v) for v in by_host.values()) == sorted(list(range(n)) for n in per_node)
    if hosts is not None:
        assert list(dict.fromkeys(r["host"] for r in rows)) == list(hosts)
    # tensor=2 groups are pairs of neighbouring ranks, proven by all-reduce
    assert all(r["tensor_group"] == [r["rank"] // 2 * 2, r["rank"] // 2 * 2 + 1] for r in rows)
    # every relaunch in the same processes (when the test asked for some) was proven too
    for r in rows:
        assert all(c["errors"] == [] for c in r.get("relaunches", [])), (r["rank"], r["relaunches"])


def check_relaunches(rows: list[dict[str, Any]], count: int) -> None:
    """Each rank relaunched ``count`` times, each proven; print the median relaunch time."""
    seconds = sorted(c["seconds"] for r in rows for c in r["relaunches"])
    assert all(len(r["relaunches"]) == count for r in rows)
    print(f"median destroy + launch: {seconds[len(seconds) // 2]:.3f} s over {len(seconds)} relaunches")


# ------------------------------------------------------------------------------- host lists

SLURM_HOSTLISTS = [
    "n[1-2]",
    "node[001-004,010],gpu-a[1-2]",
    "gpu-a[1-2]b[0-1]",
    "rack[1-2]-n[01-02]",
    "node[08-11]",
    "node[1-010]",
    "n[01-2]",
    "n[001-2]",
    "c[9-10],c[1,5-6]",
    "node[007]",
    "a,,b",
    "a, b",
    "x[1-2]y[5]",
    "[1-2]",
    "n[1,1]",
    "n[1-2][3-4]",
    "solo",
    "h1,h2,h3",
]


def test_hostlist_parser_agrees_with_scontrol(tmp_path: Path) -> None:
    from parallelctx.hostlist import expand_hostlist

    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\n")  # scontrol parses it; no daemon needed
    for hostlist in SLURM_HOSTLISTS:
        out = run(["scontrol", "show", "hostnames", hostlist], clean_env(SLURM_CONF=str(conf)), timeout=60)
        assert out.returncode == 0 and "Invalid" not in out.stdout, (hostlist, out.stdout)
        assert expand_hostlist(hostlist) == out.stdout.split(), hostlist


# ------------------------------------------------------------------------------- torchrun


def test_torchrun_standalone(tmp_path: Path) -> None:
    # launch_from_torch, then 5 destroy/relaunch cycles on torchrun's own store and port
    out = run(
        [
            str(Path(PY).parent / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "4",
            str(PROBE),
            str(tmp_path),
            "--entry",
            "torch",
            "--relaunch",
            "5",
        ],
        clean_env(),
    )
    assert out.returncode == 0, out.stdout[-4000:]
    rows = results(tmp_path, 4, out.stdout)
    check(rows, "torchrun", 4, [4])
    check_relaunches(rows, 5)


def test_torchrun_two_hosts(tmp_path: Path) -> None:
    port = free_port()
    name = uuid.uuid4().hex[:6]
    halves = []
    for node in (0, 1):
        torchrun = (
            f"{Path(PY).parent / 'torchrun'} --nnodes 2 --nproc-per-node 2 --node-rank {node} "
            f"--master-addr 127.0.0.1 --master-port {port} {PROBE} {tmp_path}"
        )
        halves.append(f"unshare --uts sh -c 'hostname host{node}-{name} && exec {torchrun}'")
    out = run(f"{halves[0]} & {halves[1]} & wait %1 && wait %2", clean_env())
    assert out.returncode == 0, out.stdout[-4000:]
    rows = results(tmp_path, 4, out.stdout)
    check(rows, "torchrun", 4, [2, 2], hosts=[f"host0-{name}", f"host1-{name}"])
    assert [r["detected"]["node_rank"] for r in rows] == [0, 0, 1, 1]
    assert [r["node_rank"] for r in rows] == [0, 0, 1, 1]


# ------------------------------------------------------------------------------- MPI


def test_mpirun_one_host(tmp_path: Path) -> None:
    port = str(free_port())
    # launch_from_openmpi, then 5 destroy/relaunch cycles on the same MASTER_ADDR/MASTER_PORT
    out = run(
        [
            *MPIRUN,
            "-np",
            "4",
            "-x",
            "MASTER_ADDR=127.0.0.1",
            "-x",
            f"MASTER_PORT={port}",
            "-x",
            "GLOO_SOCKET_IFNAME",
            "-x",
            "PATH",
            PY,
            str(PROBE),
            str(tmp_path),
            "--entry",
            "mpi",
            "--relaunch",
            "5",
        ],
        clean_env(),
    )
    assert out.returncode == 0, out.stdout[-4000:]
    rows = results(tmp_path, 4, out.stdout)
    check(rows, "openmpi", 4, [4])
    check_relaunches(rows, 5)


def test_mpirun_two_fake_hosts(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA slots=2\nnodeB slots=2\n")
    port = str(free_port())
    out = run(
        [
            *MPIRUN,
            "-np",
            "4",
            "--hostfile",
            str(hostfile),
            "--mca",
            "plm_rsh_agent",
            str(FAKE_SSH),
            "-x",
            "MASTER_ADDR=127.0.0.1",
            "-x",
            f"MASTER_PORT={port}",
            "-x",
            "GLOO_SOCKET_IFNAME",
            PY,
            str(PROBE),
            str(tmp_path / "out"),
        ],
        clean_env(),
    )
    assert out.returncode == 0, out.stdout[-4000:]
    check(results(tmp_path / "out", 4, out.stdout), "openmpi", 4, [2, 2], hosts=["nodeA", "nodeB"])


def test_mpirun_without_master_addr_fails_fast(tmp_path: Path) -> None:
    start = time.monotonic()
    out = run([*MPIRUN, "-np", "2", PY, str(PROBE), str(tmp_path)], clean_env(), timeout=180)
    assert out.returncode != 0
    errors = [p.read_text() for p in tmp_path.glob("error-*.txt")]
    # mpirun ends the job when the first rank exits non-zero, so the other may not get to write
    assert errors, out.stdout[-3000:]
    assert all("MASTER_ADDR and MASTER_PORT are not set: export MASTER_ADDR" in e for e in errors), errors[0]
    assert time.monotonic() - start < 120  # refused, not a wait for a rendezvous


@pytest.fixture(scope="module")
def mpi4py_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mpi4py (binary wheel) in a folder of its own, so the project's venv stays as it is."""
    target = tmp_path_factory.mktemp("mpi4py")
    out = run(
        [
            PY,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "-c",
            str(ROOT / "requirements" / "constraints.txt"),
            "--target",
            str(target),
            "mpi4py",
        ],
        clean_env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:]
    return target


def test_mpirun_mpi4py_broadcasts_the_master(tmp_path: Path, mpi4py_dir: Path) -> None:
    # no MASTER_ADDR/MASTER_PORT: rank 0 sends its host name and a free port over MPI
    out = run(
        [*MPIRUN, "-np", "4", "-x", "GLOO_SOCKET_IFNAME", "-x", "PYTHONPATH", PY, str(PROBE), str(tmp_path)],
        clean_env(PYTHONPATH=os.pathsep.join(filter(None, [str(mpi4py_dir), os.environ.get("PYTHONPATH")]))),
    )
    assert out.returncode == 0, out.stdout[-4000:]
    check(results(tmp_path, 4, out.stdout), "openmpi", 4, [4])


def test_mpiexec_mpich_one_host(tmp_path: Path) -> None:
    port = str(free_port())
    out = run(
        [
            "mpiexec.mpich",
            "-n",
            "4",
            "-genv",
            "MASTER_ADDR",
            "127.0.0.1",
            "-genv",
            "MASTER_PORT",
            port,
            PY,
            str(PROBE),
            str(tmp_path),
            "--relaunch",
            "3",
        ],
        clean_env(),
    )  # launch_from_env
    assert out.returncode == 0, out.stdout[-4000:]
    rows = results(tmp_path, 4, out.stdout)
    check(rows, "mpich", 4, [4])
    check_relaunches(rows, 3)


def test_mpiexec_mpich_two_fake_hosts(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodeA:2\nnodeB:2\n")
    port = str(free_port())
    out = run(
        [
            "mpiexec.mpich",
            "-n",
            "4",
            "-f",
            str(hostfile),
            "-launcher",
            "ssh",
            "-launcher-exec",
            str(FAKE_SSH),
            "-iface",
            "lo",
            "-genv",
            "MASTER_ADDR",
            "127.0.0.1",
            "-genv",
            "MASTER_PORT",
            port,
            PY,
            str(PROBE),
            str(tmp_path / "out"),
        ],
        clean_env(),
    )
    assert out.returncode == 0, out.stdout[-4000:]
    check(results(tmp_path / "out", 4, out.stdout), "mpich", 4, [2, 2], hosts=["nodeA", "nodeB"])


# ------------------------------------------------------------------------------- Slurm


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(nodes=2)
    # stop the daemons on every exit: normal teardown, an exception, SIGTERM/SIGHUP (turned into
    # KeyboardInterrupt, so finalizers and atexit run); a SIGKILLed run is cleaned by the next start
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    atexit.register(cluster.stop)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(cluster.stop)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def slurm_run(
    cluster: SlurmCluster, cmd: list[str], timeout: float = RUN_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command under a unique job name, cancelling the job on timeout."""
    name = f"pctx-{uuid.uuid4().hex[:8]}"
    env = clean_env(**cluster.env)
    return run([cmd[0], f"--job-name={name}", *cmd[1:]], env, timeout, cleanup=["scancel", "--name", name])


def sbatch(
    cluster: SlurmCluster, args: list[str], tmp_path: Path, timeout: float = RUN_TIMEOUT
) -> tuple[str, str]:
    """Submit a batch job, poll until it ends; return (its final state line, its output)."""
    env = clean_env(**cluster.env)
    log = tmp_path / "job.out"
    sub = run(["sbatch", "--parsable", f"--output={log}", *args], env, timeout=60)
    assert sub.returncode == 0, sub.stdout
    job = sub.stdout.strip().split(";")[0]
    end = time.monotonic() + timeout
    while True:
        state = run(["scontrol", "show", "job", job], env, timeout=60).stdout
        if (
            "JobState=PENDING" not in state
            and "JobState=RUNNING" not in state
            and "JobState=COMPLETING" not in state
        ):
            break
        if time.monotonic() > end:
            subprocess.run(["scancel", job], env=env, timeout=30)
            pytest.fail(f"batch job {job} did not end within {timeout} s:\n{cluster.logs()}")
        time.sleep(0.2)
    fields = " ".join(w for w in state.split() if w.startswith(("JobState=", "ExitCode=")))
    return fields, log.read_text() if log.is_file() else ""


def test_srun_two_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    # -N2 -n4 without --ntasks-per-node: Slurm puts 3 tasks on n1 and 1 on n2
    # launch_from_slurm, then 5 destroy/relaunch cycles on the port derived from the job id
    out = slurm_run(
        slurm, ["srun", "-N2", "-n4", PY, str(PROBE), str(tmp_path), "--entry", "slurm", "--relaunch", "5"]
    )
    assert out.returncode == 0, out.stdout[-4000:] + slurm.logs()
    rows = results(tmp_path, 4, out.stdout)
    check(rows, "slurm", 4, [3, 1], hosts=["n1", "n2"])
    check_relaunches(rows, 5)
    assert {r["detected"]["master_addr"] for r in rows} == {"n1"}  # first host of the node list
    assert [r["detected"]["node_rank"] for r in rows] == [0, 0, 0, 1]


def test_sbatch_with_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = f"srun {shlex.quote(PY)} {PROBE} {tmp_path / 'out'}"
    state, log = sbatch(slurm, ["-N2", "--ntasks-per-node=2", "--wrap", script], tmp_path)
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + log[-3000:]
    check(results(tmp_path / "out", 4, log), "slurm", 4, [2, 2], hosts=["n1", "n2"])


def test_sbatch_without_srun_is_refused(slurm: SlurmCluster, tmp_path: Path) -> None:
    start = time.monotonic()
    script = f"{shlex.quote(PY)} {PROBE} {tmp_path / 'out'}"
    state, log = sbatch(slurm, ["-N2", "--ntasks-per-node=2", "--wrap", script], tmp_path, timeout=180)
    assert "JobState=FAILED" in state and "ExitCode=3:0" in state, state + log[-3000:]
    assert "batch shell of Slurm job" in log and "Start the script with srun" in log, log[-3000:]
    assert not list((tmp_path / "out").glob("rank-*.json"))
    assert time.monotonic() - start < 150  # refused at once, not a wait for ranks


def test_salloc_shell_without_srun_is_refused(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = slurm_run(
        slurm, ["salloc", "-N2", "--ntasks-per-node=2", PY, str(PROBE), str(tmp_path)], timeout=180
    )
    assert out.returncode == 3, out.stdout[-3000:]
    assert "or its salloc shell (SLURM_NTASKS=4, no SLURM_STEP_ID)" in out.stdout, out.stdout[-3000:]
    assert not list(tmp_path.glob("rank-*.json"))


def test_torchrun_inside_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    port = free_port()
    torchrun = (
        f"{Path(PY).parent / 'torchrun'} --nnodes 2 --nproc-per-node 2 --node-rank $SLURM_NODEID "
        f"--master-addr 127.0.0.1 --master-port {port} {PROBE} {tmp_path}"
    )
    out = slurm_run(slurm, ["srun", "-N2", "--ntasks-per-node=1", "sh", "-c", torchrun])
    assert out.returncode == 0, out.stdout[-4000:]
    check(results(tmp_path, 4, out.stdout), "torchrun", 4, [2, 2], hosts=["n1", "n2"])


def test_mpirun_inside_allocation(slurm: SlurmCluster, tmp_path: Path) -> None:
    # mpirun starts its daemons through srun; the ranks also see that step's SLURM_PROCID (0,0,1,1)
    port = str(free_port())
    out = slurm_run(
        slurm,
        [
            "salloc",
            "-N2",
            "--ntasks-per-node=2",
            *MPIRUN,
            "-np",
            "4",
            "-x",
            "MASTER_ADDR=127.0.0.1",
            "-x",
            f"MASTER_PORT={port}",
            "-x",
            "GLOO_SOCKET_IFNAME",
            PY,
            str(PROBE),
            str(tmp_path),
        ],
    )
    assert out.returncode == 0, out.stdout[-4000:]
    check(results(tmp_path, 4, out.stdout), "openmpi", 4, [2, 2], hosts=["n1", "n2"])


# ------------------------------------------------------------------------------- parallelctx check
CHECK = [
    "-m",
    "parallelctx",
    "check",
    "--json",
    "--quiet",
    "--sizes",
    "4KiB",
    "--iters",
    "2",
    "--warmup",
    "1",
]


def _check_json(output: str) -> dict[str, Any]:
    """The one JSON object rank 0 printed."""
    for line in output.splitlines():
        if line.startswith("{") and '"ok"' in line:
            return json.loads(line)
    raise AssertionError(f"no JSON report in the output:\n{output[-4000:]}")


def test_check_command_under_srun(slurm: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "tp2.json").write_text(json.dumps({"parallel": {"tensor": 2}}))
    out = slurm_run(
        slurm, ["srun", "-N2", "--ntasks-per-node=2", PY, *CHECK, "--config", str(tmp_path / "tp2.json")]
    )
    assert out.returncode == 0, out.stdout[-4000:] + slurm.logs()
    report = _check_json(out.stdout)
    assert report["ok"] is True and report["world_size"] == 4, report


def test_check_command_under_mpirun(tmp_path: Path) -> None:
    port = str(free_port())
    out = run(
        [
            *MPIRUN,
            "-np",
            "4",
            "-x",
            "MASTER_ADDR=127.0.0.1",
            "-x",
            f"MASTER_PORT={port}",
            "-x",
            "GLOO_SOCKET_IFNAME",
            "-x",
            "PATH",
            PY,
            *CHECK,
        ],
        clean_env(),
    )
    assert out.returncode == 0, out.stdout[-4000:]
    report = _check_json(out.stdout)
    assert report["ok"] is True and report["world_size"] == 4, report
