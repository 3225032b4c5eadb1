"""Labelled sections of benchmarks/RESULTS.md that one benchmark command owns.

A section sits between ``<!-- benchmarks.NAME: start -->`` and ``<!-- benchmarks.NAME: end -->``.
:func:`write_section` replaces a command's section (or appends it), and :func:`kept_sections`
lets ``benchmarks.run`` keep every section when it rewrites the file.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

_SECTION = re.compile(r"<!-- (benchmarks\.[a-z_]+): start -->.*?<!-- \1: end -->", re.S)


def markers(name: str) -> tuple[str, str]:
    """Return the start and end markers of the section of ``benchmarks.<name>``."""
    return f"<!-- benchmarks.{name}: start -->", f"<!-- benchmarks.{name}: end -->"


def write_section(results: Path, name: str, body: str) -> None:
    """Put ``body`` between the markers of ``name`` in ``results``, replacing that section if the
    file has it, else appending it. Creates the file when missing."""
    start, end = markers(name)
    section = f"{start}\n{body.strip()}\n{end}"
    text = results.read_text() if results.is_file() else ""
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    results.write_text(text)


def write_run(results: Path, name: str, heading: str, command: str, about: str, body: str) -> None:
    """Write the section of ``benchmarks.<name>`` (:func:`write_section`): ``heading``, the
    ``command`` that wrote it with the time, the load average after the run and the core count,
    then ``about`` (what was measured) and ``body`` (the table)."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    section = (
        f"## {heading}\n\nWritten by `{command}` on {now} (load average {load} after the run; "
        f"{os.cpu_count()} CPU cores, gloo). {about}\n\n{body}\n"
    )
    write_section(results, name, section)


def kept_sections(text: str) -> list[str]:
    """Return every labelled section of ``text`` (a RESULTS.md), markers included."""
    return [m.group(0) for m in _SECTION.finditer(text)]
