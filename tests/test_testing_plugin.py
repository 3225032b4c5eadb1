"""The pytest plugin of parallelctx.testing, driven through pytest's own ``pytester``: each test
writes a small test file, runs pytest on it in this process, and checks the outcome and report.

Pools are 2 or 4 ranks (gloo on CPU); every inner run starts its own pools and stops them.
"""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HEADER = """
import json, os, time
from pathlib import Path
import pytest, torch, torch.distributed as dist
from parallelctx import ParallelMode, gpc
"""


@pytest.fixture(autouse=True)
def _no_gpc_left_behind() -> Iterator[None]:
    """pytester runs the inner session in this process, and a conftest there may launch gpc (a
    world of one): destroy it, so that a test file run after this one starts unlaunched."""
    yield
    from parallelctx import ParallelMode, gpc

    if gpc.is_initialized(ParallelMode.GLOBAL):
        gpc.destroy()


def _durations(xml: Path) -> dict[str, float]:
    return {case.get("name"): float(case.get("time")) for case in ET.parse(xml).iter("testcase")}


@pytest.mark.slow
def test_pass_parametrize_fixtures_layouts_skip_xfail(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("""
import parallelctx

def pytest_configure(config):
    parallelctx.launch()  # the pytest process has gpc launched (a world of one): nothing may break
""")
    pytester.makepyfile(
        HEADER
        + """
@pytest.mark.parallel(world_size=4, tensor=2)
@pytest.mark.parametrize("hidden", [16, 64])
def test_params_and_tmp_path(hidden, tmp_path):
    assert gpc.get_world_size(ParallelMode.GLOBAL) == 4
    (tmp_path / f"rank{gpc.get_global_rank()}").touch()
    record = json.dumps([hidden, str(tmp_path), os.getpid(), os.getppid()])
    Path(f"param-{hidden}-{gpc.get_global_rank()}").write_text(record)

@pytest.mark.parallel(world_size=4, layouts=[dict(tensor=2), dict(tensor=2, pipeline=2), dict(pipeline=4),
                                             dict(world_size=2, tensor=2)])
def test_layouts():
    Path(f"layout-{gpc.get_world_size('global')}-{gpc.get_world_size('tensor')}-"
         f"{gpc.get_world_size('pipeline')}-{gpc.get_global_rank()}").touch()

@pytest.mark.parallel(4, config={"parallel": {"tensor": 4}, "model": {"hidden": 32}, "seed": 7})
def test_config_dict_and_positional_world_size():
    assert gpc.get_world_size("tensor") == 4 and gpc.config.model.hidden == 32
    assert gpc.config.seed == 7

class TestInAClass:
    @pytest.mark.parallel(world_size=2)
    def test_method(self):
        assert gpc.get_world_size("data") == 2

@pytest.mark.parallel(world_size=2)
def test_skip():
    if gpc.get_global_rank() >= 0:
        pytest.skip("no kernel for this layout")

@pytest.mark.xfail(reason="known bug", raises=AssertionError, strict=True)
@pytest.mark.parallel(world_size=2)
def test_xfail_marker():
    assert gpc.get_global_rank() == 99

@pytest.mark.xfail(raises=ZeroDivisionError, strict=True)
@pytest.mark.parallel(world_size=2)
def test_xfail_wrong_exception_fails():
    assert False

@pytest.mark.parallel(world_size=2)
def test_imperative_xfail():
    pytest.xfail("not yet")

def test_controller_gpc_untouched():
    assert gpc.get_world_size("global") == 1
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-v", "-rs")
    result.assert_outcomes(passed=9, skipped=1, xfailed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_params_and_tmp_path[[]16[]] PASSED*",
            "*test_layouts[[]tp2[]] PASSED*",
            "*test_layouts[[]tp2-pp2[]] PASSED*",
            "*test_layouts[[]pp4[]] PASSED*",
            "*test_layouts[[]w2-tp2[]] PASSED*",
            "*TestInAClass::test_method PASSED*",
            "*test_xfail_wrong_exception_fails FAILED*",
            "SKIPPED [[]1[]] test_pass_parametrize_*.py:*: no kernel for this layout",
        ]
    )
    # parametrize values and the same tmp_path reached every rank; one pool served both tests
    seen = [json.loads(p.read_text()) for p in sorted(pytester.path.glob("param-*"))]
    assert sorted(h for h, _, _, _ in seen) == [16] * 4 + [64] * 4
    for hidden in (16, 64):
        paths = {path for h, path, _, _ in seen if h == hidden}
        assert len(paths) == 1, "every rank got the same tmp_path"
        assert sorted(p.name for p in Path(paths.pop()).iterdir()) == ["rank0", "rank1", "rank2", "rank3"]
    assert len({ppid for _, _, _, ppid in seen}) == 4, "the second test ran on the same 4 rank processes"
    assert len({pid for _, _, pid, _ in seen}) == 4, "in the same session process (it passed on every rank)"
    layouts = {p.name.rsplit("-", 1)[0] for p in pytester.path.glob("layout-*")}
    assert layouts == {"layout-4-2-1", "layout-4-2-2", "layout-4-1-4", "layout-2-2-1"}


def test_failure_on_one_rank_names_it_with_introspection_and_output(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        HEADER
        + """
@pytest.mark.parallel(world_size=4, tensor=2)
def test_one_rank_fails():
    print("hello from", gpc.get_global_rank())
    got = {"rank": gpc.get_global_rank(), "size": 2}
    if gpc.get_global_rank() == 2:
        assert got == {"rank": 2, "size": 3}

@pytest.mark.parallel(world_size=4)
def test_two_ranks_same_traceback():
    if gpc.get_global_rank() in (1, 3):
        raise ValueError("bad shard")

@pytest.mark.parallel(world_size=4)
def test_next_test_passes_on_the_same_pool():
    Path(f"pid-{gpc.get_global_rank()}").write_text(str(os.getpid()))
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_one_rank_fails _*",
            "rank 2 of 4 failed: AssertionError: assert *",
            "(ranks 0, 1, 3 passed)",
            "*_ rank 2 _*",
            "*def test_one_rank_fails():",
            '>*assert got == {"rank": 2, "size": 3}',
            "E*AssertionError: assert {'rank': 2, 'size': 2} == {'rank': 2, 'size': 3}",
            "E*Differing items:",
            "E*{'size': 2} != {'size': 3}",
            "*Captured stdout call*",
            "[[]rank 0[]] hello from 0",
            "[[]rank 3[]] hello from 3",
            "*_ test_two_ranks_same_traceback _*",
            "ranks 1, 3 of 4 failed: ValueError: bad shard",
            "(ranks 0, 2 passed)",
            "*_ ranks 1, 3 _*",
            "E*ValueError: bad shard",
        ]
    )
    # count in the failures section only: under CI (the CI variable set) pytest's short summary
    # repeats each failure's whole message
    lines = result.stdout.lines
    end = next((i for i, line in enumerate(lines) if "short test summary info" in line), len(lines))
    shown = [line for line in lines[:end] if line.startswith("E") and "ValueError: bad shard" in line]
    assert len(shown) == 1, "one traceback for two ranks"


