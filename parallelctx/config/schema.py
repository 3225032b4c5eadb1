"""The pydantic models of the sections parallelctx owns (:class:`ParallelConfig`,
:class:`DistConfig`, the seed), :class:`Section` for every other section, and :class:`Config`,
the whole validated config, with :func:`load_config`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..planning.layout import DEFAULT_ORDER, Layout, LayoutError, parse_order
from ..planning.limits import MAX_CONFIG_DEPTH, MAX_CONFIG_NODES, MAX_SEED
from ..planning.modules import LANGUAGE, ModulePlan, check_spans
from .errors import (
    OWNED_SECTIONS,
    ConfigError,
    ConfigValidationError,
    _shown,
    validation_error,
)
from .files import read_config_file
from .sections import misplaced_section, user_sections
from .values import (
    DEFAULT_TIMEOUT,
    _as_int,
    _closest,
    _strict_int,
    _unknown_key,
    to_timedelta,
    validate_init_method,
)

__all__ = [
    "AxisConfig",
    "Config",
    "ConfigLike",
    "DataConfig",
    "DistConfig",
    "ExpertConfig",
    "HangReportConfig",
    "ModuleConfig",
    "ParallelConfig",
    "Section",
    "load_config",
]


class AxisConfig(BaseModel):
    """One parallel axis: ``tensor=2`` or ``tensor=dict(size=2, ...)``.

    ``size`` is a plain int (a bool, a string or a float is refused). Other keys are kept
    (``pipeline=dict(size=4, interleaved_overlap=True)``) and readable as attributes, for the model
    code that uses them, except keys that look like a misspelt valid key (``sizes``, ``szie``),
    which are refused with the key they probably mean, and keys named like a pydantic or
    config-section method (``copy``, ``json``, ``items``, ``get``...), which attribute access
    could not reach.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    size: int = 1

    @field_validator("size", mode="before")
    @classmethod
    def _positive_int(cls, value: Any) -> int:
        return _strict_int(value, "size", 1)

    @classmethod
    def _coerce(cls, value: Any, name: str = "axis") -> Any:
        """Turn ``tensor=2`` into ``{"size": 2}`` and check the keys of ``tensor=dict(...)``."""
        what = f"parallel.{name}"
        if isinstance(value, (cls, AxisConfig)):
            return value
        if isinstance(value, Mapping):
            valid = tuple(cls.model_fields)
            for key in value:
                if key in valid:
                    continue
                if not isinstance(key, str) or not key.isidentifier():
                    raise ValueError(
                        f"{what}: key {_shown(key)} is not a name; the keys of an axis are names such as "
                        f"{', '.join(valid)}"
                    )
                guess = _closest(key, valid)
                if guess is not None:
                    raise ValueError(f"{what}: unknown key {key!r}; did you mean {guess!r}?")
                if hasattr(cls, key) or hasattr(Section, key):
                    raise ValueError(
                        f"{what}: key {key!r} has the name of a pydantic model or config-section "
                        f"attribute (items, keys, get, copy...), so {what}.{key} would not return it; "
                        f"rename the key (e.g. {key + '_'!r})"
                    )
            return dict(value)
        number = _as_int(value)
        if number is None:
            raise ValueError(
                f"{what}={_shown(value)} is of type {type(value).__name__}; give the size as an int "
                f"({name}=2) or a dict ({name}=dict(size=2))"
            )
        return {"size": number}


class ExpertConfig(AxisConfig):
    """Expert parallelism: ``expert=4`` or ``expert=dict(size=4, tensor=1)``.

    ``tensor`` is the expert-tensor size (a plain int); ``None`` means the dense tensor size.
    """

    tensor: int | None = None
    gtp_remat: int = 1

    @field_validator("tensor", mode="before")
    @classmethod
    def _positive_int_or_none(cls, value: Any) -> int | None:
        return None if value is None else _strict_int(value, "tensor", 1)

    @field_validator("gtp_remat", mode="before")
    @classmethod
    def _gtp_positive_int(cls, value: Any) -> int:
        return _strict_int(value, "gtp_remat", 1)


