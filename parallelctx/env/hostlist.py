"""Slurm's compressed host lists and task counts, parsed in Python (no ``scontrol`` needed).

* :func:`expand_hostlist` turns ``"node[001-003,010],gpu-a[1-2]b[0-1]"`` into the host names,
  in Slurm's order (left to right; within one name the last bracket group varies fastest),
  with Slurm's zero padding (the width of a range's lower bound: ``[08-10]`` -> 08, 09, 10).
  It gives what ``scontrol show hostnames`` gives for every list Slurm accepts, and also
  accepts text after the last bracket (``node[1-2]-ib``), which Slurm 22.05 rejects.
* :func:`first_host` returns the first of them without expanding the rest, and
  :func:`count_hostlist` counts them without expanding any; :func:`expand_hostlist` refuses lists
  of more than :data:`~parallelctx.limits.MAX_HOSTS` names instead of filling the memory.
* :func:`expand_tasks_per_node` turns ``"2(x3),1"`` (``SLURM_TASKS_PER_NODE``) into ``[2, 2, 2, 1]``;
  :func:`tasks_on_node` picks one node's count without expanding the list.

Nothing here imports torch.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator

from ..planning.limits import MAX_HOSTS

__all__ = [
    "HostlistError",
    "count_hostlist",
    "expand_hostlist",
    "expand_tasks_per_node",
    "first_host",
    "iter_hostlist",
    "tasks_on_node",
]

_MAX_DIGITS = 18  # host numbers and task counts longer than this are refused (no int overflow anywhere)
_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
_COUNT = re.compile(r"^([0-9]+)(?:\(x([0-9]+)\))?$")


class HostlistError(ValueError):
    """A host list or task count that does not follow Slurm's syntax; the message names it."""