def test_hang_fails_within_timeout_with_every_stack_and_a_fresh_pool(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        HEADER
        + """
@pytest.mark.parallel(world_size=2)
def test_warm():
    Path(f"before-{gpc.get_global_rank()}").write_text(str(os.getppid()))

@pytest.mark.parallel(world_size=2, timeout=3)
def test_hangs():
    if gpc.get_global_rank() == 0:
        time.sleep(600)        # rank 0 never reaches the barrier
    dist.barrier()

@pytest.mark.parallel(world_size=2)
def test_after():
    Path(f"after-{gpc.get_global_rank()}").write_text(str(os.getppid()))
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider", f"--junitxml={pytester.path / 'out.xml'}")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "timed out after 3 s: ranks 0, 1 of 2 did not finish; each one's Python stack is below",
            "*_ stack of rank 0 _*",
            '*File "*test_hang_fails_within_timeout*.py", line 13 in test_hangs',
            "*_ stack of rank 1 _*",
            '*File "*distributed_c10d.py", line * in barrier',
            '*File "*test_hang_fails_within_timeout*.py", line 14 in test_hangs',
        ]
    )
    assert _durations(pytester.path / "out.xml")["test_hangs"] < 3 + 10
    before = {p.read_text() for p in pytester.path.glob("before-*")}
    after = {p.read_text() for p in pytester.path.glob("after-*")}
    assert len(before) == 2 and before == after, "the hung test's children were killed, the pool kept"
    assert "pytest_pyfunc_call" not in result.stdout.str(), "the stacks end at the test function"


def test_a_killed_worker_is_replaced(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        HEADER
        + """
import signal

@pytest.mark.parallel(world_size=2)
def test_first():
    Path(f"first-{gpc.get_global_rank()}").write_text(str(os.getppid()))

def test_kill_rank_1_between_tests():
    os.kill(int(Path("first-1").read_text()), signal.SIGKILL)
    time.sleep(0.5)

@pytest.mark.parallel(world_size=2)
def test_still_passes():
    Path(f"second-{gpc.get_global_rank()}").write_text(str(os.getppid()))

@pytest.mark.parallel(world_size=2)
def test_rank_dies_mid_test():
    if gpc.get_global_rank() == 1:
        os._exit(7)
    dist.barrier()

@pytest.mark.parallel(world_size=2)
def test_passes_after_a_death():
    pass
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, failed=1)
    # the death is the headline; rank 0 either fails in the barrier (gloo sees the peer gone) or
    # is still waiting there (stack shown)
    result.stdout.fnmatch_lines(["rank 1 of 2 died during the test (rank 1 exited with code 7)"])
    out = result.stdout.str()
    assert "then rank 0 of 2 failed: " in out or "stack of rank 0" in out
    first = {p.read_text() for p in pytester.path.glob("first-*")}
    second = {p.read_text() for p in pytester.path.glob("second-*")}
    assert len(second) == 2 and not first & second