class DataConfig(BaseModel):
    """The data axis: ``data=4`` (a checked size), or HSDP's split of it,
    ``data=dict(replicate=2)`` or ``data=dict(replicate=2, shard=4)``.

    ``replicate`` is the outer part (torchtitan's ``dp_replicate``: FSDP2's replicas), ``shard``
    the inner part (``dp_shard``: the ranks that shard the parameters), so data = replicate ×
    shard. ``size`` and ``shard`` are derived from the world when absent and checked against it
    at launch when given; every value is a plain positive int.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int | None = None
    replicate: int = 1
    shard: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _int_or_dict(cls, value: Any) -> Any:
        if isinstance(value, (cls, Mapping)):
            return _only_known_keys("parallel.data", value, tuple(cls.model_fields))
        number = _as_int(value)
        if number is None:
            raise ValueError(
                f"parallel.data={_shown(value)} is of type {type(value).__name__}; give the data size "
                "as an int (data=4) or its HSDP split as a dict (data=dict(replicate=2, shard=4))"
            )
        return {"size": number}

    @field_validator("size", "shard", mode="before")
    @classmethod
    def _positive_int_or_none(cls, value: Any, info: Any) -> int | None:
        return None if value is None else _strict_int(value, info.field_name, 1)

    @field_validator("replicate", mode="before")
    @classmethod
    def _positive_int(cls, value: Any) -> int:
        return _strict_int(value, "replicate", 1)

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        if self.size is not None and self.shard is not None and self.size != self.replicate * self.shard:
            raise ValueError(
                f"parallel.data: size={self.size} is not replicate={self.replicate} x shard={self.shard}"
                f" = {self.replicate * self.shard}; give two of the three"
            )
        return self


def _only_known_keys(section: str, value: Any, fields: tuple[str, ...]) -> Any:
    """Return ``value``; raise ValueError for a key of a mapping ``value`` that ``section`` does not
    have (the message suggests the closest valid key)."""
    if isinstance(value, Mapping):
        for key in value:
            if key not in fields:
                raise ValueError(_unknown_key(section, key, fields))
    return value


class _Sizes(BaseModel):
    """The sizes and order string of one layout: the ``parallel`` section's, and each module's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor: AxisConfig = AxisConfig()
    pipeline: AxisConfig = AxisConfig()
    context: AxisConfig = AxisConfig()
    expert: ExpertConfig = ExpertConfig()
    data: DataConfig = DataConfig()
    order: StrictStr = DEFAULT_ORDER
    # Megatron-core 0.19's generalized tensor parallelism (weights sharded over gtp_remat ranks
    # of distinct data); the expert twin is expert.gtp_remat.
    gtp_remat: AxisConfig = AxisConfig()

    @field_validator("tensor", "pipeline", "context", "gtp_remat", mode="before")
    @classmethod
    def _int_or_dict(cls, value: Any, info: Any) -> Any:
        return AxisConfig._coerce(value, info.field_name)

    @field_validator("expert", mode="before")
    @classmethod
    def _expert_int_or_dict(cls, value: Any) -> Any:
        return ExpertConfig._coerce(value, "expert")

    @field_validator("data", mode="before")
    @classmethod
    def _data_int_or_dict(cls, value: Any) -> Any:
        return DataConfig() if value is None else value

    @field_validator("order")
    @classmethod
    def _valid_order(cls, value: str) -> str:
        try:
            parse_order(value)
        except LayoutError as exc:
            raise ValueError(str(exc)) from None
        return value.lower().replace(" ", "")

    @property
    def expert_tensor(self) -> int:
        """The expert-tensor size: ``expert.tensor``, else the tensor size."""
        return self.expert.tensor or self.tensor.size

    def _layout(self, world_size: int, offset: int = 0, where: str = "parallel") -> Layout:
        data = self.data
        layout = Layout(
            world_size,
            tensor=self.tensor.size,
            pipeline=self.pipeline.size,
            context=self.context.size,
            expert=self.expert.size,
            expert_tensor=self.expert.tensor,
            order=self.order,
            replicate=data.replicate,
            gtp_remat=self.gtp_remat.size,
            expert_gtp_remat=self.expert.gtp_remat,
            offset=offset,
        )
        ranks = "world_size" if where == "parallel" else f"{where}.ranks"
        if data.size is not None and data.size != layout.data:
            raise LayoutError(
                f"{where}.data={data.size} but {ranks}={world_size} / (tensor x pipeline x "
                f"context) = {layout.data}; drop {where}.data (it is derived) or fix the sizes"
            )
        if data.shard is not None and data.shard != layout.shard:
            raise LayoutError(
                f"{where}.data.shard={data.shard} but {ranks}={world_size} / (tensor x pipeline x "
                f"context x replicate={data.replicate}) = {layout.shard}; drop shard (it is derived) "
                "or fix the sizes"
            )
        return layout


