"""Which owned section a top-level entry of a config was meant to be: :func:`misplaced_section`
decides by the entry's name *and* its content, so that ``parallelism = dict(tensor=2,
pipeline=2)`` (torchtitan's name for the section) is refused instead of running at tensor 1,
while ``seeds = [1, 2, 3]`` or ``model = dict(tensor_dim=64)`` stay the user's own.

``user_sections = ["name", ...]`` at the top level of a config lists entries that are the
user's own even when they look like a misplaced section (:func:`user_sections`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..planning.layout import LayoutError, parse_order
from .errors import OWNED_SECTIONS, ConfigError, _near_miss_distance, _shown, near_miss_section
from .values import _as_int

__all__ = [
    "ALIASES",
    "DIST_KEYS",
    "GENERIC_KEYS",
    "PARALLEL_KEYS",
    "USER_SECTIONS",
    "Misplaced",
    "misplaced_section",
    "user_sections",
]

#: The keys of the ``parallel`` section (``ParallelConfig``'s fields; a test keeps them equal).
PARALLEL_KEYS = ("tensor", "pipeline", "context", "expert", "data", "order", "gtp_remat", "reform", "modules")
#: The keys of the ``dist`` section (``DistConfig``'s fields).
DIST_KEYS = ("backend", "timeout", "init_method", "gloo_lazy_init", "hang_report")
#: torchtitan's (``[parallelism]``) and Megatron's (``initialize_model_parallel``) names for the
#: keys of ``parallel``, and the parallelctx key path each one is.
ALIASES = {
    "tensor_parallel_degree": "parallel.tensor",
    "pipeline_parallel_degree": "parallel.pipeline",
    "context_parallel_degree": "parallel.context",
    "expert_parallel_degree": "parallel.expert",
    "expert_tensor_parallel_degree": "parallel.expert.tensor",
    "data_parallel_shard_degree": "parallel.data.shard",
    "data_parallel_replicate_degree": "parallel.data.replicate",
    "tensor_model_parallel_size": "parallel.tensor",
    "pipeline_model_parallel_size": "parallel.pipeline",
    "context_parallel_size": "parallel.context",
    "expert_model_parallel_size": "parallel.expert",
    "expert_tensor_parallel_size": "parallel.expert.tensor",
    "gtp_remat_size": "parallel.gtp_remat",
    "expert_gtp_remat_size": "parallel.expert.gtp_remat",
}
#: Keys of the sections that are common words, kept as the user's at the top level
#: (``data = dict(path=...)``, ``timeout = 30``); every other key of ``parallel`` and ``dist``
#: at the top level is refused when its value has that key's shape.
GENERIC_KEYS = ("data", "timeout")
#: The top-level key that lists the user's own entries, which are never refused as misplaced.
USER_SECTIONS = "user_sections"

#: Words that make a name refer to the parallel setup (``model_parallel``, ``parallelism``,
#: ``distributed``, ``ParallelConfig``): under such a name a section's key counts whatever its value.
_SETUP_WORDS = frozenset({"parallel", "parallelism", "parallelization", "parallelize", "dist", "distributed"})
_BACKENDS = frozenset({"auto", "nccl", "gloo", "mpi", "ucc", "xccl", "hccl", "fake", "cncl"})
#: The axes of ``parallel``: one of them, with a value of its shape, under a setup name is enough.
_AXES = ("tensor", "pipeline", "context", "expert", "gtp_remat", "reform")


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
    """A value the ``seed`` could have been given as: an integer, an integral float (``3.0``,
    YAML's ``!!float 3``) or a string of digits (not a bool, ``1.5``, a list, a dict)."""
    if isinstance(value, bool):
        return False
    if _as_int(value) is not None:
        return True
    if isinstance(value, float):
        return math.isfinite(value) and value.is_integer()
    return isinstance(value, str) and value.strip().isdigit()


def _words(name: str) -> set[str]:
    """``model_parallel`` -> {model, parallel}; ``ParallelConfig`` -> {parallel, config}."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return {w for w in re.split(r"[^A-Za-z]+", spaced.lower()) if w}


def _section_of(key: str) -> str:
    return "parallel" if key in PARALLEL_KEYS else "dist"


def _flat(name: str, value: Any) -> str | None:
    """The parallelctx key path (``parallel.tensor``) that the top-level entry ``name = value``
    is, or None: a key of ``parallel`` or ``dist`` (or torchtitan's or Megatron's name for one)
    written at the top level instead of inside its section."""
    if name in ALIASES:
        return None if value is None else ALIASES[name]
    if name in GENERIC_KEYS:
        # `data` and `timeout` are the user's at the top level, unless clearly parallelctx's:
        # a `data` that splits into replicate and shard (data = dict(replicate=2, shard=4))
        if (
            name == "data"
            and isinstance(value, Mapping)
            and {"replicate", "shard"} & set(value)
            and set(value) <= {"size", "replicate", "shard"}
        ):
            return "parallel.data"
        return None
    if name in PARALLEL_KEYS or name in DIST_KEYS:
        section = _section_of(name)
        return f"{section}.{name}" if _fits(section, name, value) else None
    return None


def _lookup(config: Mapping[str, Any] | None, path: str) -> tuple[bool, Any]:
    """``(True, value)`` of the key path ``path`` (``parallel.data.shard``) in ``config``, or
    ``(False, None)`` when it is not there."""
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _size(value: Any) -> Any:
    if isinstance(value, Mapping):
        return value.get("size")
    return _as_int(value)


def _in_use(config: Mapping[str, Any] | None, path: str, value: Any) -> bool:
    """Whether the real section has ``value`` at ``path``: the other entry then only holds what
    the section already has (a YAML anchor merged into ``parallel``, or a ``.py`` helper
    ``tensor = 2`` used as ``parallel = dict(tensor=tensor)``). An int and ``dict(size=...)``
    of the same size count as the same."""
    there, real = _lookup(config, path)
    if not there:
        return False
    if real is value or real == value:
        return True
    one_int = _as_int(real) is not None or _as_int(value) is not None
    return one_int and _size(real) is not None and _size(real) == _size(value)


def _key_in_use(config: Mapping[str, Any] | None, key: str, value: Any) -> bool:
    if key in ALIASES:
        return _in_use(config, ALIASES[key], value)
    return any(_in_use(config, f"{section}.{key}", value) for section in ("parallel", "dist"))


def _near_dist_key(key: Any, value: Any) -> str | None:
    """The key of ``dist`` that ``key = value`` is, exactly or one edit away (``timout``), with
    a value of that key's shape (``init_method="xavier"`` and ``time=3`` are not), or None."""
    if not isinstance(key, str):
        return None
    for real in DIST_KEYS:
        if (key == real or _near_miss_distance(key.lower(), real) <= 1) and _fits("dist", real, value):
            return real
    return None


def _dict_text(pairs: list[tuple[str, Any]]) -> str:
    """``dict(tensor=2, data=dict(shard=4))`` from ``[("tensor", 2), ("data.shard", 4)]``."""
    tree: dict[str, Any] = {}
    for path, value in pairs:
        node = tree
        *parents, last = path.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {} if part not in node else {"size": node[part]}
            node = node[part]
        node[last] = value

    def show(node: Any) -> str:
        if isinstance(node, Mapping) and all(isinstance(k, str) and k.isidentifier() for k in node):
            return "dict(" + ", ".join(f"{k}={show(v)}" for k, v in node.items()) + ")"
        return _shown(node, 30)

    return show(tree)


def _flat_fix(section: str, name: str, config: Mapping[str, Any]) -> str:
    """``parallel = dict(tensor=2, pipeline=2)``: the section as it would be with the top-level
    keys of ``section`` moved into it (those listed in ``user_sections`` and those already in
    use left out)."""
    try:
        own = user_sections(config)
    except ConfigError:
        own = frozenset()
    real = config.get(section)
    pairs: list[tuple[str, Any]] = list(real.items()) if isinstance(real, Mapping) else []
    for key, value in config.items():
        if not isinstance(key, str) or key in own or key in OWNED_SECTIONS:
            continue
        path = _flat(key, value)
        if path is None or not path.startswith(section + ".") or _in_use(config, path, value):
            continue
        pairs.append((path.split(".", 1)[1], value))
    return f"{section} = {_dict_text(pairs)}"


def _key_text(key: str, value: Any) -> str:
    text = f"{key}={_shown(value, 30)}"
    return f"{text} (parallelctx's {ALIASES[key]})" if key in ALIASES else text


@dataclass(frozen=True)
class Misplaced:
    """A top-level entry that holds what an owned section would, under another name.

    ``section`` is the owned section it was meant to be; ``found`` maps each owned section to
    the keys of the entry counted for it (torchtitan's and Megatron's names, such as
    ``tensor_parallel_degree``, count for ``parallel``; empty for a near miss by name, such as
    ``paralel = dict(tensr=2)`` or ``Seed = 3``); ``by_name`` is True when the name itself
    misspells ``section``, and ``trigger`` then says what in the value made it refused;
    ``flat`` is True for a key of the section written at the top level (``tensor = 2``), and
    ``fix`` then is the section to write instead.
    """

    name: str
    value: Any
    section: str
    found: tuple[tuple[str, tuple[str, ...]], ...] = ()
    by_name: bool = False
    trigger: str = ""
    flat: bool = False
    fix: str = ""

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
        if self.flat:
            path = ALIASES.get(self.name, f"{self.section}.{self.name}")
            what = (
                f"torchtitan's or Megatron's name for {path}"
                if self.name in ALIASES
                else f"a key of the {self.section!r} section ({path})"
            )
            verb = "move it into the" if self.section in present else "put it in a"
            return (
                f"config: top-level {self.name}={_shown(self.value, 40)} is {what}, which parallelctx "
                f"reads only inside {self.section!r}: at the top level it would be ignored without a "
                f"word; {verb} {self.section!r} section: {self.fix} ({override})"
            )
        if self.found and not self.by_name:
            items = self.value if isinstance(self.value, Mapping) else {}
            parts = [
                f"{section}'s key{'s' if len(keys) > 1 else ''} "
                + ", ".join(_key_text(k, items.get(k)) for k in keys)
                for section, keys in self.found
            ]
            sections = [section for section, _ in self.found]
            where = " and ".join(repr(s) for s in sections)
            many = sum(len(keys) for _, keys in self.found) > 1
            if len(sections) == 1 and sections[0] not in present:
                fix = f"rename the section to {sections[0]!r}"
            else:
                fix = f"move {'them' if many else 'it'} into {where}"
            renames = [f"{k} -> {ALIASES[k]}" for _, keys in self.found for k in keys if k in ALIASES]
            if renames:
                fix += f" under parallelctx's names ({', '.join(renames)})"
            return (
                f"config: section {self.name!r} holds {' and '.join(parts)}, which parallelctx reads only "
                f"from {where}: here {'they' if many else 'it'} would be ignored without a word; "
                f"{fix} ({override})"
            )
        shown = "" if isinstance(self.value, Mapping) else f" = {_shown(self.value)}"
        trigger = f"it holds {self.trigger}; " if self.trigger else ""
        constant = (
            f"; a constant in capitals is kept beside its section ({self.section} = {self.name})"
            if self.name == self.section.upper()
            else ""
        )
        return (
            f"config: top-level section {_shown(self.name)}{shown} is not read by parallelctx; did you mean "
            f"{self.section!r}? ({trigger}a name this close to {self.section} holding what {self.section} "
            f"takes is refused, so that a typo cannot run the job with the defaults; {override}{constant})"
        )


def misplaced_section(name: Any, value: Any, config: Mapping[str, Any] | None = None) -> Misplaced | None:
    """Return the owned section that the top-level entry ``name = value`` was meant to be, or
    None for an entry of the user's own. ``config`` is the whole config the entry is in: when
    given, an entry whose every value the real ``parallel`` or ``dist`` section already has is
    kept (a YAML anchor merged into ``parallel``, a ``.py`` helper ``tensor = 2`` used as
    ``parallel = dict(tensor=tensor)``), and a top-level key's fix gathers the others.

    An entry is misplaced when:

    * **it is a section's key at the top level** (``tensor = 2``): ``tensor``, ``pipeline``,
      ``context``, ``expert``, ``gtp_remat``, ``order``, ``reform``, ``backend``,
      ``init_method``, ``gloo_lazy_init`` or ``hang_report`` with a value of that key's shape,
      or torchtitan's or Megatron's name for a key of ``parallel`` (:data:`ALIASES`:
      ``tensor_parallel_degree``, ``tensor_model_parallel_size``); ``data`` and ``timeout``
      are common words and stay the user's (:data:`GENERIC_KEYS`), except ``data =
      dict(replicate=..., shard=...)``;
    * **its content** is an owned section's: a mapping that holds torchtitan's or Megatron's
      name for a key of ``parallel`` (``[parallelism] tensor_parallel_degree = 2``), or at least
      two keys of ``parallel`` and ``dist``, each with a value of that key's shape, that make up
      at least half of its keys (``foo = dict(tensor=2, pipeline=2)``). Under a name that
      refers to the parallel setup (a word ``parallel``, ``parallelism``, ``dist``,
      ``distributed``: ``model_parallel``, ``parallel_config``) a section's key counts whatever
      its value (``parallelism = dict(tensor="2")``), and the entry is refused when such keys
      are more than half of its keys, or when one is an axis of ``parallel`` with a value of its
      shape (``parallelism = dict(tensor=2, zero_stage=1)``): ``distributed_sampler =
      dict(shuffle=True, timeout=10)`` is the user's;
    * or **its name** misspells an owned section (:func:`near_miss_section`) and it holds what
      that section would: for ``parallel``, any non-empty mapping; for ``dist``, a mapping with
      a key of ``dist`` (or one a letter away: ``timout``) holding a value of that key's shape
      (``dis = dict(init_method="xavier")`` is the user's); for ``seed``, an integer, an
      integral float or a string of digits (``Seed = 3``; ``seeds = [1, 2, 3]`` and ``speed =
      1.5`` are the user's).

    Shapes are loose on purpose (``tensor=0`` has the shape of a size): the owned section's own
    validation says what is wrong with a value once it is in the right place.

    Returns:
        A :class:`Misplaced` (its :meth:`~Misplaced.message` is the refusal), or None.
    """
    if not isinstance(name, str) or name in OWNED_SECTIONS or name == USER_SECTIONS:
        return None
    path = _flat(name, value)
    if path is not None:
        if _in_use(config, path, value):
            return None
        section = path.split(".", 1)[0]
        return Misplaced(
            name,
            value,
            section,
            flat=True,
            fix=_flat_fix(section, name, {name: value} if config is None else config),
        )
    by_name = near_miss_section(name)
    if isinstance(value, Mapping) and value:
        return _misplaced_mapping(name, value, by_name, config)
    if by_name == "seed" and _is_seed(value):
        return Misplaced(name, value, "seed", by_name=True)
    return None


def _misplaced_mapping(
    name: str, value: Mapping[Any, Any], by_name: str | None, config: Mapping[str, Any] | None
) -> Misplaced | None:
    if by_name is None and all(isinstance(k, str) and _key_in_use(config, k, v) for k, v in value.items()):
        # every value is the real section's (a YAML anchor merged into it); a near miss of the
        # section's name beside it (`Parallel` beside `parallel`) stays refused as a typo
        return None
    named = bool(_words(name) & _SETUP_WORDS)
    counted: dict[str, list[str]] = {"parallel": [], "dist": []}
    for key, item in value.items():
        if key in ALIASES and item is not None:
            counted["parallel"].append(key)
        elif key in PARALLEL_KEYS or key in DIST_KEYS:
            section = _section_of(key)
            if named or _fits(section, key, item):
                counted[section].append(key)
    found = tuple((section, tuple(keys)) for section, keys in counted.items() if keys)
    trigger = ""
    if by_name == "parallel":
        keys = [k for k in value if k in PARALLEL_KEYS or k in ALIASES] or list(value)
        shown = ", ".join(
            f"{_shown(k) if not isinstance(k, str) else k}={_shown(value[k], 30)}" for k in keys[:3]
        )
        trigger = (
            f"parallel's key{'s' if len(keys) > 1 else ''} {shown}" if keys[0] in PARALLEL_KEYS else shown
        )
    elif by_name == "dist":
        for key, item in value.items():
            real = _near_dist_key(key, item)
            if real is not None:
                shown = f"{key}={_shown(item, 30)}"
                trigger = f"dist's key {shown}" if key == real else f"{shown}, close to dist's key {real!r}"
                break
    if trigger and (not found or by_name in dict(found) or by_name == "parallel"):
        return Misplaced(name, value, str(by_name), found, by_name=True, trigger=trigger)
    if found and all(_key_in_use(config, k, value[k]) for _, keys in found for k in keys):
        return None  # the section's keys it holds are the real section's values (Megatron's options)
    total = sum(len(keys) for _, keys in found)
    aliased = bool(set(counted["parallel"]) & set(ALIASES))
    if named:
        axis = any(k in _AXES and _fits("parallel", k, value[k]) for k in counted["parallel"])
        refused = 2 * total > len(value) or axis
    else:
        refused = total >= 2 and 2 * total >= len(value)
    if found and (aliased or refused):
        main = max(found, key=lambda entry: len(entry[1]))[0]
        return Misplaced(name, value, main, found)
    return None


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
