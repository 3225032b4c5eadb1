"""Every install command parallelctx prints works verbatim (issue 27), marker ``installs``
(``make test-installs``, several minutes: a fresh virtual environment per extra).

For each optional feature: a fresh venv with torch 2.13.0 and parallelctx (from this checkout);
the feature is used and fails with its message; every `` `pip install ...` `` command in that
message is run as printed, in a shell whose ``pip`` is the venv's; then the feature is used again
and works. ``PIP_CONSTRAINT`` holds requirements/constraints.txt throughout, so that no command
can move torch off 2.13.0 (the test checks it did not).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.installs, pytest.mark.timeout(1800)]  # a venv per test: minutes each

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"

# extra -> (the use that needs it, as python arguments; what its success prints or writes)
USES: dict[str, list[str]] = {
    "plot": ["-m", "parallelctx", "plan", "--world-size", "4", "--nproc-per-node", "2", "--png", "out.png"],
    "megatron": ["-c", "import parallelctx.megatron"],
    "torchtitan": [
        "-c",
        "import parallelctx\nparallelctx.launch()\nfrom parallelctx.torchtitan import parallel_dims\n"
        "print('world', parallel_dims().world_size)",
    ],
}


def _environment(venv: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PIP_CONSTRAINT"] = str(CONSTRAINTS)  # torch stays 2.13.0 whatever a hint asks
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize("extra", sorted(USES))
def test_install_hint_works_verbatim_in_a_fresh_venv(extra: str, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _environment(venv)
    python = str(venv / "bin" / "python")
    for step in (["torch==2.13.0"], [str(ROOT)]):
        done = _run([python, "-m", "pip", "install", "-q", *step], env, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]

    before = _run([python, *USES[extra]], env, tmp_path)
    assert before.returncode != 0, f"{extra}: worked before its extra was installed: {before.stdout}"
    hints = re.findall(r"`(pip install [^`]+)`", before.stderr)
    assert hints, f"{extra}: the error gives no install command:\n{before.stderr[-3000:]}"

    for hint in hints[:1]:  # the first command is the advice; an alternative may follow it
        done = _run(["bash", "-c", hint], env, tmp_path)
        assert done.returncode == 0, f"{hint!r} failed:\n{done.stderr[-3000:]}"

    after = _run([python, *USES[extra]], env, tmp_path)
    assert after.returncode == 0, f"{extra}: still failing after {hints[0]!r}:\n{after.stderr[-3000:]}"
    if extra == "plot":
        assert (tmp_path / "out.png").stat().st_size > 0
    if extra == "torchtitan":
        assert "world 1" in after.stdout
    version = _run([python, "-c", "import torch; print(torch.__version__)"], env, tmp_path)
    assert version.stdout.strip().startswith("2.13.0"), version.stdout
