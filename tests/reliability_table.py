"""The "Inputs refused" table of docs/reliability.md, produced by running the code.

``python tests/reliability_table.py`` prints the table's rows (markdown); the messages are the
ones the library raises today. ``tests/test_reliability_doc.py`` checks that the page still
shows exactly these messages.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from parallelctx import Config, ConfigError, plan
from parallelctx.args import validate_launch_args
from parallelctx.config import check_init_method_env
from parallelctx.env import detect
from parallelctx.hostlist import expand_hostlist, first_host

TORCHRUN = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "h",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "x",
}
SRUN = {
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NODELIST": "n[1-2]",
}
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}


def _files(folder: Path) -> None:
    (folder / "latin1.json").write_bytes(b'{"model": {"name": "caf\xe9"}}')
    (folder / "latin1.toml").write_bytes(b'[model]\nname = "caf\xe9"\n')
    (folder / "latin1.yaml").write_bytes(b"model:\n  name: caf\xe9\n")
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    (folder / "bomb.yaml").write_text("\n".join(lines) + "\n")
    (folder / "self.py").write_text("model = {}\nmodel['again'] = model\n")
    (folder / "deep.json").write_text("[" * 5000 + "]" * 5000)
    (folder / "deep.py").write_text("x = []\nfor _ in range(5000):\n    x = [x]\n")
    (folder / "configs.yaml").mkdir()


# (fault class, the input as a user writes it, the call that reads it)
CASES: list[tuple[str, str, Callable[[], Any]]] = [
    ("timeout", "`dist.timeout=inf`", lambda: Config({"dist": {"timeout": float("inf")}})),
    ("timeout", "`dist.timeout=nan`", lambda: Config({"dist": {"timeout": float("nan")}})),
    ("timeout", "`dist.timeout=1e20`", lambda: Config({"dist": {"timeout": 1e20}})),
    ("timeout", "`dist.timeout=2**64`", lambda: Config({"dist": {"timeout": 2**64}})),
    (
        "timeout",
        "`dist.timeout=timedelta(days=999999999)`",
        lambda: Config({"dist": {"timeout": timedelta(days=999999999)}}),
    ),
    ("typo", "`parallel.tensor={'sizes': 4}`", lambda: Config({"parallel": {"tensor": {"sizes": 4}}})),
    (
        "typo",
        "`parallel.pipeline={'size': 2, 'szie': 4}`",
        lambda: Config({"parallel": {"pipeline": {"size": 2, "szie": 4}}}),
    ),
    (
        "typo",
        "`parallel.expert={'size': 2, 'tensr': 2}`",
        lambda: Config({"parallel": {"expert": {"size": 2, "tensr": 2}}}),
    ),
    ("typo", "`parallel={'tensr': 2}`", lambda: Config({"parallel": {"tensr": 2}})),
    ("typo", "`dist={'timout': 60}`", lambda: Config({"dist": {"timout": 60}})),
    ("typo", "`paralel={'tensor': 2}` (a section)", lambda: Config({"paralel": {"tensor": 2}})),
    ("typo", "`Seed=1`", lambda: Config({"Seed": 1})),
    (
        "typo",
        "`parallelism={'tensor': 2, 'pipeline': 2}` (torchtitan's name for the section)",
        lambda: Config({"parallelism": {"tensor": 2, "pipeline": 2}}),
    ),
    (
        "typo",
        "`distributed={'backend': 'gloo', 'timeout': 60}`",
        lambda: Config({"distributed": {"backend": "gloo", "timeout": 60}}),
    ),
    ("typo", "`tensor=2`, `pipeline=2` (at the top level)", lambda: Config({"tensor": 2, "pipeline": 2})),
    (
        "typo",
        "`parallelism={'tensor_parallel_degree': 2}` (torchtitan's key name)",
        lambda: Config({"parallelism": {"tensor_parallel_degree": 2}}),
    ),
    ("type", "`parallel.tensor={'size': True}`", lambda: Config({"parallel": {"tensor": {"size": True}}})),
    ("type", "`parallel.tensor='2'`", lambda: Config({"parallel": {"tensor": "2"}})),
    ("type", "`parallel.tensor={'size': '2'}`", lambda: Config({"parallel": {"tensor": {"size": "2"}}})),
    ("type", "`seed=True`", lambda: Config({"seed": True})),
    ("type", "`seed=b'1'`", lambda: Config({"seed": b"1"})),
    ("init_method", "`dist.init_method='tcp://'`", lambda: Config({"dist": {"init_method": "tcp://"}})),
    (
        "init_method",
        "`dist.init_method='tcp://host'`",
        lambda: Config({"dist": {"init_method": "tcp://host"}}),
    ),
    (
        "init_method",
        "`dist.init_method='tcp://127.0.0.1:99999'`",
        lambda: Config({"dist": {"init_method": "tcp://127.0.0.1:99999"}}),
    ),
    ("init_method", "`dist.init_method='file://'`", lambda: Config({"dist": {"init_method": "file://"}})),
    (
        "init_method",
        "`dist.init_method='env://'`, MASTER_* unset (`check_init_method_env` at launch)",
        lambda: check_init_method_env("env://", {}),
    ),
    ("file", "`latin1.json` (not UTF-8)", lambda: Config.from_file("latin1.json")),
    ("file", "`latin1.toml` (not UTF-8)", lambda: Config.from_file("latin1.toml")),
    ("file", "`latin1.yaml` (not UTF-8)", lambda: Config.from_file("latin1.yaml")),
    (
        "file",
        "`bomb.yaml`: 1 KB of aliases expanding to 10**10 values",
        lambda: Config.from_file("bomb.yaml"),
    ),
    ("file", "`self.py`: a dict that contains itself", lambda: Config.from_file("self.py")),
    ("file", "`deep.json`: 5,000 nested lists", lambda: Config.from_file("deep.json")),
    ("file", "`deep.py`: 5,000 nested lists", lambda: Config.from_file("deep.py")),
    ("file", "`configs.yaml/`, a directory", lambda: Config.from_file("configs.yaml")),
    ("shadowed key", "`model={'items': 3}`", lambda: Config({"model": {"items": 3}})),
    ("launch()", "`port='abc'`", lambda: validate_launch_args(port="abc")),
    ("launch()", "`port=2.5`", lambda: validate_launch_args(port=2.5)),
    ("launch()", "`rank='0'`", lambda: validate_launch_args(rank="0")),
    ("launch()", "`timeout=float('nan')`", lambda: validate_launch_args(timeout=float("nan"))),
    ("launch()", "`timeout=float('inf')`", lambda: validate_launch_args(timeout=float("inf"))),
    ("environment", "`RANK='1_0'` (torchrun)", lambda: detect({**TORCHRUN, "RANK": "1_0"})),
    ("environment", "`WORLD_SIZE=2**40` (torchrun)", lambda: detect({**TORCHRUN, "WORLD_SIZE": str(2**40)})),
    ("environment", "`SLURM_STEP_ID=abc`", lambda: detect({**SRUN, "SLURM_STEP_ID": "abc"})),
    (
        "environment",
        "`OMPI_COMM_WORLD_RANK=3`, `PMI_RANK=0`, `PMI_SIZE=1`",
        lambda: detect({**OMPI, "PMI_RANK": "0", "PMI_SIZE": "1"}),
    ),
    (
        "environment",
        "`expand_hostlist('n[1-100000000]')` (the full list)",
        lambda: expand_hostlist("n[1-100000000]"),
    ),
    ("planner", "`plan(2**31)`", lambda: plan(2**31)),
    ("planner", "`plan(2**63)`", lambda: plan(2**63)),
]

ACCEPTED: list[tuple[str, str, Callable[[], Any]]] = [
    (
        "environment",
        "`SLURM_JOB_NODELIST='n[1-100000000]'`: master address, without expanding",
        lambda: detect({**SRUN, "SLURM_JOB_NODELIST": "n[1-100000000]"}).master_addr,
    ),
    ("environment", "`first_host('n[1-100000000]')`", lambda: first_host("n[1-100000000]")),
]


def _message(exc: BaseException) -> str:
    """The one-line message a user reads; for pydantic, the location and the message."""
    if isinstance(exc, ValidationError) and not isinstance(exc, ConfigError):
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        text = re.sub(r"^Value error, ", "", err["msg"])
        if not text.startswith(where):  # pydantic shows the location on a line of its own
            text = f"{where}: {text}"
        return f"{type(exc).__name__}: {text}"
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _in_folder() -> Iterator[None]:
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            _files(Path(folder))
            yield
        finally:
            os.chdir(here)


def rows() -> list[tuple[str, str, str]]:
    """Return (fault class, input, what the user sees) for every case, by running it."""
    out: list[tuple[str, str, str]] = []
    with _in_folder():
        for kind, given, call in CASES:
            try:
                result = call()
            except Exception as exc:
                out.append((kind, given, _message(exc)))
            else:
                out.append((kind, given, f"ACCEPTED (should be refused): {result!r}"))
        for kind, given, call in ACCEPTED:
            out.append((kind, given, f"accepted: {call()!r}"))
    return out


def table() -> str:
    """Return the markdown table of :func:`rows`."""
    lines = ["| fault | input | what the user sees |", "| --- | --- | --- |"]
    for kind, given, seen in rows():
        lines.append(f"| {kind} | {given} | `{seen.replace('|', '/')}` |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
