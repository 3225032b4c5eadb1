"""Isolation of parallel tests and pytest on every rank (issues 18 and 26), driven through ``pytester``.

Poison tests leave process state behind on their ranks (environment, default dtype, grad mode,
deterministic mode, a logging handler and level, warnings filters, the working folder, and
what a plain pytest run shares between tests too: a sys.modules entry, a thread, module
globals); check tests assert each rank starts with the state the plugin restores. Run in both orders, alone, and under pytest-xdist, every test passes:
the outcome a test has alone. Other tests show conftest autouse fixtures, ini ``filterwarnings =
error``, the filterwarnings marker, ``monkeypatch``, ``capsys``, ``caplog`` and ``request`` acting
on the ranks, the environment being the controller's at each test, and a one-rank skip or
failure named as the root cause.
"""

from __future__ import annotations

import re

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
import os, pytest

@pytest.fixture(autouse=True)
def per_test_env(monkeypatch, request):
    monkeypatch.setenv("FROM_AUTOUSE", request.node.name)
"""

GLOBALS = """
STATE = {}  # a module-level registry, as Megatron's parallel_state keeps its groups
"""

POISON = """
import logging, os, sys, threading, time, types, warnings
import pytest, torch
import state_globals
from parallelctx import gpc

@pytest.mark.parallel(world_size=2)
def test_poison_everything():
    os.environ["POISON_ENV"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    logging.getLogger().addHandler(logging.StreamHandler())
    logging.getLogger("poison").setLevel(logging.CRITICAL)
    sys.modules["poison_module"] = types.ModuleType("poison_module")
    warnings.simplefilter("ignore")
    threading.Thread(target=time.sleep, args=(600,), name="poison-thread", daemon=True).start()
    state_globals.STATE["tensor_group"] = gpc.get_global_rank()
    os.chdir("/")

class TestMegatronIdiom:
    def teardown_method(self):
        state_globals.STATE.clear()  # runs on the ranks, as destroy_model_parallel would

    @pytest.mark.parallel(world_size=2)
    def test_init_in_the_test(self):
        assert "initialised" not in state_globals.STATE
        state_globals.STATE["initialised"] = True
"""

CHECK = """
import logging, os, sys, threading, warnings
from pathlib import Path
import pytest, torch
import state_globals

@pytest.mark.parallel(world_size=2)
def test_state_is_fresh(request):
    assert "POISON_ENV" not in os.environ
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
    assert not any(type(h) is logging.StreamHandler for h in logging.getLogger().handlers)
    assert logging.getLogger("poison").level == logging.NOTSET
    assert ("ignore", None, Warning, None, 0) not in warnings.filters
    assert Path.cwd() == request.config.invocation_params.dir
    # shared between the tests of a rank's session, as in a plain pytest run: sys.modules,
    # threads and module globals (the Megatron idiom's teardown_method clears them)

@pytest.mark.parallel(world_size=2)
def test_megatron_idiom_again():
    assert "initialised" not in state_globals.STATE
"""

FEATURES = """
import logging, os, warnings
import pytest, torch, torch.distributed as dist
from parallelctx import gpc

def test_controller_patch_is_gone_after_its_test(monkeypatch):
    monkeypatch.setenv("CONTROLLER_ONLY", "1")   # a plain test in the controller

@pytest.mark.parallel(world_size=2)
def test_environment_is_the_controllers_at_this_test(request):
    assert "CONTROLLER_ONLY" not in os.environ
    assert os.environ["FROM_AUTOUSE"] == request.node.name == "test_environment_is_the_controllers_at_this_test"
    assert os.environ["SET_BY_RUNNER"] == "yes"

@pytest.mark.parallel(world_size=2)
def test_monkeypatch_capsys_caplog_on_ranks(monkeypatch, capsys, caplog, tmp_path):
    monkeypatch.setenv("RANK_PATCH", str(gpc.get_global_rank()))
    print("from rank", os.environ["RANK_PATCH"])
    assert capsys.readouterr().out == f"from rank {gpc.get_global_rank()}\\n"
    logging.getLogger("model").warning("shard %d", gpc.get_global_rank())
    assert caplog.records[-1].getMessage() == f"shard {gpc.get_global_rank()}"
    (tmp_path / f"rank{gpc.get_global_rank()}").touch()
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]

