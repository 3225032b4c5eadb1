"""One rank of a test pool: ``python -m parallelctx.testing.worker RANK WORLD CONTROL_PORT STACK_FILE``.

The worker connects back to the controller (the pytest process) on 127.0.0.1:CONTROL_PORT,
proves itself with the token in PARALLELCTX_POOL_TOKEN, then serves ``("run", spec)`` requests
until ``("exit",)`` or until the controller goes away. For each request it imports the test
module with pytest's assertion rewriting, launches ``gpc`` for the test's layout, calls the test
function with the arguments the controller sent, tears ``gpc`` down and answers with a result
dict. It never runs a pytest session. SIGUSR1 dumps the Python stack of every thread to
STACK_FILE (faulthandler), which the controller reads when a test hangs.
"""

from __future__ import annotations

import ast
import faulthandler
import importlib
import importlib.util
import os
import signal
import socket
import sys
import threading
import time
import types
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

__all__ = ["main", "run_test"]

_LOADED: dict[str, tuple[str, int]] = {}
#: Process groups of the last test, released only after its result is sent: closing gloo's
#: connections takes a good part of 0.1 s on 8 ranks, and the controller need not wait for it.
_RELEASE_LATER: list[Any] = []


def _hold_groups() -> None:
    """Keep references to gpc's groups (and the default group) so that gpc.destroy() is quick and
    their destructors run after the result has gone out."""
    import torch.distributed as dist

    from ..context import gpc

    _RELEASE_LATER.extend(gpc._groups.values())
    _RELEASE_LATER.extend(gpc._cpu_groups.values())
    _RELEASE_LATER.extend(gpc._views.values())
    _RELEASE_LATER.extend(gpc._device_meshes.values())
    if dist.is_initialized():
        _RELEASE_LATER.append(dist.group.WORLD)


