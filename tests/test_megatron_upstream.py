"""Megatron-core's own ``tests/unit_tests/test_parallel_state.py``, unchanged, on gpc + the bridge.

For the installed release (0.16 -> tag core_v0.16.1, 0.17 -> core_v0.17.1, 0.18 -> core_v0.18.2,
0.19 -> core_v0.19.0) the file is taken, first found first, from ``$MEGATRON_LM_TESTS_0_17`` (a
path to that file, one variable per release) or ``$MEGATRON_LM_TESTS`` (the file for whichever
release runs); from ``$MEGATRON_LM``, a local clone of NVIDIA/Megatron-LM (bare or not) holding
the release tags, as ``git show <tag>:tests/unit_tests/test_parallel_state.py`` (no network:
what CI uses); from ``.cache/megatron-lm/<tag>/``; or downloaded from GitHub into that cache. It
then runs twice on 8 CPU ranks (gloo), each rank a process running pytest on it, with the file's
``Utils`` pointed at Megatron's own ``initialize_model_parallel`` (the control) and at gpc +
``parallelctx.megatron.install()`` (tests/megatron_upstream.py). Every test must end the same way
on every rank under both: what passes under Megatron's own init passes on the bridge, and what it
refuses the bridge refuses. Each rank records its outcomes after every test; a run past
``PARALLELCTX_MEGATRON_UPSTREAM_TIMEOUT`` seconds a rank (default 1500) fails saying how many tests
each rank finished.

A few minutes a release on 2 cores, and it needs the file, so it runs only from ``make
test-megatron-upstream`` (``PARALLELCTX_MEGATRON_UPSTREAM=1``); without the file and without
network it is skipped, saying so. A ``$MEGATRON_LM`` that is not a git repository, or lacks the
tag, fails naming the path, the tag and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from parallelctx.launch import free_port
from parallelctx.megatron import release as _release

ROOT = Path(__file__).resolve().parent.parent
TAGS = {"0.16": "core_v0.16.1", "0.17": "core_v0.17.1", "0.18": "core_v0.18.2", "0.19": "core_v0.19.0"}
UPSTREAM_PATH = "tests/unit_tests/test_parallel_state.py"
URL = "https://raw.githubusercontent.com/NVIDIA/Megatron-LM/{tag}/tests/unit_tests/test_parallel_state.py"
WORLD = 8
# Each rank may take this long (seconds) for the whole file; a loaded machine needs much more
# than a quiet one, and a test that fails on some ranks only makes the others wait out their
# collective timeouts.
RANK_TIMEOUT = int(os.environ.get("PARALLELCTX_MEGATRON_UPSTREAM_TIMEOUT", "1500"))

# The run itself (minutes); the tests of where the file comes from run everywhere.
upstream_run = pytest.mark.skipif(
    os.environ.get("PARALLELCTX_MEGATRON_UPSTREAM") != "1",
    reason="Megatron's own test file runs only from `make test-megatron-upstream`",
)


def _from_clone(clone: str, tag: str) -> str:
    """``git show <tag>:tests/unit_tests/test_parallel_state.py`` in the Megatron-LM clone at ``clone``.

    Raises (as a test failure): the path is no git repository, git is missing, or the tag or
    the file at it is not there; the message names the path, the tag and the fix."""
    where = Path(clone).expanduser()
    fix = (
        f"set MEGATRON_LM to a clone of https://github.com/NVIDIA/Megatron-LM holding the tag "
        f"(`git -C {where} fetch origin tag {tag}`), or unset it"
    )
    if not where.is_dir():
        pytest.fail(f"MEGATRON_LM={clone!r} is not a directory; {fix}", pytrace=False)
    try:
        shown = subprocess.run(
            ["git", "-C", str(where), "show", f"{tag}:{UPSTREAM_PATH}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError:
        pytest.fail(
            f"MEGATRON_LM={clone!r} is set, but git is not installed; install git, or unset it",
            pytrace=False,
        )
    if shown.returncode != 0:
        pytest.fail(
            f"MEGATRON_LM={clone!r}: `git show {tag}:{UPSTREAM_PATH}` failed "
            f"({shown.stderr.strip() or shown.returncode}); {fix}",
            pytrace=False,
        )
    return shown.stdout


def _upstream_file(tmp: Path) -> tuple[Path, str]:
    """Megatron-LM's test file for the installed release, copied into ``tmp``, and where it came from."""
    version = _release.detect().version.rsplit(".", 1)[0]
    tag = TAGS.get(version)
    if tag is None:
        pytest.skip(f"no upstream tag known for megatron-core {version}; known: {TAGS}")
    target = tmp / "test_parallel_state.py"
    # a file per release (make test-megatron-upstream runs each venv), else one for whichever runs
    variable = f"MEGATRON_LM_TESTS_{version.replace('.', '_')}"
    given = os.environ.get(variable) or os.environ.get("MEGATRON_LM_TESTS")
    clone = os.environ.get("MEGATRON_LM")
    cached = ROOT / ".cache" / "megatron-lm" / tag / "test_parallel_state.py"
    if given:
        shutil.copyfile(Path(given).expanduser(), target)
        return target, f"{given} ({variable} or MEGATRON_LM_TESTS)"
    if clone:
        target.write_text(_from_clone(clone, tag))
        return target, f"{tag} in MEGATRON_LM={clone}"
    if not cached.exists():
        try:
            with urllib.request.urlopen(URL.format(tag=tag), timeout=30) as response:
                text = response.read().decode()
        except OSError as exc:
            pytest.skip(
                f"no copy of Megatron-LM's {UPSTREAM_PATH} at {tag} for megatron-core {version}: "
                f"MEGATRON_LM (a local Megatron-LM clone with the tag), {variable} and "
                f"MEGATRON_LM_TESTS (the file) are unset, {cached} does not exist, and GitHub is "
                f"unreachable ({exc})"
            )
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(text)
    shutil.copyfile(cached, target)
    return target, f"{tag} from {cached}"


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