@pytest.mark.parallel(world_size=2)
def test_ini_filterwarnings_error_acts_on_ranks():
    warnings.warn("boom on the rank", UserWarning)

@pytest.mark.filterwarnings("ignore:boom")
@pytest.mark.parallel(world_size=2)
def test_filterwarnings_marker_acts_on_ranks():
    warnings.warn("boom on the rank", UserWarning)

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("value", [lambda: 7])
def test_unpicklable_param(value):
    assert value() == 7

@pytest.mark.parallel(world_size=2, timeout=60)
def test_one_rank_skips():
    if gpc.get_global_rank() == 1:
        pytest.skip("no kernel on rank 1")
    dist.barrier()

@pytest.mark.parallel(world_size=4, timeout=60)
def test_one_rank_fails_first():
    if gpc.get_global_rank() == 2:
        raise ValueError("the root cause")
    dist.barrier()
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(state_globals=GLOBALS, test_a_poison=POISON, test_b_check=CHECK)
    monkeypatch.setenv("SET_BY_RUNNER", "yes")
    return pytester


def _outcomes(result: pytest.RunResult) -> dict[str, str]:
    found = {}
    for line in result.stdout.lines:
        for word in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            if f" {word}" in line and "::" in line:
                found[line.split(" ")[0].split("::", 1)[1]] = word
    return found


@pytest.mark.slow
def test_poisoned_state_never_reaches_the_next_test_in_either_order(suite: pytest.Pytester) -> None:
    forward = suite.runpytest("-p", "no:cacheprovider", "-v", "test_a_poison.py", "test_b_check.py")
    forward.assert_outcomes(passed=4)
    backward = suite.runpytest("-p", "no:cacheprovider", "-v", "test_b_check.py", "test_a_poison.py")
    backward.assert_outcomes(passed=4)
    assert _outcomes(forward) == _outcomes(backward)


@pytest.mark.slow
def test_pytest_acts_on_every_rank_and_reports_the_root_cause(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_c_features=FEATURES)
    result = suite.runpytest("-p", "no:cacheprovider", "-v", "-rs", "test_c_features.py")
    assert _outcomes(result) == {
        "test_controller_patch_is_gone_after_its_test": "PASSED",
        "test_environment_is_the_controllers_at_this_test": "PASSED",
        "test_monkeypatch_capsys_caplog_on_ranks": "PASSED",
        "test_ini_filterwarnings_error_acts_on_ranks": "FAILED",
        "test_filterwarnings_marker_acts_on_ranks": "PASSED",
        "test_unpicklable_param[<lambda>]": "PASSED",
        "test_one_rank_skips": "SKIPPED",
        "test_one_rank_fails_first": "FAILED",
    }
    result.stdout.fnmatch_lines_random(
        [
            "ranks 0, 1 of 2 failed: UserWarning: boom on the rank",
            "SKIPPED [[]1[]] test_c_features.py:*: rank 1 of 2 skipped: no kernel on rank 1*",
            "rank 2 of 4 failed: ValueError: the root cause",
        ]
    )
    assert "failed: RuntimeError" not in result.stdout.str().split("rank 2 of 4 failed")[0]
    # the peers that only lost their connection to rank 2 get one line, not a traceback each
    report = result.stdout.str().split("rank 2 of 4 failed")[1]
    assert "____ rank 2 ____" in report
    assert not re.search(r"_{20} ranks? [013]\b", report), report