class ModuleConfig(_Sizes):
    """One module of ``parallel.modules``: its ranks and its own sizes.

    ``ranks`` is how many ranks it holds and ``offset`` the first (default: the first rank no
    module before it in the config holds); ``colocated_with="name"``
    puts it on exactly the ranks of another module instead. ``language=True`` makes it the
    language module (default: the module named ``"language"``). The sizes are those of the
    ``parallel`` section (``order`` defaults to the section's).
    """

    ranks: int | None = None
    offset: int | None = None
    colocated_with: StrictStr | None = None
    language: StrictBool | None = None
    order: StrictStr | None = None  # type: ignore[assignment]  # None: the parallel section's

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        return _only_known_keys("parallel.modules.<name>", value, tuple(cls.model_fields))

    @field_validator("ranks", mode="before")
    @classmethod
    def _ranks_int(cls, value: Any) -> int | None:
        return None if value is None else _strict_int(value, "ranks", 1)

    @field_validator("offset", mode="before")
    @classmethod
    def _offset_int(cls, value: Any) -> int | None:
        return None if value is None else _strict_int(value, "offset", 0)

    @field_validator("order")
    @classmethod
    def _valid_order(cls, value: str | None) -> str | None:  # type: ignore[override]
        return None if value is None else _Sizes._valid_order(value)


