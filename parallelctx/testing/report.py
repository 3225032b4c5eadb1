"""Turn a :class:`~parallelctx.testing.pool.RunOutcome` into pytest's verdict: pass, skip, xfail, or
a failure whose report names the failing ranks and shows each distinct traceback once."""

from __future__ import annotations

import importlib
import re
from typing import Any, NoReturn

import pytest
from _pytest.outcomes import Failed

from .pool import RunOutcome

__all__ = ["RankFailure", "format_ranks", "raise_for"]


class RankFailure(Failed):
    """A parallel test failed on some ranks. The message is the whole report; the class is made
    a subclass of the ranks' own exception type where it can be (so ``xfail(raises=...)``
    matches)."""

    __module__ = "builtins"  # pytest's own outcomes do this: reports say "RankFailure: ..."


def format_ranks(ranks: list[int] | set[int] | tuple[int, ...]) -> str:
    """``[1]`` -> ``'rank 1'``, ``[0, 2]`` -> ``'ranks 0, 2'``.

    Returns:
        The phrase.
    """
    ordered = sorted(ranks)
    return f"rank {ordered[0]}" if len(ordered) == 1 else "ranks " + ", ".join(str(r) for r in ordered)


def _group(texts: dict[int, str]) -> list[tuple[list[int], str]]:
    """Ranks with the same text together, in order of the first rank."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(texts):
        groups.setdefault(texts[rank], []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


def _failure_class(exc_types: set[tuple[str, str] | None]) -> type[RankFailure]:
    """RankFailure, mixed with the failing ranks' exception type when they all share one."""
    if len(exc_types) != 1:
        return RankFailure
    found = next(iter(exc_types))
    if found is None:
        return RankFailure
    module, qualname = found
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, type) or not issubclass(obj, BaseException) or issubclass(obj, Failed):
            return RankFailure
        return type("RankFailure", (RankFailure, obj), {"__module__": "builtins"})
    except Exception:
        return RankFailure


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 200 else line[:197] + "..."


def _normalise_stack(text: str) -> str:
    return re.sub(r"Thread 0x[0-9a-f]+", "Thread", text)


def build_report(outcome: RunOutcome, timeout: float, layout: str | None) -> str:
    """The failure text: one summary line, then each distinct traceback once with the ranks it
    came from, how dead ranks ended, and the stacks of ranks that did not finish.

    Returns:
        The report (empty when nothing failed).
    """
    world = outcome.world_size
    failed = {r: res for r, res in outcome.results.items() if res["outcome"] == "failed"}
    passed = [r for r, res in outcome.results.items() if res["outcome"] == "passed"]
    head: list[str] = []
    where = f" (layout {layout})" if layout else ""
    if failed:
        first = failed[min(failed)]
        phase = {
            "import": " importing the test module",
            "launch": " launching gpc",
            "teardown": " in gpc.destroy()",
        }.get(first["phase"], "")
        head.append(
            f"{format_ranks(list(failed))} of {world} failed{phase}{where}: {_first_line(first['message'])}"
        )
    if outcome.dead:
        how = "; ".join(f"rank {r} {d}" for r, d in sorted(outcome.dead.items()))
        head.append(f"{format_ranks(list(outcome.dead))} of {world} died during the test ({how})")
    if outcome.hung:
        if outcome.timed_out:
            head.append(
                f"timed out after {timeout:g} s{where}: {format_ranks(outcome.hung)} of {world} did not "
                "finish; each one's Python stack is below"
            )
        else:
            head.append(
                f"{format_ranks(outcome.hung)} of {world} were still running after the others failed "
                "or died; each one's Python stack is below"
            )
    if not head:
        return ""
    if passed:
        head.append(f"({format_ranks(passed)} passed)")
    if outcome.dead or outcome.hung:
        head.append("(the pool of processes was replaced; the next test runs on fresh ones)")
    body = [" ".join(head[:1]), *head[1:]]
    for ranks, text in _group({r: res["longrepr"] or res["message"] for r, res in failed.items()}):
        body.append("")
        body.append(f"{'_' * 20} {format_ranks(ranks)} {'_' * 20}")
        body.append(text.rstrip())
    stacks = {r: outcome.stacks.get(r, "") for r in outcome.hung}
    for ranks, text in _group({r: _normalise_stack(s) for r, s in stacks.items()}):
        body.append("")
        body.append(f"{'_' * 20} stack of {format_ranks(ranks)} {'_' * 20}")
        body.append(text.rstrip())
    return "\n".join(body)


def raise_for(outcome: RunOutcome, timeout: float, layout: str | None = None) -> None:
    """Give pytest the test's verdict.

    Returns:
        None when every rank passed.

    Raises:
        RankFailure: a rank failed, died or hung (see :func:`build_report`).
        pytest.xfail.Exception: a rank called ``pytest.xfail()`` and none failed.
        pytest.skip.Exception: a rank called ``pytest.skip()`` and none failed or xfailed.
    """
    report = build_report(outcome, timeout, layout)
    if report:
        failed = [res for res in outcome.results.values() if res["outcome"] == "failed"]
        cls = (
            _failure_class({res["exc_type"] for res in failed})
            if failed and not outcome.dead and not outcome.hung
            else RankFailure
        )
        _raise(cls, report)
    for kind in ("xfailed", "skipped"):
        ranks = {r: res["message"] for r, res in outcome.results.items() if res["outcome"] == kind}
        if ranks:
            messages = _group(ranks)
            text = (
                messages[0][1]
                if len(messages) == 1
                else "; ".join(f"{format_ranks(rs)}: {m}" for rs, m in messages)
            )
            if kind == "xfailed":
                pytest.xfail(text)
            raise pytest.skip.Exception(text, _use_item_location=True)


def _raise(cls: type[RankFailure], report: str) -> NoReturn:
    try:
        exc = cls(report, pytrace=False)
    except Exception:
        exc = RankFailure(report, pytrace=False)
    raise exc