@pytest.mark.slow
def test_xdist_two_workers_k_and_last_failed(suite: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    suite.makepyfile(
        test_d_fails="""
import pytest
from parallelctx import gpc

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    assert n == 1
"""
    )
    result = suite.runpytest_subprocess("-n", "2", "test_a_poison.py", "test_b_check.py", "test_d_fails.py")
    result.assert_outcomes(passed=5, failed=1)
    last = suite.runpytest("--lf", "-v")
    last.assert_outcomes(failed=1)
    last.stdout.fnmatch_lines(["*test_param[[]2[]] FAILED*"])
    picked = suite.runpytest("-p", "no:cacheprovider", "-v", "-k", "param and 1", "test_d_fails.py")
    picked.assert_outcomes(passed=1, deselected=1)


CHANGES_GPC = """
import pytest, torch, torch.distributed as dist
from parallelctx import gpc, ParallelMode, launch

@pytest.mark.parallel(world_size=2, tensor=2)
def test_a_changes_the_config():
    gpc.config.seed = 7  # passes: a test may tweak its own config

@pytest.mark.parallel(world_size=2, tensor=2)
def test_b_sees_the_markers_seed():
    assert gpc.config.seed == 1024
    drawn = torch.rand(2)
    gpc.set_seed(1024)  # the seeds of a fresh launch for this marker
    assert torch.equal(torch.rand(2), drawn)

@pytest.mark.parallel(world_size=2, tensor=2)
def test_c_relaunches_another_layout(tmp_path):
    rank = gpc.get_global_rank()
    gpc.destroy()
    port = _free_port_from(tmp_path, rank)
    launch(dict(parallel=dict(tensor=1)), rank=rank, world_size=2, host="127.0.0.1", port=port)

@pytest.mark.parallel(world_size=2, tensor=2)
def test_d_gets_the_markers_layout():
    assert gpc.get_world_size(ParallelMode.TENSOR) == 2

@pytest.mark.parallel(world_size=2, tensor=2)
def test_e_destroys_on_one_rank():
    if gpc.get_global_rank() == 0:
        gpc.destroy()

@pytest.mark.parallel(world_size=2, tensor=2, timeout=60)
def test_f_has_a_working_gpc_on_every_rank():
    t = torch.ones(1)
    dist.all_reduce(t, group=gpc.get_group(ParallelMode.TENSOR))
    assert t.item() == 2
    LAYOUTS.append(gpc.layout)

@pytest.mark.parallel(world_size=2, tensor=2, timeout=60)
def test_g_keeps_an_unchanged_gpc():
    assert gpc.layout is LAYOUTS[-1]  # the same launch, only seeded anew

LAYOUTS = []
INSTALLED = {}

@pytest.mark.parallel(world_size=2, tensor=2, timeout=60)
def test_h_installs_something_until_gpc_is_destroyed():
    # as parallelctx.megatron.install() does: a second install() before gpc.destroy() is refused
    assert not INSTALLED, "the previous test's install was never torn down"
    INSTALLED["megatron"] = True
    gpc.add_destroy_hook(INSTALLED.clear)

@pytest.mark.parallel(world_size=2, tensor=2, timeout=60)
def test_i_installs_it_again():
    test_h_installs_something_until_gpc_is_destroyed()

def _free_port_from(folder, rank):
    import socket, time
    path = folder / "port"
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        path.with_suffix(".tmp").write_text(str(port))
        path.with_suffix(".tmp").rename(path)
        return port
    deadline = time.monotonic() + 30
    while not path.exists():
        assert time.monotonic() < deadline, "rank 0 wrote no port"
        time.sleep(0.05)
    return int(path.read_text())
"""


def test_a_test_that_changes_gpc_never_hands_it_changed_to_the_next(pytester: pytest.Pytester) -> None:
    """gpc is kept between passing tests with the same config: not when the test changed its
    config, launched another layout itself, destroyed it (on one rank or all), or added a destroy
    hook (what it installed on gpc is torn down before the next test)."""
    pytester.makepyfile(test_changes_gpc=CHANGES_GPC)
    result = pytester.runpytest("-p", "no:cacheprovider", "-v", "test_changes_gpc.py")
    result.assert_outcomes(passed=9)
