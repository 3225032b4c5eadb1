"""Which owned section a top-level entry of a config was meant to be: :func:`misplaced_section`
decides by the entry's name *and* its content, so that ``parallelism = dict(tensor=2,
pipeline=2)`` (torchtitan's name for the section) is refused instead of running at tensor 1,
while ``seeds = [1, 2, 3]`` or ``model = dict(tensor_dim=64)`` stay the user's own.

``user_sections = ["name", ...]`` at the top level of a config lists entries that are the
user's own even when they look like a misplaced section (:func:`user_sections`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..planning.layout import LayoutError, parse_order
from .errors import OWNED_SECTIONS, ConfigError, _shown, near_miss_section
from .values import _as_int, _closest

__all__ = [
    "DIST_KEYS",
    "PARALLEL_KEYS",
    "USER_SECTIONS",
    "Misplaced",
    "misplaced_section",
    "user_sections",
]

#: The keys of the ``parallel`` section (``ParallelConfig``'s fields; a test keeps them equal).
PARALLEL_KEYS = ("tensor", "pipeline", "context", "expert", "data", "order", "gtp_remat", "reform")
#: The keys of the ``dist`` section (``DistConfig``'s fields).
DIST_KEYS = ("backend", "timeout", "init_method", "gloo_lazy_init", "hang_report")
#: The top-level key that lists the user's own entries, which are never refused as misplaced.
USER_SECTIONS = "user_sections"

#: Words that make a name refer to the parallel setup (``model_parallel``, ``parallelism``,
#: ``distributed``, ``ParallelConfig``): one key of an owned section under such a name is enough.
_SETUP_WORDS = frozenset({"parallel", "parallelism", "parallelization", "parallelize", "dist", "distributed"})
_BACKENDS = frozenset({"auto", "nccl", "gloo", "mpi", "ucc", "xccl", "hccl", "fake", "cncl"})
_KEYS = {"parallel": PARALLEL_KEYS, "dist": DIST_KEYS}


def _is_axis(value: Any, *keys: str) -> bool:
    """An axis size as the ``parallel`` section takes it: an int, or a dict with ``size``."""
    if _as_int(value) is not None:
        return True
    return isinstance(value, Mapping) and any(k in value for k in ("size", *keys))


def _is_order(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        parse_order(value)
    except LayoutError:
        return False
    return True


def _is_backend(value: Any) -> bool:
    """A torch.distributed backend (``"nccl"``, ``"cpu:gloo,cuda:nccl"``), not ``"inductor"``."""
    return isinstance(value, str) and any(
        part.strip().lower() in _BACKENDS for part in re.split(r"[,:]", value) if part.strip()
    )


def _is_seconds(value: Any) -> bool:
    return isinstance(value, timedelta) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    )


def _fits(section: str, key: str, value: Any) -> bool:
    """Whether ``value`` is what ``section``'s ``key`` takes (its shape, not its range): a
    ``dict(timeout=30)`` of a data loader is not told from ``dist``'s by shape, but a
    ``dict(backend="inductor")`` of ``torch.compile`` is."""
    if section == "parallel":
        if key in ("tensor", "pipeline", "context", "gtp_remat"):
            return _is_axis(value)
        if key == "expert":
            return _is_axis(value, "tensor")
        if key == "data":
            return _as_int(value) is not None or (
                isinstance(value, Mapping) and bool(value) and set(value) <= {"size", "replicate", "shard"}
            )
        if key == "reform":
            return value in ("data", "replicate", "off")
        return key == "order" and _is_order(value)
    if key == "backend":
        return _is_backend(value)
    if key == "timeout":
        return _is_seconds(value)
    if key == "init_method":
        return isinstance(value, str) and value.startswith(("tcp://", "env://", "file://"))
    if key == "gloo_lazy_init":
        return isinstance(value, bool)
    return key == "hang_report" and isinstance(value, Mapping) and "after" in value


def _is_seed(value: Any) -> bool:
    """A value the ``seed`` could have been given as: a number or a string of digits (not a
    bool, a list, a dict)."""
    if isinstance(value, bool):
        return False
    if _as_int(value) is not None or isinstance(value, float):
        return True
    return isinstance(value, str) and value.strip().isdigit()


def _words(name: str) -> set[str]:
    """``model_parallel`` -> {model, parallel}; ``ParallelConfig`` -> {parallel, config}."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return {w for w in re.split(r"[^A-Za-z]+", spaced.lower()) if w}