class ParallelConfig(_Sizes):
    """The ``parallel`` section: sizes of the tensor, pipeline, context and expert axes and the
    rank order string. The data size is derived (``world / (tensor*pipeline*context)``); when
    ``data`` is given it is checked against that at launch. ``data=dict(replicate=R, shard=S)``
    splits the data axis for HSDP (:class:`DataConfig`).

    ``modules=dict(name=dict(ranks=..., tensor=...), ...)`` gives the job several layouts, one
    per module, each on its own ranks (:class:`ModuleConfig`; docs/modules.md); the sizes then
    go in the modules, not beside them."""

    # Which axis shrinks when ranks are lost and gpc.reform() goes on without them
    # (planning/reform.py): "data", "replicate" (HSDP) or "off".
    reform: Literal["data", "replicate", "off"] = "data"
    modules: dict[StrictStr, ModuleConfig] | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        return _only_known_keys("parallel", value, tuple(cls.model_fields))

    @model_validator(mode="after")
    def _modules_fit(self) -> ParallelConfig:
        if self.modules is not None:
            sizes = [  # a size other than its default (a dumped config holds every key)
                k
                for k, f in _Sizes.model_fields.items()
                if k != "order" and getattr(self, k) != f.get_default()
            ]
            if sizes:
                raise ValueError(
                    f"parallel.{sizes[0]} is given beside parallel.modules; with modules each module "
                    f"has its own sizes: move {', '.join('parallel.' + k for k in sizes)} into the modules"
                )
            try:
                self.module_plan()
            except LayoutError as exc:
                raise ValueError(str(exc)) from None
        return self

    def module_plan(self, world_size: int | None = None) -> ModulePlan:
        """Return the :class:`~parallelctx.planning.modules.ModulePlan` of ``modules``: each
        module's layout on its ranks, in the config's order.

        Raises:
            LayoutError: no ``modules``; a module with neither ``ranks`` nor ``colocated_with``,
                or naming a module that does not exist; sizes that do not divide a module's
                ranks; spans that overlap without being equal, leave a gap, or do not cover
                ``world_size`` (when given). The message names the module, the key and the fix.
        """
        if self.modules is None:
            raise LayoutError("parallel.modules is not set: this job has one layout (to_layout)")
        if not self.modules:
            raise LayoutError("parallel.modules is empty: name at least one module, or drop the key")
        spans: dict[str, tuple[int, int]] = {}
        for name in self.modules:
            if not name or ":" in name or name != name.strip():
                raise LayoutError(
                    f"parallel.modules: module name {name!r} must be a non-empty name without ':' or "
                    "surrounding spaces (e.g. 'vision', 'language')"
                )
        defaulted: list[str] = []
        for name, mod in self.modules.items():
            where = f"parallel.modules.{name}"
            if mod.colocated_with is not None:
                if mod.colocated_with not in self.modules or mod.colocated_with == name:
                    raise LayoutError(
                        f"{where}.colocated_with={mod.colocated_with!r} names no other module; "
                        f"the modules are {', '.join(map(repr, self.modules))}"
                    )
                continue
            if mod.ranks is None:
                raise LayoutError(
                    f"{where} has neither ranks nor colocated_with: give ranks=<count> (and offset=<first "
                    "rank> if it does not start at the first rank the modules before it leave free) or "
                    "colocated_with=<module>"
                )
            offset = mod.offset
            if offset is None:  # the first rank no module before it holds
                defaulted.append(name)
                taken = sorted(spans.values())
                offset = 0
                for start, count in taken:
                    if start <= offset < start + count:
                        offset = start + count
            spans[name] = (offset, mod.ranks)
        for name, mod in self.modules.items():
            seen = [name]
            target = name
            while self.modules[target].colocated_with is not None:
                target = str(self.modules[target].colocated_with)
                if target in seen:
                    raise LayoutError(
                        f"parallel.modules: colocated_with goes round in a circle: {' -> '.join(seen)}"
                    )
                seen.append(target)
            span = spans[target]
            for key in ("ranks", "offset"):
                given = getattr(mod, key)
                if given is not None and given != span[0 if key == "offset" else 1]:
                    raise LayoutError(
                        f"parallel.modules.{name}.{key}={given} but it is colocated with {target!r}, "
                        f"which holds ranks {span[0]}-{span[0] + span[1] - 1}: drop {key}"
                    )
            spans[name] = span
        spans = {name: spans[name] for name in self.modules}
        try:
            check_spans(spans, world_size)
        except LayoutError as exc:
            if not defaulted:
                raise
            given = ", ".join(f"{n}={spans[n][0]}" for n in defaulted)
            raise LayoutError(
                f"{exc} (offsets not given were defaulted to the first rank no module before them holds: "
                f"{given}; give offset= to place a module elsewhere)"
            ) from None
        layouts = {}
        for name, mod in self.modules.items():
            sizes = mod.model_copy(update={"order": mod.order or self.order})
            try:
                layouts[name] = sizes._layout(spans[name][1], spans[name][0], f"parallel.modules.{name}")
            except LayoutError as exc:
                text = str(exc).replace("world_size=", "ranks=")
                prefix = f"parallel.modules.{name}"
                raise LayoutError(text if text.startswith(prefix) else f"{prefix}: {text}") from None
        flagged = [n for n, m in self.modules.items() if m.language]
        if len(flagged) > 1:
            raise LayoutError(
                f"parallel.modules: {', '.join(map(repr, flagged))} all say language=True; one module is the language module"
            )
        language = flagged[0] if flagged else (LANGUAGE if LANGUAGE in self.modules else None)
        if language is not None and self.modules[language].language is False:
            language = None
        return ModulePlan(layouts, language)

    def layout_or_plan(self, world_size: int) -> Layout | ModulePlan:
        """Return :meth:`to_layout` on ``world_size`` ranks, or with ``modules`` :meth:`module_plan`.

        Raises:
            LayoutError: the sizes (or the modules) do not fit ``world_size``.
        """
        return self.module_plan(world_size) if self.modules is not None else self.to_layout(world_size)

    def to_layout(self, world_size: int) -> Layout:
        """Return the :class:`~parallelctx.layout.Layout` of these sizes and order on a world of
        ``world_size`` ranks: the one place the config's sizes become a layout.

        Returns:
            The validated Layout.

        Raises:
            LayoutError: the sizes do not fit ``world_size``, ``data`` (or ``data.shard``) is
                given and differs from the derived size, or ``data.replicate`` does not divide
                the data size; the message names the values and the fix. With ``modules``
                (a layout per module): always, naming :meth:`module_plan`.
        """
        if self.modules is not None:
            raise LayoutError(
                f"parallel.modules gives this job one layout per module ({', '.join(self.modules)}), "
                "not one for the whole job: use parallel.module_plan(world_size) (gpc.module(name).layout "
                "once launched)"
            )
        return self._layout(world_size)


