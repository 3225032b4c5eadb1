"""Turn a :class:`~parallelctx.testing.pool.RunOutcome` into pytest's verdict: pass, skip, xfail, or
a failure whose headline is the root cause (the earliest rank that failed, skipped or died, not
a peer's lost connection) and that shows each distinct traceback once."""

from __future__ import annotations

import importlib
import re
from typing import Any, NoReturn

import pytest
from _pytest.outcomes import Failed

from .pool import FAILURE_GRACE_S, RunOutcome

__all__ = ["RankFailure", "build_report", "format_ranks", "raise_for", "root_cause", "unbalanced_report"]


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


def _group(texts: dict[int, str], key: Any = None) -> list[tuple[list[int], str]]:
    """Ranks with the same text (or the same ``key(text)``) together, in order of the first
    rank; each group shows its first rank's text."""
    groups: dict[str, tuple[list[int], str]] = {}
    for rank in sorted(texts):
        text = texts[rank]
        groups.setdefault(key(text) if key else text, ([], text))[0].append(rank)
    return list(groups.values())


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


_HARNESS_FRAME = re.compile(r'_pytest[/\\]python\.py", line \d+ in pytest_pyfunc_call')


def _normalise_stack(text: str) -> str:
    """Thread ids dropped (so equal stacks group), and each thread's frames cut below the test
    function: pytest's, pluggy's and the pool's own frames say nothing about the hang."""
    lines: list[str] = []
    cutting = False
    for line in re.sub(r"([Tt]hread) 0x[0-9a-f]+", r"\1", text).splitlines():
        if not line.startswith("  "):
            cutting = False  # the next thread's header
        elif _HARNESS_FRAME.search(line):
            cutting = True
            lines.append("  (pytest's and the pool's frames below are cut)")
        if not cutting:
            lines.append(line)
    return "\n".join(lines)


def root_cause(outcome: RunOutcome) -> tuple[str, int] | None:
    """The event that decides the verdict: the earliest rank that failed or died; when no rank
    did, the earliest that skipped or called ``pytest.xfail()``. A failure beats a skip on
    another rank whenever it happened. A failure that only says a peer's connection closed (a
    consequence of another rank's skip, failure or death) counts only when nothing else
    happened.

    Returns:
        ``(kind, rank)`` with kind ``failed``, ``skipped``, ``xfailed`` or ``died``; None when no
        rank did any of these (all passed, or some hung).
    """
    events: list[tuple[int, float, int, str]] = []
    tier = {"failed": 0, "died": 0, "skipped": 1, "xfailed": 1}
    for rank, res in outcome.results.items():
        if res["outcome"] != "passed":
            level = 2 if res.get("peer_loss") else tier.get(res["outcome"], 0)
            events.append((level, float(res.get("time", 0.0)), rank, res["outcome"]))
    for rank in outcome.dead:
        events.append((0, outcome.dead_at.get(rank, float("inf")), rank, "died"))
    if not events:
        return None
    _, _, rank, kind = min(events)
    return kind, rank


_VARYING = re.compile(r"0x[0-9a-fA-F]+|(?<=\]:)\d+")


def _same_kind(text: str) -> str:
    """``text`` with what differs between ranks for the same error (object addresses, port
    numbers) masked, to group the ranks' messages."""
    return _VARYING.sub("…", text)


def _others(outcome: RunOutcome, skip: set[int]) -> list[str]:
    """One phrase per group of ranks (not in ``skip``) that failed, skipped or died."""
    world = outcome.world_size
    parts: list[str] = []
    for kind, verb in (("failed", "failed"), ("skipped", "skipped"), ("xfailed", "called pytest.xfail()")):
        texts = {
            r: _first_line(res["message"])
            for r, res in outcome.results.items()
            if res["outcome"] == kind and r not in skip
        }
        for ranks, text in _group(texts, _same_kind):
            parts.append(f"{format_ranks(ranks)} of {world} {verb}: {text}")
    dead = {r: d for r, d in outcome.dead.items() if r not in skip}
    if dead:
        how = "; ".join(f"rank {r} {d}" for r, d in sorted(dead.items()))
        parts.append(f"{format_ranks(list(dead))} of {world} died during the test ({how})")
    return parts


