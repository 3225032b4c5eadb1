"""The layers of docs/internals.md hold: each module imports only its own layer and the layers
below, no import circle, nothing below the facade knows the context, nothing but the facade
touches its private members, a torch-free planner, complete tables."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "parallelctx"

# Layer of every module: the first entry whose prefix the module's dotted name (under
# parallelctx) starts with. Lower numbers are lower layers.
LAYERS: list[tuple[str, str, int]] = [
    ("planning", "planning", 0),
    ("config", "config", 1),
    ("env", "env", 1),
    ("guard", "guard", 2),
    ("runtime", "runtime", 3),
    ("context", "facade", 4),
    ("launch", "bridges", 5),
    ("spawn", "bridges", 5),
    ("local", "bridges", 5),
    ("checkpoint", "bridges", 5),
    ("clip", "bridges", 5),
    ("engines", "bridges", 5),
    ("dryrun", "bridges", 5),
    ("pipelining", "bridges", 5),
    ("deepspeed", "bridges", 5),
    ("torchtitan", "bridges", 5),
    ("megatron", "bridges", 5),
    ("cli", "tools", 6),
    ("testing", "tools", 6),
    ("__main__", "tools", 6),
]
# What each layer may import besides itself and the layers below it: nothing. And layers of the
# same height that must not know each other.
APART = {("config", "env"), ("env", "config"), ("runtime", "env")}
TORCH_FREE_LAYERS = ("planning", "config", "env")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def layer_of(module: str) -> tuple[str, int]:
    """(layer name, height) of a module under parallelctx ("" is the package face)."""
    for prefix, name, height in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return name, height
    raise AssertionError(f"parallelctx.{module} belongs to no layer of tests/test_internals.py: add it")


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name (under parallelctx, "" for the package) of a relative import."""
    base = module.split(".") if module else []
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([name] if name else [])])


def imports(module: str) -> Iterator[tuple[str, bool, list[str]]]:
    """(imported module under parallelctx, at module level, names taken) for every import of
    parallelctx/``module`` that stays inside the package; ``from . import x`` counts as the
    module ``x`` when ``x`` is one, else as the package itself (with ``x`` among the names)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        at_top = id(node) in top
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "parallelctx" or alias.name.startswith("parallelctx."):
                    yield alias.name.removeprefix("parallelctx").lstrip("."), at_top, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve(module, path.name == "__init__.py", node.level, node.module)
            elif node.module == "parallelctx" or (node.module or "").startswith("parallelctx."):
                base = node.module.removeprefix("parallelctx").lstrip(".")  # type: ignore[union-attr]
            else:
                continue
            loose = [a.name for a in node.names if f"{base}.{a.name}".lstrip(".") not in MODULES]
            for alias in node.names:
                sub = f"{base}.{alias.name}".lstrip(".")
                if sub in MODULES:
                    yield sub, at_top, []
            if loose or not node.names:
                yield base, at_top, loose


def _names(module: str) -> set[str]:
    """Every identifier the code of ``module`` uses (names, attributes, imported names), not
    its docstrings or comments."""
    tree = ast.parse(MODULES[module].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.rpartition(".")[2])
    return found


LIBRARY = [m for m in MODULES if m and layer_of(m)[0] != "tools"]


@pytest.mark.parametrize("module", [m for m in MODULES if m])
def test_every_import_runs_down_or_within_its_layer(module: str) -> None:
    name, height = layer_of(module)
    for target, _, names in imports(module):
        if target == "":
            assert name == "tools", (
                f"parallelctx.{module} imports the package face ({names}); import the module"
            )
            continue
        their, theirs = layer_of(target)
        assert theirs <= height, (
            f"parallelctx.{module} ({name}) imports parallelctx.{target} ({their}), a layer above"
        )
        assert (name, their) not in APART, (
            f"parallelctx.{module} ({name}) imports parallelctx.{target} ({their})"
        )


def test_no_import_circle() -> None:
    graph = {m: {t for t, _, _ in imports(m) if t and t != m} for m in MODULES if m}
    # A package's __init__ re-exporting its own modules is no circle unless one imports it back.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, f"import circles (deferred imports count): {circles}"


@pytest.mark.parametrize("module", [m for m in MODULES if m and layer_of(m)[1] < 4])
def test_nothing_below_the_facade_knows_the_context(module: str) -> None:
    assert not any(t == "context" for t, _, _ in imports(module)), f"parallelctx.{module} imports the facade"
    named = _names(module) & {"gpc", "ParallelContext"}
    assert not named, f"parallelctx.{module} names {sorted(named)}: take values, not the context"


def test_no_module_but_the_facade_touches_a_private_member_of_gpc() -> None:
    touched = []
    for module in MODULES:
        if module == "context":
            continue
        tree = ast.parse(MODULES[module].read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in ("gpc", "ctx", "context", "parallel_context")
            ):
                touched.append(f"parallelctx.{module}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not touched, "\n".join(touched)


def test_the_facade_is_small() -> None:
    lines = len((PKG / "context.py").read_text().splitlines())
    # the launch's values, seeds and summary are in runtime/queries.py (LaunchQueries, a base class)
    assert lines <= 450, f"context.py has {lines} lines; its state goes in runtime/, its guards in guard/"


@pytest.mark.parametrize("module", [m for m in MODULES if m and layer_of(m)[0] in TORCH_FREE_LAYERS])
def test_torch_free_layers_do_not_import_torch_at_load(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        assert not any(n.split(".")[0] == "torch" for n in names), (module, names)


@pytest.mark.parametrize("module", LIBRARY)
def test_the_library_never_imports_the_command_line_tools(module: str) -> None:
    for target, _, _ in imports(module):
        assert layer_of(target)[0] != "tools", (module, target)


def test_the_top_level_holds_the_face_the_facade_and_the_entry_points() -> None:
    top = {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}
    assert top == {
        "context",
        "launch",
        "spawn",
        "local",
        "checkpoint",
        "clip",
        "dryrun",
        "pipelining",
        "deepspeed",
        "torchtitan",
    }
    packages = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert packages == {
        "planning",
        "config",
        "env",
        "guard",
        "runtime",
        "megatron",
        "engines",
        "cli",
        "testing",
    }
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


def test_boundaries_within_the_layers() -> None:
    assert "spawn" not in {t for t, _, _ in imports("launch")}, "launch.py imports spawn.py"
    runtime = {t for m in MODULES if m and layer_of(m)[0] == "runtime" for t, _, _ in imports(m)}
    assert not {t for t in runtime if layer_of(t)[0] in ("env", "bridges")}, (
        "the start-up imports no launcher"
    )
    assert "context" not in {t for t, _, _ in imports("runtime.mesh")}, "mesh takes values, not the context"


def test_every_moved_module_is_the_same_object_under_its_old_name() -> None:
    import importlib

    import parallelctx

    for old, new in parallelctx.MOVED.items():
        assert importlib.import_module(f"parallelctx.{old}") is importlib.import_module(
            f"parallelctx.{new}"
        ), old
        assert new in MODULES, new


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
        "import parallelctx.layout, parallelctx.views, parallelctx.planning.simulation, parallelctx.config.args\n"
        "import parallelctx.env.slurm, parallelctx.hostlist, parallelctx.limits\n"
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