def _shown(text: str, limit: int = 60) -> str:
    """``repr(text)``, shortened to about ``limit`` characters for messages."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` at the commas that lie outside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise HostlistError(f"host list {_shown(text)}: nested '[' at position {i}")
            depth = 1
        elif char == "]":
            if not depth:
                raise HostlistError(f"host list {_shown(text)}: ']' without '[' at position {i}")
            depth = 0
        elif char == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"host list {_shown(text)}: '[' is never closed")
    parts.append(text[start:])
    return parts


def _ranges(body: str, whole: str) -> list[tuple[str, str | None]]:
    """Check the inside of one bracket group and return its (low, high or None) items."""
    items: list[tuple[str, str | None]] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise HostlistError(
                f"host list {_shown(whole)}: {_shown(item)} in [{_shown(body)[1:-1]}] is not a number or a "
                "range like 1-4"
            )
        lo_text, hi_text = match.group(1), match.group(2)
        if max(len(lo_text), len(hi_text or "")) > _MAX_DIGITS:
            raise HostlistError(
                f"host list {_shown(whole)}: {_shown(item.strip())} has a number of more than "
                f"{_MAX_DIGITS} digits; Slurm never writes one"
            )
        if hi_text is not None and int(hi_text) < int(lo_text):
            raise HostlistError(
                f"host list {_shown(whole)}: range {_shown(item)} runs backwards; write {hi_text}-{lo_text}"
            )
        items.append((lo_text, hi_text))
    return items


def _iter_range(body: str, whole: str) -> Iterator[str]:
    """Yield the numbers of one bracket group, e.g. ``001-003,010`` (zero padding kept), lazily."""
    for lo_text, hi_text in _ranges(body, whole):
        if hi_text is None:
            yield lo_text
            continue
        width = len(lo_text)  # Slurm pads to the width of the lower bound: 08-10 -> 08, 09, 10
        for n in range(int(lo_text), int(hi_text) + 1):
            yield str(n).zfill(width)


def _expand_name(name: str, whole: str) -> Iterator[str]:
    """Yield the names of one comma-free host expression such as ``rack[1-2]-n[01-04]``, lazily:
    the last bracket group varies fastest, and nothing is expanded ahead of what is asked for."""
    factories: list[Callable[[], Iterator[str]]] = []
    pos = 0
    for match in re.finditer(r"\[([^\]]*)\]", name):
        if not match.group(1).strip():
            raise HostlistError(f"host list {_shown(whole)}: empty brackets in {_shown(name)}")
        factories.append(functools.partial(iter, (name[pos : match.start()],)))
        factories.append(functools.partial(_iter_range, match.group(1), whole))
        pos = match.end()
    factories.append(functools.partial(iter, (name[pos:],)))
    # An odometer over the groups (itertools.product would materialise every group first).
    iters = [make() for make in factories]
    current = [next(it) for it in iters]  # every group is non-empty (checked by _ranges)
    while True:
        yield "".join(current)
        i = len(iters) - 1
        while i >= 0:
            try:
                current[i] = next(iters[i])
                break
            except StopIteration:
                iters[i] = factories[i]()
                current[i] = next(iters[i])
                i -= 1
        if i < 0:
            return


def _validate(hostlist: str) -> list[str]:
    """Check the whole list without expanding it; return its top-level entries."""
    text = hostlist.strip()
    if not text or text == "(null)":
        raise HostlistError(f"host list {_shown(hostlist)} is empty; expected e.g. 'node[01-04]'")
    parts = [part.strip() for part in _split_top_level(text)]
    parts = [part for part in parts if part]  # Slurm skips empty entries: "a,,b" is a, b
    if not parts:
        raise HostlistError(f"host list {_shown(hostlist)} names no host; expected e.g. 'node[01-04]'")
    for part in parts:
        for match in re.finditer(r"\[([^\]]*)\]", part):
            if not match.group(1).strip():
                raise HostlistError(f"host list {_shown(hostlist)}: empty brackets in {_shown(part)}")
            _ranges(match.group(1), hostlist)
    return parts


def iter_hostlist(hostlist: str) -> Iterator[str]:
    """Yield the host names of a Slurm host list, in order, one at a time.

    Raises:
        HostlistError: the list is empty or malformed (unbalanced or nested brackets, a bad
            range, an empty entry); the message quotes the list and the bad part.
    """
    for part in _validate(hostlist):
        yield from _expand_name(part, hostlist)


def count_hostlist(hostlist: str) -> int:
    """Return how many host names a Slurm host list holds, without expanding it.

    Returns:
        The count (duplicates counted, as :func:`expand_hostlist` lists them).

    Raises:
        HostlistError: the list is empty or malformed; see :func:`iter_hostlist`.
    """
    total = 0
    for part in _validate(hostlist):
        names = 1
        for match in re.finditer(r"\[([^\]]*)\]", part):
            ranges = _ranges(match.group(1), hostlist)
            names *= sum(1 if hi is None else int(hi) - int(lo) + 1 for lo, hi in ranges)
        total += names
    return total


def expand_hostlist(hostlist: str, max_hosts: int = MAX_HOSTS) -> list[str]:
    """Return every host name of a Slurm host list, e.g. ``"n[1-2],gpu01"`` -> ``["n1", "n2", "gpu01"]``.

    The list is counted first (:func:`count_hostlist`), so a list of more than ``max_hosts`` names
    (default :data:`~parallelctx.limits.MAX_HOSTS`, 2**20) is refused before any is made.

    Raises:
        HostlistError: the list is empty or malformed (see :func:`iter_hostlist`), or it names
            more than ``max_hosts`` hosts.
    """
    count = count_hostlist(hostlist)
    if count > max_hosts:
        raise HostlistError(
            f"host list {_shown(hostlist)} names {count} hosts, more than the {max_hosts} parallelctx "
            "expands; "
            "use first_host() or count_hostlist() where the whole list is not needed"
        )
    return list(iter_hostlist(hostlist))


def first_host(hostlist: str) -> str:
    """Return the first host name of a Slurm host list without expanding the rest.

    Raises:
        HostlistError: the list is empty or malformed (the whole list is checked).
    """
    return next(_expand_name(_validate(hostlist)[0], hostlist))


def _count_items(counts: str) -> list[tuple[int, int]]:
    """Parse ``"2(x3),1"`` into ``[(2, 3), (1, 1)]``: (tasks, repeated on this many nodes)."""
    out: list[tuple[int, int]] = []
    for item in counts.split(","):
        match = _COUNT.match(item.strip())
        if not match:
            raise HostlistError(
                f"task count list {_shown(counts)}: {_shown(item)} is neither 'N' nor 'N(xK)'"
            )
        if max(len(match.group(1)), len(match.group(2) or "")) > _MAX_DIGITS:
            raise HostlistError(
                f"task count list {_shown(counts)}: {_shown(item)} has a number of more than "
                f"{_MAX_DIGITS} digits"
            )
        out.append((int(match.group(1)), int(match.group(2) or 1)))
    return out


def expand_tasks_per_node(counts: str, max_nodes: int = MAX_HOSTS) -> list[int]:
    """Return the per-node task counts of Slurm's compressed form: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    This is the form of ``SLURM_TASKS_PER_NODE``, ``SLURM_STEP_TASKS_PER_NODE`` and
    ``SLURM_JOB_CPUS_PER_NODE``.

    Raises:
        HostlistError: an entry is neither ``N`` nor ``N(xK)`` (the message quotes it), or the list
            covers more than ``max_nodes`` nodes (default :data:`~parallelctx.limits.MAX_HOSTS`).
    """
    items = _count_items(counts)
    nodes = math.fsum(repeat for _, repeat in items)
    if nodes > max_nodes:
        raise HostlistError(
            f"task count list {_shown(counts)} covers {int(nodes)} nodes, more than the {max_nodes} "
            "parallelctx expands; use tasks_on_node() for one node's count"
        )
    out: list[int] = []
    for tasks, repeat in items:
        out.extend([tasks] * repeat)
    return out


def tasks_on_node(counts: str, node: int) -> int | None:
    """Return the task count of node ``node`` (0-based) from Slurm's compressed form, without
    expanding it: ``tasks_on_node("2(x3),1", 3) == 1``.

    Returns:
        The count, or None when the list covers fewer than ``node + 1`` nodes.

    Raises:
        HostlistError: an entry is neither ``N`` nor ``N(xK)``; the message quotes it.
    """
    seen = 0
    for tasks, repeat in _count_items(counts):
        if 0 <= node < seen + repeat:
            return tasks
        seen += repeat
    return None