@dataclass(frozen=True)
class Misplaced:
    """A top-level entry that holds what an owned section would, under another name.

    ``section`` is the owned section it was meant to be; ``found`` maps each owned section to
    its keys found in the entry (empty for a near miss by name, such as ``paralel`` or
    ``Seed = 3``); ``by_name`` is True when the name itself misspells ``section``.
    """

    name: str
    value: Any
    section: str
    found: tuple[tuple[str, tuple[str, ...]], ...] = ()
    by_name: bool = False

    def message(self, present: frozenset[str] | set[str] = frozenset()) -> str:
        """The refusal's text: the entry, the section meant, the fix and the override;
        ``present`` are the owned sections the config has (the fix then says to move the keys
        into that section rather than to rename the entry).

        Returns:
            The message (led by ``config:``).
        """
        override = (
            f"if {self.name!r} is an entry of your own, rename it or list it in "
            f"{USER_SECTIONS} = [{self.name!r}]"
        )
        if self.found and not self.by_name:
            items = self.value if isinstance(self.value, Mapping) else {}
            parts = [
                f"{section}'s key{'s' if len(keys) > 1 else ''} "
                + ", ".join(f"{k}={_shown(items.get(k), 30)}" for k in keys)
                for section, keys in self.found
            ]
            sections = [section for section, _ in self.found]
            where = " and ".join(repr(s) for s in sections)
            many = sum(len(keys) for _, keys in self.found) > 1
            if len(sections) == 1 and sections[0] not in present:
                fix = f"rename the section to {sections[0]!r}"
            else:
                fix = f"move {'them' if many else 'it'} into {where}"
            return (
                f"config: section {self.name!r} holds {' and '.join(parts)}, which parallelctx reads only "
                f"from {where}: here {'they' if many else 'it'} would be ignored without a word; "
                f"{fix} ({override})"
            )
        shown = "" if isinstance(self.value, Mapping) else f" = {_shown(self.value)}"
        constant = (
            f"; a constant in capitals is kept beside its section ({self.section} = {self.name})"
            if self.name == self.section.upper()
            else ""
        )
        return (
            f"config: top-level section {_shown(self.name)}{shown} is not read by parallelctx; did you mean "
            f"{self.section!r}? (a name this close to {self.section} holding what {self.section} takes is "
            f"refused, so that a typo cannot run the job with the defaults; {override}{constant})"
        )


def misplaced_section(name: Any, value: Any) -> Misplaced | None:
    """Return the owned section that the top-level entry ``name = value`` was meant to be, or
    None for an entry of the user's own.

    An entry is misplaced when:

    * **its content** is an owned section's: a mapping with at least two keys of ``parallel``
      and ``dist``, each with a value of that key's shape, that make up at least half of its
      keys (``foo = dict(tensor=2, pipeline=2)``); under a name that refers to the parallel
      setup (a word ``parallel``, ``parallelism``, ``dist``, ``distributed``:
      ``model_parallel``, ``parallel_config``), one such key is enough;
    * or **its name** misspells an owned section (:func:`near_miss_section`) and it holds what
      that section would: for ``parallel``, any non-empty mapping; for ``dist``, a mapping with
      a ``dist`` key or one close to it (``timout``); for ``seed``, a number or a string of
      digits (``Seed = 3``; ``seeds = [1, 2, 3]`` is the user's).

    Shapes are loose on purpose (``tensor=0`` has the shape of a size): the owned section's own
    validation says what is wrong with a value once it is in the right place.

    Returns:
        A :class:`Misplaced` (its :meth:`~Misplaced.message` is the refusal), or None.
    """
    if not isinstance(name, str) or name in OWNED_SECTIONS or name == USER_SECTIONS:
        return None
    by_name = near_miss_section(name)
    if isinstance(value, Mapping) and value:
        found = tuple(
            (section, tuple(k for k in value if k in keys and _fits(section, k, value[k])))
            for section, keys in _KEYS.items()
        )
        found = tuple((section, keys) for section, keys in found if keys)
        sections = [section for section, _ in found]
        if (by_name == "parallel" or (by_name == "dist" and any(_near_key(k) for k in value))) and (
            not found or by_name in sections
        ):
            return Misplaced(name, value, by_name, found, by_name=True)
        total = sum(len(keys) for _, keys in found)
        named = by_name in ("parallel", "dist") or bool(_words(name) & _SETUP_WORDS)
        if found and (named or (total >= 2 and 2 * total >= len(value))):
            main = max(found, key=lambda entry: len(entry[1]))[0]
            return Misplaced(name, value, main, found)
        return None
    if by_name == "seed" and _is_seed(value):
        return Misplaced(name, value, "seed", by_name=True)
    return None


def _near_key(key: Any) -> bool:
    """A key of ``dist`` or one close to it (``timout``)."""
    return key in DIST_KEYS or _closest(key, DIST_KEYS) is not None


def user_sections(data: Mapping[str, Any]) -> frozenset[str]:
    """The names a config's top-level ``user_sections`` lists (empty when it has none).

    Returns:
        The names.

    Raises:
        ConfigError: ``user_sections`` is not a list of names, or lists an owned section.
    """
    listed = data.get(USER_SECTIONS)
    if listed is None:
        return frozenset()
    if isinstance(listed, str) or not isinstance(listed, (list, tuple)):
        raise ConfigError(
            f"config: {USER_SECTIONS}={_shown(listed)} must be a list of top-level names of your own, "
            f"e.g. {USER_SECTIONS} = ['seeds']"
        )
    bad = [n for n in listed if not isinstance(n, str)]
    if bad:
        raise ConfigError(
            f"config: {USER_SECTIONS} lists {_shown(bad)}, which are not names; list names as strings"
        )
    owned = [n for n in listed if n in OWNED_SECTIONS]
    if owned:
        raise ConfigError(
            f"config: {USER_SECTIONS} lists {', '.join(owned)}, which parallelctx reads itself; "
            f"list only entries of your own"
        )
    return frozenset(listed)
