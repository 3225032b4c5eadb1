"""Megatron-core's own ``tests/unit_tests/test_parallel_state.py``, unchanged, on gpc + the bridge.

For the installed release (0.16 -> tag core_v0.16.1, 0.19 -> core_v0.19.0) the file is taken
from ``$MEGATRON_LM_TESTS_0_16`` / ``$MEGATRON_LM_TESTS_0_19`` (per release) or
``$MEGATRON_LM_TESTS`` (a path to that file, e.g. in a Megatron-LM checkout at the tag) or
downloaded from GitHub into ``.cache/megatron-lm/<tag>/``. It then runs twice on 8 CPU ranks
(gloo), each rank a process running pytest on it, with the file's ``Utils`` pointed at Megatron's
own ``initialize_model_parallel`` (the control) and at gpc + ``parallelctx.megatron.install()``
(tests/megatron_upstream.py). Every test must end the same way on every rank under both: what
passes under Megatron's own init passes on the bridge, and what it refuses the bridge refuses. Each rank records its outcomes after every test; a run past
``PARALLELCTX_MEGATRON_UPSTREAM_TIMEOUT`` seconds a rank (default 1500) fails saying how many tests
each rank finished.

About a minute and a half a release on 2 cores, and it needs the file, so it runs only from
``make test-megatron-upstream`` (``PARALLELCTX_MEGATRON_UPSTREAM=1``); without the file and
without network it is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from parallelctx.launch import free_port
from parallelctx.megatron import release as _release

ROOT = Path(__file__).resolve().parent.parent
TAGS = {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0"}
URL = "https://raw.githubusercontent.com/NVIDIA/Megatron-LM/{tag}/tests/unit_tests/test_parallel_state.py"
WORLD = 8
# Each rank may take this long (seconds) for the whole file; a loaded machine needs much more
# than a quiet one, and a test that fails on some ranks only makes the others wait out their
# collective timeouts.
RANK_TIMEOUT = int(os.environ.get("PARALLELCTX_MEGATRON_UPSTREAM_TIMEOUT", "1500"))

pytestmark = pytest.mark.skipif(
    os.environ.get("PARALLELCTX_MEGATRON_UPSTREAM") != "1",
    reason="Megatron's own test file runs only from `make test-megatron-upstream`",
)


def _upstream_file(tmp: Path) -> Path:
    version = _release.detect().version.rsplit(".", 1)[0]
    tag = TAGS.get(version)
    if tag is None:
        pytest.skip(f"no upstream tag known for megatron-core {version}")
    # per release (make test-megatron-upstream runs both venvs), else one file for whichever runs
    given = os.environ.get(f"MEGATRON_LM_TESTS_{version.replace('.', '_')}") or os.environ.get(
        "MEGATRON_LM_TESTS"
    )
    cached = ROOT / ".cache" / "megatron-lm" / tag / "test_parallel_state.py"
    if given:
        source = Path(given)
    elif cached.exists():
        source = cached
    else:
        try:
            with urllib.request.urlopen(URL.format(tag=tag), timeout=30) as response:
                text = response.read().decode()
        except OSError as exc:
            pytest.skip(
                f"cannot fetch Megatron-LM {tag}'s test_parallel_state.py ({exc}); set MEGATRON_LM_TESTS"
            )
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(text)
        source = cached
    target = tmp / "test_parallel_state.py"
    shutil.copyfile(source, target)
    return target


def _run(test_file: Path, mode: str, tmp: Path) -> list[dict[str, str]]:
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD))
    env.update(OMP_NUM_THREADS="1", TORCH_GLOO_LAZY_INIT="1", PYTHONWARNINGS="ignore")
    procs = []
    for rank in range(WORLD):
        out = tmp / f"{mode}{rank}.json"
        cmd = [sys.executable, str(ROOT / "tests" / "megatron_upstream.py"), str(test_file), mode, str(out)]
        procs.append(
            subprocess.Popen(
                cmd,
                env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                cwd=tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    for rank, proc in enumerate(procs):
        try:
            logs.append(proc.communicate(timeout=RANK_TIMEOUT)[0])
            (tmp / f"{mode}{rank}.log").write_text(logs[-1])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            done = {
                rank: len(json.loads(path.read_text())) if path.exists() else 0
                for rank, path in ((r, tmp / f"{mode}{r}.json") for r in range(WORLD))
            }
            pytest.fail(f"{mode} run past {RANK_TIMEOUT} s; tests finished per rank: {done}")
    found = []
    for rank in range(WORLD):
        path = tmp / f"{mode}{rank}.json"
        assert path.exists(), f"{mode} rank {rank} wrote no results:\n{logs[rank][-3000:]}"
        found.append(json.loads(path.read_text()))
    return found


@pytest.mark.timeout(2 * RANK_TIMEOUT + 600)
def test_their_test_parallel_state_passes_on_the_bridge_where_it_passes_on_megatron(tmp_path: Path) -> None:
    test_file = _upstream_file(tmp_path)
    theirs = _run(test_file, "megatron", tmp_path)
    ours = _run(test_file, "bridge", tmp_path)
    ids = sorted(set().union(*theirs, *ours))
    passing = [t for t in ids if all(r.get(t) == "passed" for r in theirs)]
    lost = {
        t: sorted({r.get(t, "missing") for r in ours})
        for t in passing
        if any(r.get(t) != "passed" for r in ours)
    }
    summary = {
        t: (sorted({r.get(t, "-") for r in theirs}), sorted({r.get(t, "-") for r in ours})) for t in ids
    }
    print(json.dumps(summary, indent=1))
    assert len(passing) > 10, summary
    assert not lost, f"pass under Megatron's own init, not on the bridge: {lost}"
    # nor the other way: a test their init fails (an option it refuses, a combination it
    # rejects) must not pass on the bridge, which would mean the bridge accepts what Megatron refuses
    differ = {t: outcomes for t, outcomes in summary.items() if outcomes[0] != outcomes[1]}
    assert not differ, f"outcomes (Megatron's init, the bridge) differ: {differ}"