class HangReportConfig(BaseModel):
    """``dist.hang_report``: report a collective that has waited longer than ``after`` seconds.

    ``after`` takes seconds (int or float) or a :class:`datetime.timedelta`, in the range of
    ``dist.timeout``; keep ``after + 2 * store_wait`` below ``dist.timeout``, or torch may
    raise first (a report's two reads may each wait up to ``store_wait`` for a slow store).
    ``store_wait`` (same forms, default 10 s) is how long a report whose read of the other
    ranks' progress timed out reads again before it is made without that progress. ``log``
    (default True) logs each report as a warning on the ``parallelctx`` logger; the handlers of
    ``gpc.on_hang`` are called either way. See ``docs/reliability.md``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    after: timedelta
    store_wait: timedelta = timedelta(seconds=10)
    log: StrictBool = True

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        if not isinstance(value, (Mapping, HangReportConfig)):
            raise ValueError(
                f"dist.hang_report={value!r} is of type {type(value).__name__}; give a dict such as "
                "dict(after=60) (report a collective that waits longer than 60 s), or leave it out"
            )
        return _only_known_keys("dist.hang_report", value, tuple(cls.model_fields))

    @field_validator("after", "store_wait", mode="before")
    @classmethod
    def _seconds_or_timedelta(cls, value: Any, info: ValidationInfo) -> Any:
        try:
            return to_timedelta(value, f"dist.hang_report.{info.field_name}")
        except TypeError as exc:
            raise ValueError(str(exc)) from None


class DistConfig(BaseModel):
    """The ``dist`` section: backend, timeout of every wait, and how ranks meet.

    ``timeout`` takes seconds (int or float) or a :class:`datetime.timedelta`, from 1 ms to 365
    days. ``init_method`` is a torch URL (``tcp://host:port``, ``env://``, ``file:///path``),
    checked in full by :func:`validate_init_method`; when ``None`` the launch functions build
    ``tcp://host:port`` from their arguments.
    ``gloo_lazy_init`` makes parallelctx's gloo subgroups connect on their first collective
    (as NCCL does) instead of when they are made; a TORCH_GLOO_LAZY_INIT set by the user wins.
    ``hang_report`` (``dict(after=SECONDS)``, off by default) names the ranks a hung collective
    waits for (:class:`HangReportConfig`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout: timedelta = DEFAULT_TIMEOUT
    init_method: StrictStr | None = None
    gloo_lazy_init: StrictBool = True
    hang_report: HangReportConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        return _only_known_keys("dist", value, tuple(cls.model_fields))

    @field_validator("timeout", mode="before")
    @classmethod
    def _seconds_or_timedelta(cls, value: Any) -> Any:
        try:
            return to_timedelta(value, "dist.timeout")
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("init_method")
    @classmethod
    def _valid_url(cls, value: str | None) -> str | None:
        return None if value is None else validate_init_method(value)

    @model_validator(mode="after")
    def _report_before_timeout(self) -> DistConfig:
        """Warn (UserWarning) where a hang report may come after torch's own timeout."""
        report = self.hang_report
        if report is not None and report.after + 2 * report.store_wait >= self.timeout:
            secs = [f"{t.total_seconds():g} s" for t in (report.after, report.store_wait, self.timeout)]
            warnings.warn(
                f"dist.hang_report.after={secs[0]} + 2 x store_wait={secs[1]} is not below "
                f"dist.timeout={secs[2]}: a report that waits on a slow store may come after torch "
                "has already raised; raise dist.timeout, or lower after or store_wait",
                UserWarning,
                stacklevel=2,
            )
        return self


class _Owned(BaseModel):
    """The sections the library owns, validated together so errors carry the full key path."""

    model_config = ConfigDict(frozen=True)

    parallel: ParallelConfig = ParallelConfig()
    dist: DistConfig = DistConfig()
    seed: int = 1024

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_int(cls, value: Any) -> int:
        return _strict_int(value, "seed", 0, MAX_SEED)


def _path_text(root: str, link: tuple[Any, ...] | None) -> str:
    """``config.model.layers[3]`` from a linked path ``(parent_link, key)``; long keys shortened."""
    keys: list[Any] = []
    while link is not None:
        link, key = link
        keys.append(key)
    text = root
    for key in reversed(keys):
        if isinstance(key, int) and not isinstance(key, bool):
            text += f"[{key}]"
        elif isinstance(key, str) and key.isidentifier() and len(key) <= 40:
            text += f".{key}"
        else:
            text += f"[{_shown(key, 40)}]"
    return text if len(text) <= 120 else text[:57] + "..." + text[-60:]


def _check_tree(data: Any, root: str = "config") -> None:
    """Refuse a structure no config needs: nesting deeper than ``MAX_CONFIG_DEPTH``, more than
    ``MAX_CONFIG_NODES`` values (shared ones counted each time they appear, as a YAML alias bomb
    would expand), or a container that contains itself. Iterative and stopped at the limit, so it
    costs at most ``MAX_CONFIG_NODES`` steps whatever the input.

    Raises:
        ConfigError: the message names the place (e.g. ``config.model.layers[3]``) and the limit.
    """
    containers = (Mapping, list, tuple, set, frozenset)
    count = 0
    on_path: set[int] = set()
    # Frames (container, linked path, depth); an int frame (a container's id) marks the end of that
    # container's subtree and takes it off the current path. Paths are linked tuples, built into
    # text only for a message, so each step costs O(1).
    stack: list[Any] = [(data, None, 0)]
    while stack:
        frame = stack.pop()
        if isinstance(frame, int):
            on_path.discard(frame)
            continue
        node, link, depth = frame
        if id(node) in on_path:
            raise ConfigError(
                f"{_path_text(root, link)} contains itself (a self-referential dict or list); a config "
                "must be a tree"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(
                f"{_path_text(root, link)} is nested {depth} levels deep, more than the {MAX_CONFIG_DEPTH} "
                "a config may have"
            )
        on_path.add(id(node))
        stack.append(id(node))
        items = node.items() if isinstance(node, Mapping) else enumerate(node)
        for key, value in items:
            count += 1
            if count > MAX_CONFIG_NODES:
                raise ConfigError(
                    f"{root} holds more than {MAX_CONFIG_NODES} values (shared values, e.g. YAML aliases, "
                    f"counted each time they appear; the limit was reached at "
                    f"{_path_text(root, (link, key))}); a config this large is refused"
                )
            if isinstance(value, containers):
                stack.append((value, (link, key), depth + 1))


class Section(Mapping[str, Any]):
    """A read-only config section with attribute and key access: ``s.lr`` and ``s["lr"]``.

    Nested dicts become sections too; lists and other values are kept as given. A key named like
    an attribute of the section (``items``, ``keys``, ``values``, ``get``, ``to_dict``...) is
    refused: ``s.items`` would return the method, never the value.

    Raises:
        ConfigError: such a key; the message names it and says to rename it.
    """

    __slots__ = ("_data", "_path")

    def __init__(self, data: Mapping[str, Any], path: str = "config") -> None:
        for key in data:
            if isinstance(key, str) and hasattr(type(self), key):
                raise ConfigError(
                    f"{path}: key {key!r} is the name of a config-section method or attribute, so "
                    f"{path}.{key} would return that, not your value; rename the key (e.g. {key + '_'!r})"
                )
        self._data = {
            key: Section(value, f"{path}.{key}") if isinstance(value, Mapping) else value
            for key, value in data.items()
        }
        self._path = path

    def _missing(self, key: str) -> str:
        return f"{self._path} has no key {key!r}; keys: {', '.join(sorted(self._data)) or 'none'}"

    def __getattr__(self, name: str) -> Any:
        if name in ("_data", "_path"):  # not set yet (mid-unpickling): no recursion
            raise AttributeError(name)
        try:
            return self._data[name]
        except KeyError:
            raise AttributeError(self._missing(name)) from None

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.to_dict(), self._path))

    def __getitem__(self, key: str) -> Any:
        try:
            return self._data[key]
        except KeyError:
            raise KeyError(self._missing(key)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"Section({self.to_dict()!r})"

    def to_dict(self) -> dict[str, Any]:
        """Return the section as plain nested dicts."""
        return {k: v.to_dict() if isinstance(v, Section) else v for k, v in self._data.items()}


class Config(Section):
    """The whole training config.

    ``parallel``, ``dist`` and ``seed`` are validated pydantic models
    (:class:`ParallelConfig`, :class:`DistConfig`, an int in ``[0, 2**32)``); every other
    section is kept as given, readable as ``config.model.hidden_size`` or
    ``config["model"]["hidden_size"]``.

    Raises:
        ConfigValidationError: a bad value in ``parallel``, ``dist`` or ``seed`` (also a pydantic
            ``ValidationError``); the error names the key path and what would be valid.
        ConfigError: a top-level entry that holds an owned section's content under another
            name (``parallelism = dict(tensor=2, pipeline=2)``, ``paralel = dict(...)``,
            ``Seed = 3``, ``tensor = 2`` at the top level; see :func:`~parallelctx.config.sections.misplaced_section`; the
            entries listed in a top-level ``user_sections`` are never refused so);
            ``user_sections`` is not a list of names; ``data`` is not a mapping; it nests
            deeper than 64 levels, holds more than a million values or contains itself (see
            :mod:`parallelctx.limits`); or a key is named like a section method (``items``,
            ``keys``, ``values``, ``get``...).
    """

    __slots__ = ("dist", "parallel", "seed")

    parallel: ParallelConfig
    dist: DistConfig
    seed: int

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        data = {} if data is None else data
        if isinstance(data, Config):
            data = data.to_dict()
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"a config must be a mapping, a Config or a file path, not {type(data).__name__}"
            )
        _check_tree(data)
        own = user_sections(data)
        for key, value in data.items():
            if key in own:
                continue
            misplaced = misplaced_section(key, value, data)
            if misplaced is None:
                continue
            if misplaced.by_name and key == misplaced.section.upper() and misplaced.section in data:
                continue  # a constant in capitals beside its section (SEED = 42; seed = SEED)
            raise ConfigError(misplaced.message(frozenset(k for k in OWNED_SECTIONS if k in data)))
        try:
            owned = _Owned.model_validate({k: data[k] for k in OWNED_SECTIONS if k in data})
        except ValidationError as exc:
            raise validation_error(exc) from None
        rest = {k: v for k, v in data.items() if k not in ("parallel", "dist", "seed")}
        super().__init__(rest)
        object.__setattr__(self, "parallel", owned.parallel)
        object.__setattr__(self, "dist", owned.dist)
        object.__setattr__(self, "seed", owned.seed)
        self._data.update(parallel=owned.parallel, dist=owned.dist, seed=owned.seed)

    def __getattr__(self, name: str) -> Any:  # slots cover the owned sections
        return Section.__getattr__(self, name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Config, (self.to_dict(),))

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain nested dicts (owned sections dumped by pydantic)."""
        out = {k: v for k, v in Section.to_dict(self).items() if k not in ("parallel", "dist", "seed")}
        out["parallel"] = self.parallel.model_dump(exclude_none=True)
        out["dist"] = self.dist.model_dump()
        out["seed"] = self.seed
        return out

    @classmethod
    def from_file(cls, path: str | Path) -> Config:
        """Read a config file: ``.py``, ``.json``, ``.toml``, ``.yaml`` or ``.yml``.

        In a ``.py`` file every top-level name that does not start with ``_`` and is not a
        module, function or class becomes a key. The file's folder is importable while it runs;
        modules it imports stay imported (so an enum it imports is the same object as the one
        model code imports later). Data files must be UTF-8 and at most 16 MiB; YAML is read
        with ``safe_load`` semantics.

        Returns:
            The validated :class:`Config`.

        Raises:
            ConfigError: the file does not exist, is a folder, cannot be read, is larger than
                16 MiB, is not UTF-8, has an unsupported suffix, does not parse (the message has
                the file and line), or holds a structure past the limits (too deep, too large,
                self-referential); every message names the file.
            ConfigValidationError: a bad value in an owned section (the message names the file).
                A top-level entry that holds an owned section's content under another name
                (``parallelism``, ``paralel``) is a ConfigError.
        """
        path = Path(path)
        data = read_config_file(path)
        try:
            return cls(data)
        except ConfigValidationError as exc:
            raise validation_error(exc, path) from None
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None


ConfigLike = Config | Mapping[str, Any] | str | Path | None
"""What every launch function accepts as its config: a Config, a dict, a file path, or None."""


def load_config(config: ConfigLike) -> Config:
    """Return a :class:`Config` from a Config, a dict, a file path, or None (all defaults).

    Raises:
        ConfigError: an unreadable file or an unsupported type.
        ConfigValidationError: a bad value in an owned section (a pydantic ValidationError too).
        ConfigError: also a top-level entry that holds an owned section's content under another
            name (``parallelism = dict(tensor=2)``, ``paralel = dict(...)``).
    """
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, Path)):
        return Config.from_file(config)
    return Config(config)
