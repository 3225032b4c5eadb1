"""The module map of docs/internals.md holds: import rules, a torch-free planner, complete tables."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "parallelctx"
TORCH_FREE = [
    "limits",
    "_fastenum",
    "layout",
    "config",
    "args",
    "hostlist",
    "env",
    "views",
    "cli/__init__",
    "cli/main",
    "cli/plan",
    "cli/env",
    "cli/placement",
    "cli/tables",
    "cli/picture",
    "dryrun",
    "cli/sweep",
    "cli/dry_run",
]
# Integrations: modules named after the library or torch feature they bridge (docs/internals.md).
INTEGRATIONS = ["mesh", "checkpoint", "megatron", "torchtitan", "pipelining", "deepspeed"]


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import of parallelctx/<module>.py."""
    tree = ast.parse((PKG / f"{module}.py").read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        at_top = id(node) in top
        if isinstance(node, ast.Import):
            found += [(alias.name, at_top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if node.level and not node.module:  # from . import x
                found += [("." + alias.name, at_top) for alias in node.names]
            else:
                found.append((base, at_top))
    return found


def _modules() -> list[str]:
    """Every module of the package as a path without .py, relative to parallelctx/."""
    return sorted(
        str(p.relative_to(PKG).with_suffix("")) for p in PKG.rglob("*.py") if p.name != "__init__.py"
    )


def _library_modules() -> list[str]:
    """The library: every module but the command-line tools (cli/, __main__) and the pytest plugin."""
    return [m for m in _modules() if not m.startswith(("cli/", "testing/")) and m != "__main__"]


@pytest.mark.parametrize("module", [m for m in _modules() if not m.startswith("testing/")])
def test_no_module_imports_the_package(module: str) -> None:
    for name, _ in _imports(module):
        assert name not in ("parallelctx", ".") and not name.startswith("parallelctx."), (module, name)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_do_not_import_torch_at_load(module: str) -> None:
    for name, at_top in _imports(module):
        if at_top:
            assert not name.startswith("torch"), (module, name)


@pytest.mark.parametrize("module", _library_modules())
def test_the_library_never_imports_the_command_line_tools(module: str) -> None:
    for name, _ in _imports(module):
        assert not name.lstrip(".").startswith("cli"), (module, name)


def test_command_modules_live_in_the_cli_package_and_integrations_exist() -> None:
    top = {p.stem for p in PKG.glob("*.py")}
    assert not top & {"check", "checkcmd", "demo", "picture", "placement", "show", "timing", "cli"}, top
    packages = {p.parent.name for p in PKG.glob("*/__init__.py")}  # megatron/ is a package by concern
    assert {m for m in INTEGRATIONS} <= top | packages
    cli = {p.stem for p in (PKG / "cli").glob("*.py")}
    assert {
        "main",
        "plan",
        "env",
        "check",
        "verify",
        "timing",
        "placement",
        "tables",
        "picture",
        "demo",
    } <= cli


def test_launch_context_and_spawn_boundaries() -> None:
    assert not any(name in (".spawn",) for name, _ in _imports("launch")), "launch.py imports spawn.py"
    context = {name for name, _ in _imports("context")}
    assert not context & {".launch", ".spawn", ".env", ".checkpoint"}, context
    startup = {name for name, _ in _imports("startup")}
    assert not startup & {".launch", ".spawn", ".env"}, "the launch sequence imports no launcher code"
    mesh = {name for name, _ in _imports("mesh")}
    assert ".context" not in mesh, "mesh.py takes values, not the context"


def test_plan_and_env_run_with_torch_blocked() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked in this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from parallelctx.cli import main\n"
        "assert main(['plan', '--world-size', '16', '--tensor', '2', '--pipeline', '2', '--json']) == 0\n"
        "assert main(['plan', '--world-size', '16', '--tensor', '2', '--nproc-per-node', '4']) == 0\n"
        "assert main(['env', '--json']) == 0\n"
        "import parallelctx\n"
        "assert parallelctx.plan(8, tensor=2).data == 4 and parallelctx.Config is not None\n"
        "assert 'torch' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"tensor": [[0, 1]' in proc.stdout


def test_lazy_names_resolve_to_the_functions() -> None:
    import parallelctx
    import parallelctx.checkpoint
    import parallelctx.launch
    import parallelctx.spawn  # importing the submodules must not shadow the functions

    assert callable(parallelctx.launch) and parallelctx.launch.__module__ == "parallelctx.launch"
    assert callable(parallelctx.spawn) and parallelctx.spawn.__module__ == "parallelctx.spawn"
    assert callable(parallelctx.checkpoint) and parallelctx.checkpoint.__module__ == "parallelctx.checkpoint"
    assert set(parallelctx.__all__) <= set(dir(parallelctx))
    with pytest.raises(AttributeError, match="no attribute 'lanch'"):
        parallelctx.lanch


def test_every_table_covers_every_mode() -> None:
    from parallelctx.layout import _MODE_AXES, ParallelMode
    from parallelctx.mesh import MESH_DIMS
    from parallelctx.seed import STREAM_AXES, STREAM_SLOTS
    from parallelctx.views import VIEW_NAMES

    modes = set(ParallelMode)
    assert set(_MODE_AXES) == modes - {ParallelMode.EMBEDDING}  # EMBEDDING is derived from PIPELINE
    assert modes <= set(STREAM_AXES) and modes <= set(STREAM_SLOTS)
    assert set(VIEW_NAMES) == modes
    assert {mode for grid in MESH_DIMS.values() for dims in grid.values() for _, mode, _ in dims} <= modes


def test_fast_enum_reads_every_name_as_enum_does() -> None:
    from enum import EnumType

    from parallelctx.layout import ParallelMode

    names = {
        n for k in ParallelMode.__mro__ for n in vars(k) if not (n.startswith("__") and n.endswith("__"))
    }

    def read(how: object, name: str) -> object:
        try:
            return how(ParallelMode, name)  # type: ignore[operator]
        except AttributeError:
            return AttributeError

    for name in sorted(names):
        assert read(getattr, name) == read(type.__getattribute__, name), name
    assert isinstance(ParallelMode, EnumType)
    assert ParallelMode.TENSOR is ParallelMode("tensor") is ParallelMode["TENSOR"]
    assert (
        repr(ParallelMode.TENSOR) == "<ParallelMode.TENSOR: 'tensor'>"
        and str(ParallelMode.TENSOR) == "tensor"
    )
    assert ParallelMode.parse("data") is ParallelMode.DATA and len(ParallelMode) == 20


def test_the_version_ranks_agree_on_is_the_one_pyproject_installs() -> None:
    """The launch agreement compares ``parallelctx.__version__`` (startup.agreed_values), so two
    installs of different releases are refused only if that constant moves with the release:
    pyproject must take the version from it, not keep a second copy that can drift."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml: a static version beside __version__"
    assert "version" in project["project"].get("dynamic", [])
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "parallelctx.__version__"}
    import importlib.metadata

    import parallelctx

    assert importlib.metadata.version("parallelctx") == parallelctx.__version__
