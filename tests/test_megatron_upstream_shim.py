"""The shim that runs Megatron-core's own test_parallel_state.py (tests/megatron_upstream.py),
checked without running it: what it records must not turn a failing test into a passing one."""

from __future__ import annotations

import json
from pathlib import Path


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