def _watch_parent(parent: int) -> None:
    """Exit this process when the controller that started it is gone (a hung test cannot keep
    an orphan alive)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def _install_reprcompare(verbose: int) -> None:
    """Give rewritten asserts pytest's detailed comparisons (diffs of lists, dicts, strings),
    as a pytest session does; without it they still show the compared values."""
    from _pytest.assertion import util

    def reprcompare(op: str, left: object, right: object) -> str | None:
        try:
            lines = list(
                util.assertrepr_compare(  # type: ignore[call-arg,unused-ignore]
                    op=op,
                    left=left,
                    right=right,
                    verbose=verbose,
                    highlighter=util.dummy_highlighter,
                    assertion_text_diff_style="ndiff",
                )
            )
        except Exception:
            return None
        if not lines:
            return None
        if verbose < 2 and len(lines) > 40:
            lines = lines[:40] + ["...", "(explanation cut; -vv shows it whole)"]
        return "\n~".join(line.replace("\n", "\\n") for line in lines).replace("%", "%%")

    util._reprcompare = reprcompare


def load_module(name: str, file: str) -> types.ModuleType:
    """Import the test module ``name`` from ``file`` with its asserts rewritten by pytest.

    The module is cached until the file changes; a different file under the same name (two test
    directories with a ``test_x.py`` each) replaces it.

    Returns:
        The module.

    Raises:
        Whatever executing the module raises (SyntaxError, ImportError, ...).
    """
    from _pytest.assertion.rewrite import rewrite_asserts

    key = (file, os.stat(file).st_mtime_ns)
    existing = sys.modules.get(name)
    if existing is not None and _LOADED.get(name) == key:
        return existing
    source = Path(file).read_bytes()
    tree = ast.parse(source, filename=file)
    rewrite_asserts(tree, source, file, None)
    code = compile(tree, file, "exec", dont_inherit=True)
    package = name.rpartition(".")[0]
    if package:
        try:
            importlib.import_module(package)
        except ImportError:
            pass  # a rootdir-relative name whose parent is no real package
    module = types.ModuleType(name)
    module.__file__ = file
    module.__package__ = package
    module.__spec__ = importlib.util.spec_from_file_location(name, file)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        _LOADED.pop(name, None)
        raise
    _LOADED[name] = key
    return module


def _resolve(module: types.ModuleType, qualname: str) -> Any:
    """The test callable: a module function, or a method of a fresh instance of its class."""
    parts = qualname.split(".")
    obj: Any = module
    for part in parts[:-1]:
        obj = getattr(obj, part)
    if isinstance(obj, type):
        obj = obj()
    return getattr(obj, parts[-1])


def _exc_type(exc: BaseException) -> tuple[str, str]:
    cls = type(exc)
    return cls.__module__, cls.__qualname__


def _format_failure(exc: BaseException, func: Any, tbstyle: str) -> str:
    """The exception as pytest prints a failure for ``--tb=tbstyle``: source lines, ``>`` and
    ``E`` lines, starting at the test function's frame (the worker's own frames are cut); with
    ``auto`` the frames between the first and the last are one line each."""
    import traceback as std_traceback

    if tbstyle == "native":
        return "".join(std_traceback.format_exception(exc))
    from _pytest._code import ExceptionInfo
    from _pytest._code.code import Traceback

    try:
        info = ExceptionInfo.from_exception(exc)
        code = getattr(func, "__code__", None)
        entries = list(info.traceback)
        start = next((i for i, e in enumerate(entries) if e.frame.code.raw is code), 0)
        cut = Traceback(entries[start:]).filter(info)  # also drops __tracebackhide__ frames
        if tbstyle == "auto" and len(cut) > 2:
            cut = Traceback((cut[0], *(e.with_repr_style("short") for e in cut[1:-1]), cut[-1]))
        info.traceback = cut
        style: Literal["long", "short"] = "long" if tbstyle in ("auto", "long") else "short"
        return str(info.getrepr(style=style, funcargs=False, truncate_locals=True))
    except Exception:
        return "".join(std_traceback.format_exception(exc))


def run_test(spec: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Run one test on this rank: launch gpc for ``spec['config']``, call the test, destroy gpc.

    Returns:
        A dict: ``outcome`` (passed, failed, skipped, xfailed), ``phase`` (where it ended:
        import, launch, call, teardown), ``longrepr`` (the formatted failure), ``message``,
        ``exc_type`` (module, qualname of the exception), ``duration`` and ``clean`` (False when
        gpc could not be torn down, so the pool should not be reused).
    """
    from _pytest.outcomes import Skipped, XFailed

    from ..context import gpc
    from ..launch import launch

    result: dict[str, Any] = {
        "rank": rank,
        "outcome": "passed",
        "phase": "call",
        "longrepr": "",
        "message": "",
        "exc_type": None,
        "clean": True,
    }
    begin = time.perf_counter()
    for entry in reversed(spec["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    if os.getcwd() != spec["cwd"]:
        os.chdir(spec["cwd"])
    _install_reprcompare(spec.get("verbose", 0))
    func: Any = None
    try:
        result["phase"] = "import"
        func = _resolve(load_module(spec["module_name"], spec["module_file"]), spec["qualname"])
        result["phase"] = "launch"
        mark = time.perf_counter()
        # The default group connects on its first collective too (as the subgroups do with the
        # config's dist.gloo_lazy_init): a test pays only for the connections it uses.
        lazy = spec.get("lazy_default_group", False) and "TORCH_GLOO_LAZY_INIT" not in os.environ
        if lazy:
            os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        try:
            launch(
                spec["config"],
                rank=rank,
                world_size=world_size,
                host="127.0.0.1",
                port=spec["port"],
                local_rank=rank,
                local_world_size=world_size,
            )
        finally:
            if lazy:
                os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
        result["launch_s"] = time.perf_counter() - mark
        result["phase"] = "call"
        func(**spec["kwargs"])
    except Skipped as exc:
        result.update(outcome="skipped", message=exc.msg or "skipped")
    except XFailed as exc:
        result.update(outcome="xfailed", message=exc.msg or "xfail")
    except BaseException as exc:
        result.update(
            outcome="failed",
            message=f"{type(exc).__name__}: {exc}",
            exc_type=_exc_type(exc),
            longrepr=_format_failure(exc, func, spec.get("tbstyle", "auto")),
        )
    finally:
        mark = time.perf_counter()
        try:
            _hold_groups()
            gpc.destroy()
        except BaseException as exc:
            import traceback

            result.update(
                clean=False,
                outcome="failed",
                phase="teardown",
                longrepr=result["longrepr"] + "\ngpc.destroy() failed:\n" + traceback.format_exc(),
                message=result["message"] or f"{type(exc).__name__}: {exc}",
            )
        result["destroy_s"] = time.perf_counter() - mark
        if result["phase"] != "call":
            result["clean"] = False  # launch or import did not finish alike on every rank
        sys.stdout.flush()
        sys.stderr.flush()
    result["duration"] = time.perf_counter() - begin
    return result


def main(argv: list[str] | None = None) -> int:
    """Serve the controller until it says exit or goes away.

    Returns:
        The process exit code (0 after ``exit``, 1 when the controller went away).

    Raises:
        ValueError: bad command-line arguments (the usage is in the module docstring).
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        raise ValueError(
            f"usage: python -m parallelctx.testing.worker RANK WORLD CONTROL_PORT STACK_FILE, got {args}"
        )
    rank, world_size, control_port = int(args[0]), int(args[1]), int(args[2])
    stacks = open(args[3], "w")  # noqa: SIM115 - kept open for faulthandler for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()

    import pytest  # noqa: F401 - warm imports before the first test
    import torch.distributed  # noqa: F401

    import parallelctx  # noqa: F401

    sock = socket.create_connection(("127.0.0.1", control_port), timeout=60)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send(("hello", os.environ.get("PARALLELCTX_POOL_TOKEN", ""), rank, os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return 1
        if message[0] == "exit":
            return 0
        if message[0] == "run":
            conn.send(("result", run_test(message[1], rank, world_size)))
            _RELEASE_LATER.clear()


if __name__ == "__main__":
    sys.exit(main())