def test_bad_markers_fail_with_the_fix(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        HEADER
        + """
@pytest.mark.parallel(world_size=4, tensr=2)
def test_unknown_key():
    pass

@pytest.mark.parallel(world_size=4, tensor=3)
def test_layout_does_not_fit():
    pass

@pytest.mark.parallel(tensor=2)
def test_no_world_size():
    pass

"""
    )
    begin = time.monotonic()
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=3)
    assert "During handling" not in result.stdout.str()
    assert time.monotonic() - begin < 20, "no pool is started for a bad marker"
    result.stdout.fnmatch_lines_random(
        [
            "*got unknown argument [[]'tensr'[]]; did you mean 'tensor'? valid: world_size, tensor, *",
            "*world_size=4*tensor=3*",
            "*needs world_size=<ranks>, a positive int; got None*",
        ]
    )


def test_a_misspelt_parallel_marker_is_a_collection_error(pytester: pytest.Pytester) -> None:
    # @pytest.mark.paralel ran the test in one unlaunched process, with only pytest's warning
    for name in ("paralel", "Parallel"):
        pytester.makepyfile(
            **{
                f"test_{name.lower()}": HEADER
                + f"""
@pytest.mark.{name}(world_size=2, tensor=2)
def test_typo():
    pass

@pytest.mark.slow
def test_other_marks_are_untouched():
    pass
"""
            }
        )
        result = pytester.runpytest(
            f"test_{name.lower()}.py",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore::pytest.PytestUnknownMarkWarning",
        )
        text = result.stdout.str()
        assert f"@pytest.mark.{name} is not parallelctx's marker; did you mean @pytest.mark.parallel?" in text
        result.assert_outcomes(errors=1)


# --------------------------------------------------------------------------- issue 38: parameters in hash order
# The controller and the ranks each collect the test file; a set's order follows each process's
# hash seed. The conftest records the controller's values by test id, and, for a controller
# started with a fixed seed, leaves PYTHONHASHSEED out of the environment the pool sees (as for
# a user who never set it): the ranks then run with seed 0 and collect the set in another order.
HASH_CONFTEST = """
import json, os
from pathlib import Path

def pytest_configure(config):
    if not config.pluginmanager.has_plugin("parallelctx-rank") and os.environ.get("DROP_HASHSEED"):
        os.environ.pop("PYTHONHASHSEED", None)

def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.has_plugin("parallelctx-rank"):
        return
    seen = {
        item.nodeid: item.callspec.params
        for item in items
        if hasattr(item, "callspec") and "x" not in item.callspec.params
    }
    Path("controller.json").write_text(json.dumps(seen))
"""