def build_report(outcome: RunOutcome, timeout: float, layout: str | None) -> str:
    """The failure text: a headline with the root cause (:func:`root_cause`), then what the other
    ranks did, each distinct traceback once with the ranks it came from (the root cause's
    first), and the stacks of ranks that did not finish.

    Returns:
        The report (empty when the test did not fail: every rank passed and left every process
        group balanced, or the root cause is a skip or an xfail).
    """
    world = outcome.world_size
    cause = root_cause(outcome)
    if cause is not None and cause[0] in ("skipped", "xfailed"):
        return ""
    if cause is None and not outcome.hung:
        return unbalanced_report(outcome, layout)
    failed = {r: res for r, res in outcome.results.items() if res["outcome"] == "failed"}
    passed = [r for r, res in outcome.results.items() if res["outcome"] == "passed"]
    where = f" (layout {layout})" if layout else ""
    head: list[str] = []
    lead: set[int] = set()
    if cause is not None and cause[0] == "failed":
        first = failed[cause[1]]
        lead = {r for r, res in failed.items() if res["message"] == first["message"]}
        phase = {"setup": " in setup (gpc launch or a fixture)", "teardown": " in teardown"}.get(
            first["phase"], ""
        )
        head.append(
            f"{format_ranks(list(lead))} of {world} failed{phase}{where}: {_first_line(first['message'])}"
        )
    elif cause is not None:  # died
        lead = {cause[1]}
        head.append(
            f"rank {cause[1]} of {world} died during the test{where} (rank {cause[1]} {outcome.dead[cause[1]]})"
        )
    if lead:
        head.extend(f"then {part}" for part in _others(outcome, lead))
    if outcome.hung:
        if outcome.timed_out:
            head.append(
                f"timed out after {timeout:g} s{where}: {format_ranks(outcome.hung)} of {world} did not "
                "finish; each one's Python stack is below"
            )
        else:
            head.append(
                f"{format_ranks(outcome.hung)} of {world} were still running {FAILURE_GRACE_S:g} s after "
                "that and were stopped; each one's Python stack is below"
            )
    if passed:
        head.append(f"({format_ranks(passed)} passed)")
    if outcome.broken:
        head.append("(the pool of processes was replaced; the next test runs on fresh ones)")
    body = list(head)
    # a peer's lost connection is summed up in one line above; its traceback says nothing more
    texts = {
        r: res["longrepr"] or res["message"]
        for r, res in failed.items()
        if r in lead or not res.get("peer_loss")
    }
    ordered = sorted(_group(texts, _same_kind), key=lambda group: not (set(group[0]) & lead))
    for ranks, text in ordered:
        body.append("")
        body.append(f"{'_' * 20} {format_ranks(ranks)} {'_' * 20}")
        body.append(text.rstrip())
    stacks = {r: outcome.stacks.get(r, "") for r in outcome.hung}
    for ranks, text in _group({r: _normalise_stack(s) for r, s in stacks.items()}):
        body.append("")
        body.append(f"{'_' * 20} stack of {format_ranks(ranks)} {'_' * 20}")
        body.append(text.rstrip())
    return "\n".join(body)


def unbalanced_report(outcome: RunOutcome, layout: str | None) -> str:
    """The failure text of a test that passed on every rank but left calls on a process group
    that its other members did not match (:attr:`RunOutcome.unbalanced`).

    Returns:
        The report: each unbalanced group with its ranks and their counts, and the fix; empty
        when no group was left unbalanced.
    """
    if not outcome.unbalanced:
        return ""
    where = f" (layout {layout})" if layout else ""
    lines = [
        f"every rank passed, but the test left calls unmatched on "
        f"{'a process group' if len(outcome.unbalanced) == 1 else 'process groups'}{where}: the next "
        "test's calls there would pair with them (a wrong result or a hang in a correct test)",
        *(f"  {problem}" for problem in outcome.unbalanced),
        "Have every member of a group make the same collectives, wait for each async_op=True "
        "call (work.wait()) and receive every tensor sent, before the test ends.",
        "(every rank's session process was ended, its gpc aborted: the next test runs on fresh ones)",
    ]
    return "\n".join(lines)


def _partial(outcome: RunOutcome, kind: str, rank: int) -> str:
    """The reason of a skip or an xfail: the message alone when every rank gave the same one,
    else which rank did it first and what the others did."""
    world = outcome.world_size
    message = outcome.results[rank]["message"]
    same = [r for r, res in outcome.results.items() if res["outcome"] == kind and res["message"] == message]
    if len(same) == world:
        return message
    verb = "skipped" if kind == "skipped" else "called pytest.xfail()"
    text = f"{format_ranks(same)} of {world} {verb}: {message}"
    others = _others(outcome, set(same))
    if outcome.hung:
        others.append(f"{format_ranks(outcome.hung)} stopped")
    passed = [r for r, res in outcome.results.items() if res["outcome"] == "passed"]
    if passed:
        others.append(f"{format_ranks(passed)} passed")
    return text + (f" (then {'; '.join(others)})" if others else "")


def raise_for(outcome: RunOutcome, timeout: float, layout: str | None = None) -> None:
    """Give pytest the test's verdict, decided by the root cause (:func:`root_cause`).

    Returns:
        None when every rank passed.

    Raises:
        RankFailure: the earliest event is a failure or a death, ranks hung, or every rank
            passed but left a process group unbalanced (see :func:`build_report`).
        pytest.skip.Exception: the earliest event is a ``pytest.skip()`` (on one rank or all;
            the reason names the rank when not all skipped alike).
        pytest.xfail.Exception: the earliest event is a ``pytest.xfail()``.
    """
    report = build_report(outcome, timeout, layout)
    cause = root_cause(outcome)
    if report:
        lead = {
            res["exc_type"]
            for res in outcome.results.values()
            if cause is not None
            and cause[0] == "failed"
            and res["outcome"] == "failed"
            and res["message"] == outcome.results[cause[1]]["message"]
        }
        _raise(_failure_class(lead) if lead else RankFailure, report)
    if cause is None:
        return
    kind, rank = cause
    if kind == "xfailed":
        pytest.xfail(_partial(outcome, kind, rank))
    raise pytest.skip.Exception(_partial(outcome, kind, rank), _use_item_location=True)


def _raise(cls: type[RankFailure], report: str) -> NoReturn:
    try:
        exc = cls(report, pytrace=False)
    except Exception:
        exc = RankFailure(report, pytrace=False)
    raise exc
