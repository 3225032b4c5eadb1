"""The shim that runs Megatron-core's own test_parallel_state.py (tests/megatron_upstream.py),
checked without running it: what it records must not turn a failing test into a passing one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_a_test_that_fails_at_teardown_is_not_recorded_as_passed(tmp_path: Path) -> None:
    # A group the bridge leaves alive, or a destroy that raises, may show only at teardown: the
    # shim's outcome must then differ from Megatron's init, not read "passed".
    from types import SimpleNamespace

    from megatron_upstream import _Outcomes

    out = tmp_path / "outcomes.json"
    plugin = _Outcomes(out)
    for when, outcome in (("setup", "passed"), ("call", "passed"), ("teardown", "failed")):
        plugin.pytest_runtest_logreport(SimpleNamespace(when=when, outcome=outcome, nodeid="f.py::test_x"))
    for when, outcome in (("setup", "passed"), ("call", "passed"), ("teardown", "passed")):
        plugin.pytest_runtest_logreport(SimpleNamespace(when=when, outcome=outcome, nodeid="f.py::test_y"))
    assert json.loads(out.read_text()) == {"test_x": "teardown failed", "test_y": "passed"}


TINY = """
import megatron.core.parallel_state as ps
import pytest

from tests.unit_tests.test_utilities import Utils


def test_init_and_destroy():
    Utils.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    assert ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 1
    Utils.destroy_model_parallel()


def test_refused():
    with pytest.raises((RuntimeError, ValueError, AssertionError)):
        Utils.initialize_model_parallel(tensor_model_parallel_size=3)
    Utils.destroy_model_parallel()
"""


@pytest.mark.slow  # 18 s: two pytest runs of one rank; `make test-slow` (CI) runs it
def test_the_shim_runs_a_file_under_both_inits_on_one_rank(tmp_path: Path) -> None:
    # The shim reaches into gpc and the bridge (their groups, to prove none is left alive): a
    # refactor that moves what it reads must fail here, in CI's `make test-slow`, not only in the
    # upstream run (which CI does not run).
    import os
    import subprocess
    import sys

    from parallelctx.launch import free_port

    (tmp_path / "test_tiny.py").write_text(TINY)
    shim = Path(__file__).with_name("megatron_upstream.py")
    for mode in ("megatron", "bridge"):
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        out = tmp_path / f"{mode}.json"
        done = subprocess.run(
            [sys.executable, str(shim), str(tmp_path / "test_tiny.py"), mode, str(out)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        found = json.loads(out.read_text()) if out.exists() else None
        assert found == {"test_init_and_destroy": "passed", "test_refused": "passed"}, (
            mode,
            done.stdout[-3000:],
        )