NAMES = '{"alpha", "beta", "gamma", "delta", "eps", "zeta"}'


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["3", "random"])
def test_parametrize_over_a_set_takes_the_controllers_values(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, seed: str
) -> None:
    """``parametrize`` over a set on a pooled test: every case passes whatever the controller's
    hash seed, and each rank runs with the value of the controller's test id (direct, indirect
    and fixture parameters alike), checked against the controller's record and across ranks."""
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    monkeypatch.setenv("DROP_HASHSEED", "1" if seed != "random" else "")
    pytester.makeconftest(HASH_CONFTEST)
    pytester.makepyfile(
        test_hash_order=HEADER
        + f"""
CASES = [dict(name=n) for n in {NAMES}]

def controller_value(request, name):
    return json.loads(Path("controller.json").read_text())[request.node.nodeid][name]

def record(request, name, value):
    assert os.environ["PYTHONHASHSEED"] == "0"  # every rank alike, also for a controller's "random"
    own = CASES[request.node.callspec.indices[name]]  # what this rank collected itself
    gathered = [None] * gpc.get_world_size("global")
    dist.all_gather_object(gathered, value)
    assert gathered == [value] * len(gathered), gathered
    Path(f"seen-{{gpc.get_global_rank()}}-{{request.node.name}}.json").write_text(json.dumps([value, own]))

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("cfg", CASES)
def test_direct(cfg, request):
    assert cfg == controller_value(request, "cfg") == request.node.callspec.params["cfg"]
    record(request, "cfg", cfg)

@pytest.fixture
def doubled(request):
    return dict(request.param, twice=request.param["name"] * 2)

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("doubled", CASES, indirect=True)
def test_indirect(doubled, request):
    expected = controller_value(request, "doubled")
    assert doubled == dict(expected, twice=expected["name"] * 2)
    record(request, "doubled", {{k: v for k, v in doubled.items() if k != "twice"}})

@pytest.fixture(params=CASES)
def case(request):
    return request.param

@pytest.mark.parallel(world_size=2)
def test_fixture_params(case, request):
    assert case == controller_value(request, "case")
    record(request, "case", case)

class Marker:
    pass

SENTINEL = Marker()

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("x", [SENTINEL])
def test_a_value_sent_alike_keeps_its_identity(x):
    assert x is SENTINEL  # pickled to the same bytes as the rank's own: not replaced by a copy
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", timeout=300)
    result.assert_outcomes(passed=19)
    controller = json.loads((pytester.path / "controller.json").read_text())
    seen = sorted(pytester.path.glob("seen-*.json"))
    assert len(seen) == 36, [p.name for p in seen]  # 18 cases x 2 ranks
    differ = 0
    for path in seen:
        value, own = json.loads(path.read_text())
        nodeid = next(n for n in controller if n.endswith("::" + path.stem.split("-", 2)[2]))
        assert [value] == list(controller[nodeid].values()), (path.name, value, controller[nodeid])
        differ += value != own
    if seed != "random":  # seed 3 orders the set otherwise than the ranks' seed 0
        assert differ > 0, "the ranks collected the controller's order: the check proved nothing"


@pytest.mark.slow
def test_a_parameter_that_cannot_be_sent_and_differs_is_refused_by_name(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value that does not pickle (it holds a lambda) cannot be sent to the ranks: where the
    ranks' own differs from the controller's, the case fails naming the parameter, both
    values, the reason and the way round; where it is the same (or it pickles), it runs."""
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    monkeypatch.setenv("DROP_HASHSEED", "1")
    pytester.makeconftest(HASH_CONFTEST.replace("item.callspec.params", "{}"))
    pytester.makepyfile(
        test_unsent=HEADER
        + f"""
@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("cfg", [dict(name=n, make=lambda: n) for n in {NAMES}])
def test_hash_order_with_a_lambda(cfg):
    pass

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("fn", [lambda: 1])
def test_the_same_lambda_everywhere(fn):
    assert fn() == 1
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(failed=6, passed=1)
    text = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*rank 0 collected test_unsent.py::test_hash_order_with_a_lambda[[]cfg0[]] with cfg={'name': *, "
            "the controller with cfg={'name': *, and the controller's value cannot be sent to the ranks "
            "(*pickle*; the ranks run with PYTHONHASHSEED='0'); parametrize over values that are the same "
            "in every process: a sorted list (sorted({...})) rather than a set, PYTHONHASHSEED set*"
        ]
    )
    assert "<lambda>" in text and " at 0x" not in text.split("collected test_unsent.py")[1].split("\n")[0]


@pytest.mark.slow
def test_a_parameter_that_cannot_be_sent_and_cannot_be_told_apart_is_refused(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value that does not pickle (it holds a lock) and has the default repr: every case has
    the same text, so an equal text proves nothing while the controller hashes strings otherwise
    than the ranks; each case fails naming the parameter and the case it cannot be told from,
    rather than run another case's value. A single such case has no twin and runs."""
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    monkeypatch.setenv("DROP_HASHSEED", "1")
    pytester.makeconftest(HASH_CONFTEST.replace("item.callspec.params", "{}"))
    pytester.makepyfile(
        test_unsent_repr=HEADER
        + f"""
import threading

class Case:
    def __init__(self, name):
        self.name, self.lock = name, threading.Lock()

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("case", [Case(n) for n in {NAMES}])
def test_default_repr(case):
    pass

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("case", [Case("only")])
def test_one_case(case):
    assert case.name == "only"
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(failed=6, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*rank ? cannot tell whether its case=<test_unsent_repr.Case object> of "
            "test_unsent_repr.py::test_default_repr[[]case?[]] is the controller's: the controller's value "
            "cannot be sent to the ranks (*pickle*), its text is also that of "
            "test_unsent_repr.py::test_default_repr[[]case?[]], and the controller hashes strings otherwise "
            "than the ranks (they run with PYTHONHASHSEED='0')*give the value a repr that tells the cases "
            "apart, or parametrize over values*"
        ]
    )


@pytest.mark.slow
def test_the_marks_of_a_case_follow_the_controllers_value(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pytest.param(value, marks=...)`` over a set: where a rank's own case under an id is
    another than the controller's, the rank takes the controller's case's marks with its value,
    so no case is skipped with another case's reason; xfail (applied by the controller) still
    turns the controller's xfail case's failure into an xfail."""
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    monkeypatch.setenv("DROP_HASHSEED", "1")
    pytester.makeconftest(HASH_CONFTEST)
    pytester.makepyfile(
        test_case_marks=HEADER
        + f"""
def marks(name):
    if name == "gamma":
        return pytest.mark.skip(reason="gamma unsupported")
    if name == "beta":
        return pytest.mark.xfail(reason="beta is broken", strict=True)
    return ()

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("cfg", [pytest.param(dict(name=n), marks=marks(n)) for n in {NAMES}])
def test_marks(cfg, request):
    names = sorted(m.name for m in request.node.iter_markers() if m.name in ("skip", "xfail"))
    Path(f"seen-{{gpc.get_global_rank()}}-{{request.node.name}}.json").write_text(json.dumps([cfg, names]))
    assert cfg["name"] != "beta"
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rsx", timeout=300)
    result.assert_outcomes(passed=4, skipped=1, xfailed=1)
    controller = json.loads((pytester.path / "controller.json").read_text())
    seen = sorted(pytester.path.glob("seen-*.json"))
    assert len(seen) == 10, [p.name for p in seen]  # 5 cases run (gamma skipped) x 2 ranks
    for path in seen:
        cfg, names = json.loads(path.read_text())
        nodeid = next(n for n in controller if n.endswith("::" + path.stem.split("-", 2)[2]))
        assert cfg == controller[nodeid]["cfg"], path.name
        assert names == (["xfail"] if cfg["name"] == "beta" else []), (path.name, names)


@pytest.mark.slow
def test_a_value_equal_to_the_controllers_keeps_its_identity(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value whose pickle follows the hash seed (an object holding a set of strings) but holds
    the same as the controller's is the rank's own case: the rank keeps its own object (the
    module's, for lookups by identity) rather than a copy, whether or not the class defines
    ``==``; a value that differs is still replaced."""
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    monkeypatch.setenv("DROP_HASHSEED", "1")
    pytester.makeconftest(HASH_CONFTEST.replace("item.callspec.params", "{}"))
    pytester.makepyfile(
        test_identity=HEADER
        + """
class Case:
    def __init__(self, name, tags):
        self.name, self.tags = name, tags

class Equal(Case):
    def __eq__(self, other):
        return isinstance(other, Equal) and (self.name, self.tags) == (other.name, other.tags)

    __hash__ = object.__hash__

TAGS = [{"fp32", "cpu", "gloo", "eager"}, {"bf16", "fused", "compile", "nccl"}]
CASES = [Case("small", TAGS[0]), Case("large", TAGS[1])]
EQUALS = [Equal("small", TAGS[0]), Equal("large", TAGS[1])]
EXPECTED = {id(case): case.name for case in CASES + EQUALS}

@pytest.mark.parallel(world_size=2)
@pytest.mark.parametrize("case", CASES + EQUALS)
def test_lookup(case):
    assert EXPECTED.get(id(case)) == case.name, f"{case.name}: a copy of the module's case"
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=4)
