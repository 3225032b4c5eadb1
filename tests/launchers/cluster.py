"""Real launchers for the tests: install the packages, run a Slurm cluster with fake nodes.

* :func:`ensure_packages` installs missing Debian packages with apt-get (idempotent; a few
  seconds when everything is there already).
* :class:`SlurmCluster` starts munged (unless munge already works), slurmctld and one slurmd per
  fake node, each slurmd in its own UTS namespace so that its tasks see the node's host name;
  everything talks over 127.0.0.1. It uses its own config file (``SLURM_CONF``), never
  /etc/slurm/slurm.conf, records every daemon's PID and stops exactly those PIDs in
  :meth:`SlurmCluster.stop` (also the ones a killed earlier run left behind).

Run by hand:  python tests/launchers/cluster.py up|down   (state in /tmp/parallelctx-slurm)
No torch here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PACKAGES = ("openmpi-bin", "mpich", "slurmctld", "slurmd", "slurm-client", "munge")
HOSTS_MARK = "# parallelctx launcher tests"
APT_STAMP = Path("/tmp/.parallelctx-apt-updated")


class ClusterError(RuntimeError):
    """A launcher package could not be installed or a daemon did not come up; the message has
    the command, its output or the daemon's log."""


def _run(cmd: Sequence[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]


def missing_packages(packages: Sequence[str] = PACKAGES) -> list[str]:
    """Return the packages of ``packages`` that dpkg does not list as installed."""
    missing = []
    for name in packages:
        out = _run(["dpkg-query", "-W", "-f=${Status}", name], timeout=30)
        if "install ok installed" not in out.stdout:
            missing.append(name)
    return missing


def ensure_packages(packages: Sequence[str] = PACKAGES, timeout: float = 600) -> list[str]:
    """Install whichever of ``packages`` is missing (apt-get, no recommends).

    Returns:
        The packages that were installed (empty when all were there).

    Raises:
        ClusterError: not root, or apt-get failed or ran past ``timeout`` seconds.
    """
    missing = missing_packages(packages)
    if not missing:
        return []
    if os.geteuid() != 0:
        raise ClusterError(f"packages {missing} are missing and installing them needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if not APT_STAMP.exists():
        out = _run(["apt-get", "update", "-q"], timeout=timeout, env=env)
        if out.returncode != 0:
            raise ClusterError(f"apt-get update failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
        APT_STAMP.touch()
    out = _run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], timeout=timeout, env=env
    )
    if out.returncode != 0:
        raise ClusterError(
            f"apt-get install {' '.join(missing)} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    return missing


def _alive(pid: int, comm: str) -> bool:
    """True when ``pid`` exists, is not a zombie and still runs ``comm``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return name == comm and state != "Z"


def stop_pid(pid: int, comm: str, grace: float = 10.0) -> None:
    """Stop process ``pid`` if it still runs ``comm``: SIGTERM, then SIGKILL after ``grace`` s."""
    if not _alive(pid, comm):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace
    while time.monotonic() < end:
        if not _alive(pid, comm):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_file(path: Path, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.1)
    raise ClusterError(f"{path} did not appear within {timeout} s")


class SlurmCluster:
    """A Slurm cluster on this machine: ``nodes`` fake nodes (n1, n2, ...), all on 127.0.0.1.

    ``env`` is what clients (srun, sbatch, squeue) need: SLURM_CONF pointing at this cluster's
    own config. Use as a context manager or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        workdir: Path = Path("/tmp/parallelctx-slurm"),
        nodes: int = 2,
        cpus_per_node: int = 4,
        ctld_port: int = 16817,
        node_port: int = 16900,
    ) -> None:
        self.workdir = workdir
        self.names = [f"n{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.ctld_port = ctld_port
        self.node_port = node_port
        self.conf = workdir / "slurm.conf"
        self.pids_file = workdir / "pids"
        self.env = {"SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ config
    def _write_conf(self) -> None:
        host = socket.gethostname()
        w = self.workdir
        lines = [
            "# written by tests/launchers/cluster.py: one machine, no cgroups, no accounting",
            "ClusterName=pctx",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MailProg=/bin/true",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmctldPidFile={w}/slurmctld.pid",
            f"SlurmctldLogFile={w}/slurmctld.log",
            f"StateSaveLocation={w}/state",
            f"SlurmdPidFile={w}/slurmd-%n.pid",
            f"SlurmdLogFile={w}/slurmd-%n.log",
            f"SlurmdSpoolDir={w}/spool-%n",
            f"TmpFS={w}/tmp-%n",
        ]
        for i, name in enumerate(self.names):
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={self.node_port + i} "
                f"CPUs={self.cpus_per_node} RealMemory=1000 State=UNKNOWN"
            )
        lines.append(
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def _record(self, name: str, pid: int) -> None:
        with self.pids_file.open("a") as f:
            f.write(f"{name} {pid}\n")

    # ------------------------------------------------------------------ start / stop
    def _start_munge(self) -> None:
        def works() -> bool:
            try:
                cred = _run(["munge", "-n"], timeout=10)
                return (
                    cred.returncode == 0 and _run(["unmunge"], timeout=10, input=cred.stdout).returncode == 0
                )
            except subprocess.TimeoutExpired:
                return False

        if works():
            return  # someone else's munged: leave it alone
        key = Path("/etc/munge/munge.key")
        if not key.is_file() or key.stat().st_size == 0:
            _run(["mungekey", "--create", "--keyfile", str(key)], timeout=30)
            shutil.chown(key, "munge", "munge")
            key.chmod(0o400)
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        pidfile = Path("/run/munge/munged.pid")
        pidfile.unlink(missing_ok=True)
        out = _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], timeout=30)
        if out.returncode != 0:
            raise ClusterError(f"munged did not start: {out.stderr}")
        self._record("munged", int(_wait_file(pidfile, 10)))
        end = time.monotonic() + 10
        while not works():
            if time.monotonic() > end:
                raise ClusterError("munged started but munge -n | unmunge still fails")
            time.sleep(0.1)

    def _set_hosts(self, add: bool) -> None:
        hosts = Path("/etc/hosts")
        lines = [line for line in hosts.read_text().splitlines() if not line.endswith(HOSTS_MARK)]
        if add:
            lines.append(f"127.0.0.1 {' '.join(self.names)} {HOSTS_MARK}")
        hosts.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Start munged (if needed), slurmctld and the slurmds; wait until every node is idle.

        Returns:
            self.

        Raises:
            ClusterError: a daemon did not come up within ``timeout`` s (the message has the logs).
        """
        self.stop()  # daemons a killed earlier run left behind
        shutil.rmtree(self.workdir, ignore_errors=True)
        (self.workdir / "state").mkdir(parents=True)
        for name in self.names:
            (self.workdir / f"spool-{name}").mkdir()
            (self.workdir / f"tmp-{name}").mkdir()
        self.pids_file.touch()
        self._write_conf()
        self._set_hosts(add=True)
        env = {**os.environ, **self.env}
        try:
            self._start_munge()
            out = _run(["slurmctld"], timeout=30, env=env)
            if out.returncode != 0:
                raise ClusterError(f"slurmctld did not start: {out.stderr}")
            self._record("slurmctld", int(_wait_file(self.workdir / "slurmctld.pid", 20)))
            for name in self.names:
                out = _run(
                    ["unshare", "--uts", "/bin/sh", "-c", f"hostname {name} && exec slurmd -N {name}"],
                    timeout=30,
                    env=env,
                )
                if out.returncode != 0:
                    raise ClusterError(f"slurmd -N {name} did not start: {out.stderr}")
                self._record("slurmd", int(_wait_file(self.workdir / f"slurmd-{name}.pid", 20)))
            end = time.monotonic() + timeout
            while True:
                out = _run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], timeout=30, env=env)
                if sorted(set(out.stdout.split())) == sorted(self.names):
                    return self
                if time.monotonic() > end:
                    raise ClusterError(f"nodes not idle within {timeout} s:\n{self.logs()}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def logs(self, tail: int = 30) -> str:
        """Return the last ``tail`` lines of every daemon log."""
        parts = []
        for log in sorted(self.workdir.glob("*.log")):
            parts.append(
                f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-tail:])
            )
        return "\n".join(parts)

    def cancel_jobs(self, timeout: float = 30) -> None:
        """Cancel every job of this cluster and wait (up to ``timeout`` s) until none is left,
        so that no task outlives the daemons."""
        env = {**os.environ, **self.env}
        try:
            _run(["scancel", "--full", "--user", "root"], timeout=30, env=env)
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                if not _run(["squeue", "-h", "-o", "%i"], timeout=30, env=env).stdout.strip():
                    return
                time.sleep(0.2)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def stop(self) -> None:
        """Cancel this cluster's jobs, stop every daemon it recorded (slurmds, slurmctld, then
        munged) by PID, remove its /etc/hosts line. Safe to call twice or before :meth:`start`."""
        if self.pids_file.is_file() and self.conf.is_file():
            self.cancel_jobs()
        if self.pids_file.is_file():
            for line in reversed(self.pids_file.read_text().splitlines()):
                name, _, pid = line.partition(" ")
                if pid.isdigit():
                    stop_pid(int(pid), name)
            self.pids_file.unlink()
        if Path("/etc/hosts").is_file() and os.access("/etc/hosts", os.W_OK):
            self._set_hosts(add=False)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    cluster = SlurmCluster()
    if sys.argv[1:] == ["up"]:
        print("installed:", ensure_packages() or "nothing")
        cluster.start()
        print(f"up: nodes {cluster.names}; export SLURM_CONF={cluster.conf}; stop with: {sys.argv[0]} down")
    elif sys.argv[1:] == ["down"]:
        cluster.stop()
        print("stopped")
    else:
        sys.exit(f"usage: {sys.argv[0]} up|down")
