"""Slurm's compressed host lists and task counts, parsed in Python (no ``scontrol`` needed).

* :func:`expand_hostlist` turns ``"node[001-003,010],gpu-a[1-2]b[0-1]"`` into the host names,
  in Slurm's order (left to right; within one name the last bracket group varies fastest),
  with Slurm's zero padding (the width of a range's lower bound: ``[08-10]`` -> 08, 09, 10).
  It gives what ``scontrol show hostnames`` gives for every list Slurm accepts, and also
  accepts text after the last bracket (``node[1-2]-ib``), which Slurm 22.05 rejects.
* :func:`first_host` returns the first of them without expanding the rest.
* :func:`expand_tasks_per_node` turns ``"2(x3),1"`` (``SLURM_TASKS_PER_NODE``) into ``[2, 2, 2, 1]``.

Nothing here imports torch.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

__all__ = ["HostlistError", "expand_hostlist", "expand_tasks_per_node", "first_host", "iter_hostlist"]

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class HostlistError(ValueError):
    """A host list or task count that does not follow Slurm's syntax; the message names it."""


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` at the commas that lie outside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise HostlistError(f"host list {text!r}: nested '[' at position {i}")
            depth = 1
        elif char == "]":
            if not depth:
                raise HostlistError(f"host list {text!r}: ']' without '[' at position {i}")
            depth = 0
        elif char == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"host list {text!r}: '[' is never closed")
    parts.append(text[start:])
    return parts


def _ranges(body: str, whole: str) -> list[tuple[str, str | None]]:
    """Check the inside of one bracket group and return its (low, high or None) items."""
    items: list[tuple[str, str | None]] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise HostlistError(
                f"host list {whole!r}: {item!r} in [{body}] is not a number or a range like 1-4"
            )
        lo_text, hi_text = match.group(1), match.group(2)
        if hi_text is not None and int(hi_text) < int(lo_text):
            raise HostlistError(f"host list {whole!r}: range {item!r} runs backwards; write {hi_text}-{lo_text}")
        items.append((lo_text, hi_text))
    return items


def _expand_range(body: str, whole: str) -> list[str]:
    """Expand the inside of one bracket group, e.g. ``001-003,010`` (zero padding kept)."""
    out: list[str] = []
    for lo_text, hi_text in _ranges(body, whole):
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        width = len(lo_text)  # Slurm pads to the width of the lower bound: 08-10 -> 08, 09, 10
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_name(name: str, whole: str) -> Iterator[str]:
    """Expand one comma-free host expression such as ``rack[1-2]-n[01-04]``."""
    pieces: list[list[str]] = []
    pos = 0
    for match in re.finditer(r"\[([^\]]*)\]", name):
        pieces.append([name[pos : match.start()]])
        if not match.group(1).strip():
            raise HostlistError(f"host list {whole!r}: empty brackets in {name!r}")
        pieces.append(_expand_range(match.group(1), whole))
        pos = match.end()
    pieces.append([name[pos:]])
    for combo in itertools.product(*pieces):
        yield "".join(combo)


def _validate(hostlist: str) -> list[str]:
    """Check the whole list without expanding it; return its top-level entries."""
    text = hostlist.strip()
    if not text or text == "(null)":
        raise HostlistError(f"host list {hostlist!r} is empty; expected e.g. 'node[01-04]'")
    parts = [part.strip() for part in _split_top_level(text)]
    parts = [part for part in parts if part]  # Slurm skips empty entries: "a,,b" is a, b
    if not parts:
        raise HostlistError(f"host list {hostlist!r} names no host; expected e.g. 'node[01-04]'")
    for part in parts:
        for match in re.finditer(r"\[([^\]]*)\]", part):
            if not match.group(1).strip():
                raise HostlistError(f"host list {hostlist!r}: empty brackets in {part!r}")
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


def expand_hostlist(hostlist: str) -> list[str]:
    """Return every host name of a Slurm host list, e.g. ``"n[1-2],gpu01"`` -> ``["n1", "n2", "gpu01"]``.

    Raises:
        HostlistError: the list is empty or malformed; see :func:`iter_hostlist`.
    """
    return list(iter_hostlist(hostlist))


def first_host(hostlist: str) -> str:
    """Return the first host name of a Slurm host list without expanding the rest.

    Raises:
        HostlistError: the list is empty or malformed (the whole list is checked).
    """
    return next(_expand_name(_validate(hostlist)[0], hostlist))


def expand_tasks_per_node(counts: str) -> list[int]:
    """Return the per-node task counts of Slurm's compressed form: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    This is the form of ``SLURM_TASKS_PER_NODE``, ``SLURM_STEP_TASKS_PER_NODE`` and
    ``SLURM_JOB_CPUS_PER_NODE``.

    Raises:
        HostlistError: an entry is neither ``N`` nor ``N(xK)``; the message quotes it.
    """
    out: list[int] = []
    for item in counts.split(","):
        match = _COUNT.match(item.strip())
        if not match:
            raise HostlistError(f"task count list {counts!r}: {item!r} is neither 'N' nor 'N(xK)'")
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out
