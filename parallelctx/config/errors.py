"""The config's errors and their wording: :class:`ConfigError`, :class:`ConfigValidationError`
(pydantic's ``ValidationError`` worded for a person, by :func:`validation_error`) and
:func:`near_miss_section` (a top-level name that misspells an owned section).

The bottom of the package: it imports nothing of it, so every other file can raise these.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

__all__ = [
    "OWNED_SECTIONS",
    "ConfigError",
    "ConfigValidationError",
    "near_miss_section",
    "validation_error",
]


class ConfigError(ValueError):
    """A config that cannot be read: a missing file, a syntax error, an unsupported source, a
    structure past the limits (too deep, too large, self-referential), a key that would be
    unreachable, or a top-level entry that holds an owned section's content under another name
    (``paralel = dict(tensor=2)``, ``parallelism = dict(tensor=2)``, ``Seed = 3``)."""


OWNED_SECTIONS = ("parallel", "dist", "seed")
"""The top-level sections parallelctx validates; every other section is the user's."""


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened to about ``limit`` characters for messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ConfigValidationError(ConfigError, ValidationError):
    """A bad value in an owned section (``parallel``, ``dist``, ``seed``), worded for a person.

    It is both a :class:`ConfigError` and pydantic's ``ValidationError`` (so ``except
    ValidationError`` and ``.errors()`` keep working), and a ``ValueError``. ``str()`` gives
    only the messages, one line per mistake, each led by the key path
    (``parallel.tensor.size=True is of type bool...``), and the file when the config came from
    one: none of pydantic's ``validation error for`` header, model names, ``type=`` or
    ``input_value=`` dumps. Made by :func:`validation_error`.
    """

    source: str | None = None

    def __str__(self) -> str:
        lines = [_error_line(error) for error in self.errors(include_url=False)]
        where = f"{self.source}: " if self.source else ""
        if len(lines) == 1:
            return where + lines[0]
        return f"{where}{len(lines)} problems in the config:\n" + "\n".join(f"  {line}" for line in lines)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # pydantic's own reduce drops the subclass state and keeps the raw inputs (which need
        # not pickle): rebuild from the finished text instead.
        return (_rebuild_validation_error, (str(self),))


def _rebuild_validation_error(text: str) -> ConfigValidationError:
    error = ConfigValidationError.from_exception_data(
        "config", [{"type": "value_error", "loc": (), "input": None, "ctx": {"error": ValueError(text)}}]
    )
    return error


def _loc_text(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _error_line(error: Mapping[str, Any]) -> str:
    """One pydantic error as one sentence led by its key path (``parallel.tensor.size=...``)."""
    path = _loc_text(tuple(error.get("loc", ())))
    ctx = error.get("ctx") or {}
    if error.get("type") in ("value_error", "assertion_error") and "error" in ctx:
        message = str(ctx["error"])
    else:  # pydantic's own wording ("Input should be 'auto', 'nccl' or 'gloo'"): add the value
        message = f"{error.get('msg', 'invalid value')} (got {_shown(error.get('input'))})"
    if not path or message.startswith(path):
        return message
    last = path.rsplit(".", 1)[-1]
    if message.startswith(last + "="):  # "size=True is ..." under parallel.tensor.size
        return path[: len(path) - len(last)] + message
    return f"{path}: {message}"


def validation_error(
    exc: ValidationError, source: str | Path | None = None, section: str | None = None
) -> ConfigValidationError:
    """Return pydantic's ``exc`` as a :class:`ConfigValidationError` (the same errors, worded
    for a person), naming ``source`` (a file) when given; ``section`` leads every key path (for
    a section validated alone: ``"parallel"``). Raise the result ``from None``."""
    if isinstance(exc, ConfigValidationError):
        converted = exc
    else:
        errors = exc.errors(include_url=False)
        if section is not None:
            for error in errors:
                error["loc"] = (section, *error["loc"])
        converted = ConfigValidationError.from_exception_data(exc.title, errors)  # type: ignore[arg-type]
    if source is not None:
        converted.source = str(source)
    return converted


def _near_miss_distance(a: str, b: str) -> int:
    """Edit distance of ``a`` and ``b`` counting insertions, deletions and swaps of neighbours
    as 1 and substitutions as 2 (a substitution is a deletion plus an insertion)."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 2
            row[j] = min(rows[i - 1][j] + 1, row[j - 1] + 1, rows[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[i - 2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def near_miss_section(name: Any) -> str | None:
    """Return the owned section (``parallel``, ``dist``, ``seed``) that the top-level name
    ``name`` most likely misspells, or None for a name of the user's own. The name alone:
    whether a config refuses the entry depends on its value too
    (:func:`parallelctx.config.sections.misplaced_section`: ``seeds = [1, 2]`` is kept).

    A near miss is, ignoring case, the owned name itself written otherwise (``Parallel``,
    ``SEED``) or one edit away: a letter left out (``paralel``, ``sed``, ``dst``), one added
    (``parallell``, ``dist_``, ``seeds``) or two neighbours swapped (``dsit``, ``prallel``:
    swaps of non-neighbours count as two edits). For ``parallel``, long enough that no real
    word lies near it, two such edits or one replaced letter also count (``paralell``,
    ``parralel``, ``parallal``). A replaced letter in the short names is not a near miss,
    because it makes real words (``need``, ``feed``, ``disk``, ``list``), and neither are
    ``data``, ``set``, ``seq``, ``test`` or ``distributed``.

    Returns:
        The owned section's name, or None.
    """
    if not isinstance(name, str) or name in OWNED_SECTIONS:
        return None
    lowered = name.lower()
    for owned in OWNED_SECTIONS:
        limit = 2 if len(owned) >= 6 else 1
        if abs(len(lowered) - len(owned)) <= limit and _near_miss_distance(lowered, owned) <= limit:
            return owned
    return None
