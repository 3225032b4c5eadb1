"""The API page lists every public name, and every public function has a docstring."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import parallelctx
from parallelctx import ParallelContext

API = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
MODULES = [
    "config",
    "context",
    "views",
    "startup",
    "rngstate",
    "env",
    "hostlist",
    "launch",
    "layout",
    "seed",
    "mesh",
    "groups",
    "megatron",
    "torchtitan",
    "deepspeed",
    "pipelining",
    "rendezvous",
    "abort",
    "spawn",
    "checkpoint",
    "args",
    "cli",
    "cli.main",
    "cli.plan",
    "cli.env",
    "cli.check",
    "cli.verify",
    "cli.timing",
    "cli.placement",
    "cli.tables",
    "cli.picture",
    "cli.dry_run",
    "cli.sweep",
    "dryrun",
    "planning.simulation",
    "planning.covering",
    "config.values",
    "config.schema",
    "config.errors",
    "config.files",
    "config.sections",
    "env.base",
    "env.torchrun",
    "env.mpi",
    "env.slurm",
    "env.plain",
    "env.ports",
    "guard.core",
    "guard.sockets",
    "guard.patch",
    "guard.recorder",
    "runtime.meetings",
    "runtime.simulate",
    "testing",
    "testing.asserts",
    "testing.balance",
    "testing.pool",
    "testing.plugin",
    "testing.rank",
    "testing.report",
    "testing.worker",
]


def test_every_exported_name_is_documented() -> None:
    missing = [name for name in parallelctx.__all__ if f"`{name}" not in API]
    assert not missing, f"docs/api.md does not mention {missing}"


def test_every_context_member_is_documented() -> None:
    public = [m for m in dir(ParallelContext) if not m.startswith("_")]
    missing = [m for m in public if m not in API]
    assert not missing, f"docs/api.md does not mention gpc.{missing}"


def test_public_functions_have_docstrings() -> None:
    undocumented = []
    for name in MODULES:
        module = importlib.import_module(f"parallelctx.{name}")
        for attr in getattr(module, "__all__", []):
            obj = getattr(module, attr)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and not inspect.getdoc(obj):
                undocumented.append(f"{name}.{attr}")
            if inspect.isclass(obj):
                for meth_name, meth in vars(obj).items():
                    if (
                        inspect.isfunction(meth)
                        and not meth_name.startswith("_")
                        and not inspect.getdoc(meth)
                    ):
                        undocumented.append(f"{name}.{attr}.{meth_name}")
    assert not undocumented, undocumented


def test_relative_links_in_docs_resolve() -> None:
    import re

    root = Path(__file__).resolve().parent.parent
    pages = list((root / "docs").rglob("*.md")) + [root / "README.md"]
    broken = [
        f"{page.relative_to(root)} -> {target}"
        for page in pages
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text())
        if not target.startswith(("http://", "https://")) and not (page.parent / target).exists()
    ]
    assert not broken, broken