@upstream_run
@pytest.mark.timeout(2 * RANK_TIMEOUT + 600)
def test_their_test_parallel_state_passes_on_the_bridge_where_it_passes_on_megatron(tmp_path: Path) -> None:
    test_file, source = _upstream_file(tmp_path)
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
    # one line to quote: the tests that ended the same way on every rank under both inits
    same = [
        outcomes[0][0]
        for outcomes in summary.values()
        if len(outcomes[0]) == 1 and outcomes[0] == outcomes[1]
    ]
    counts = {outcome: same.count(outcome) for outcome in sorted(set(same))}
    print(
        f"megatron-core {_release.detect().version}, file {source}: {len(ids)} tests; "
        f"the same on every rank under both inits: {counts}; other: {len(ids) - len(same)}"
    )
    assert len(passing) > 10, summary
    assert not lost, f"pass under Megatron's own init, not on the bridge: {lost}"
    # nor the other way: a test their init fails (an option it refuses, a combination it
    # rejects) must not pass on the bridge, which would mean the bridge accepts what Megatron refuses
    differ = {t: outcomes for t, outcomes in summary.items() if outcomes[0] != outcomes[1]}
    assert not differ, f"outcomes (Megatron's init, the bridge) differ: {differ}"


# Where the file comes from (no run, no network): a local clone, the per-release file, a skip.


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def megatron_lm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str, str]:
    """A bare clone holding the installed release's tag with a marked test_parallel_state.py;
    no variable set, no cache, no network."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    tag = TAGS[_release.detect().version.rsplit(".", 1)[0]]
    work = tmp_path / "work"
    (work / "tests" / "unit_tests").mkdir(parents=True)
    text = f"# test_parallel_state.py at {tag}\n"
    (work / UPSTREAM_PATH).write_text(text)
    _git("init", "-q", cwd=work)
    _git("add", ".", cwd=work)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "m", cwd=work)
    _git("tag", tag, cwd=work)
    (work / UPSTREAM_PATH).write_text("# later\n")  # the work tree is not what is read
    _git("clone", "-q", "--bare", str(work), str(tmp_path / "bare.git"), cwd=tmp_path)
    for name in (
        "MEGATRON_LM",
        "MEGATRON_LM_TESTS",
        *(f"MEGATRON_LM_TESTS_{v.replace('.', '_')}" for v in TAGS),
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "root")

    def offline(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no network in this test")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    return tmp_path, tag, text


@pytest.mark.parametrize("clone", ["bare.git", "work"])
def test_the_file_is_read_at_the_release_tag_of_a_local_clone(
    megatron_lm: tuple[Path, str, str], monkeypatch: pytest.MonkeyPatch, clone: str
) -> None:
    tmp, tag, text = megatron_lm
    monkeypatch.setenv("MEGATRON_LM", str(tmp / clone))
    out = tmp / "out"
    out.mkdir()
    path, source = _upstream_file(out)
    assert path.read_text() == text
    assert tag in source and clone in source


def test_a_clone_without_the_tag_or_no_clone_fails_naming_the_path_the_tag_and_the_fix(
    megatron_lm: tuple[Path, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, tag, _ = megatron_lm
    _git("tag", "-d", tag, cwd=tmp / "bare.git")
    monkeypatch.setenv("MEGATRON_LM", str(tmp / "bare.git"))
    with pytest.raises(pytest.fail.Exception) as err:
        _upstream_file(tmp)
    assert f"MEGATRON_LM={str(tmp / 'bare.git')!r}" in str(err.value)
    assert f"git -C {tmp / 'bare.git'} fetch origin tag {tag}" in str(err.value)
    monkeypatch.setenv("MEGATRON_LM", str(tmp / "nowhere"))
    with pytest.raises(pytest.fail.Exception, match="nowhere.*is not a directory"):
        _upstream_file(tmp)


def test_a_file_given_for_the_release_comes_before_the_clone(
    megatron_lm: tuple[Path, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp, _, _ = megatron_lm
    given = tmp / "given.py"
    given.write_text("# given\n")
    version = _release.detect().version.rsplit(".", 1)[0]
    monkeypatch.setenv("MEGATRON_LM", str(tmp / "nowhere"))
    monkeypatch.setenv(f"MEGATRON_LM_TESTS_{version.replace('.', '_')}", str(given))
    out = tmp / "out"
    out.mkdir()
    assert _upstream_file(out)[0].read_text() == "# given\n"


def test_without_any_copy_it_is_skipped_saying_what_to_set(megatron_lm: tuple[Path, str, str]) -> None:
    tmp, tag, _ = megatron_lm
    with pytest.raises(pytest.skip.Exception) as err:
        _upstream_file(tmp)
    assert "MEGATRON_LM" in str(err.value) and tag in str(err.value) and "unreachable" in str(err.value)


def test_every_supported_release_has_a_tag_a_venv_and_a_tested_version() -> None:
    # release.py, the test extra's pin (.venv), the Makefile's venvs and the tags here name the
    # same releases
    import re
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    pinned = [r.split("==")[1] for r in extra if r.startswith("megatron-core==")]
    makefile = (ROOT / "Makefile").read_text()
    venvs = re.findall(r"^MCORE_VERSION_\d+\s*:=\s*(\S+)$", makefile, re.M)
    assert sorted(TAGS) == sorted(_release.SUPPORTED_RELEASES)
    assert all(TAGS[v].startswith(f"core_v{v}.") for v in TAGS)
    assert tuple(sorted(pinned + venvs)) == _release.TESTED_VERSIONS
    assert {v.rsplit(".", 1)[0] for v in _release.TESTED_VERSIONS} == set(_release.SUPPORTED_RELEASES)
