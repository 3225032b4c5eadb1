"""The validated training config: pydantic v2 models for the sections parallelctx owns
(``parallel``, ``dist``, ``seed``) and attribute access to every other section.

A config comes from a dict, a :class:`Config`, or a file (``.py``, ``.json``, ``.toml``,
``.yaml``/``.yml``). Sizes that depend on the world size are checked at launch, by
:func:`parallelctx.layout.plan`.
"""

from __future__ import annotations

import json
import runpy
import sys
import tomllib
import types
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator

from .layout import DEFAULT_ORDER, LayoutError, parse_order

__all__ = [
    "AxisConfig",
    "Config",
    "ConfigError",
    "DistConfig",
    "ExpertConfig",
    "ParallelConfig",
    "Section",
    "load_config",
    "to_timedelta",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)
MAX_SEED = 2**32 - 1


class ConfigError(ValueError):
    """A config that cannot be read: a missing file, a syntax error, an unsupported source."""


class AxisConfig(BaseModel):
    """One parallel axis: ``tensor=2`` or ``tensor=dict(size=2, ...)``.

    Keys other than ``size`` are kept (``pipeline=dict(size=4, interleaved_overlap=True)``)
    and readable as attributes, for the model code that uses them.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    size: PositiveInt = 1

    @classmethod
    def _coerce(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return value  # let pydantic reject it with the path
        if isinstance(value, int):
            return {"size": value}
        return value


class ExpertConfig(AxisConfig):
    """Expert parallelism: ``expert=4`` or ``expert=dict(size=4, tensor=1)``.

    ``tensor`` is the expert-tensor size; ``None`` means the dense tensor size.
    """

    tensor: PositiveInt | None = None


class ParallelConfig(BaseModel):
    """The ``parallel`` section: sizes of the tensor, pipeline, context and expert axes and the
    rank order string. The data size is derived (``world / (tensor*pipeline*context)``); when
    ``data`` is given it is checked against that at launch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor: AxisConfig = AxisConfig()
    pipeline: AxisConfig = AxisConfig()
    context: AxisConfig = AxisConfig()
    expert: ExpertConfig = ExpertConfig()
    data: PositiveInt | None = None
    order: str = DEFAULT_ORDER

    @field_validator("tensor", "pipeline", "context", "expert", mode="before")
    @classmethod
    def _int_or_dict(cls, value: Any) -> Any:
        return AxisConfig._coerce(value)

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


class DistConfig(BaseModel):
    """The ``dist`` section: backend, timeout of every wait, and how ranks meet.

    ``timeout`` takes seconds (int or float) or a :class:`datetime.timedelta`.
    ``init_method`` is a torch URL (``tcp://host:port``, ``env://``, ``file:///path``); when
    ``None`` the launch functions build ``tcp://host:port`` from their arguments.
    ``gloo_lazy_init`` makes parallelctx's gloo subgroups connect on their first collective
    (as NCCL does) instead of when they are made; a TORCH_GLOO_LAZY_INIT set by the user wins.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout: timedelta = DEFAULT_TIMEOUT
    init_method: str | None = None
    gloo_lazy_init: bool = True

    @field_validator("timeout", mode="before")
    @classmethod
    def _seconds_or_timedelta(cls, value: Any) -> Any:
        try:
            return to_timedelta(value)
        except TypeError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("init_method")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("tcp://", "env://", "file://")):
            raise ValueError(
                f"init_method={value!r} must start with tcp://, env:// or file://"
            )
        return value


def to_timedelta(value: int | float | timedelta) -> timedelta:
    """Return ``value`` (seconds as an int or float, or a timedelta) as a timedelta.

    Raises:
        TypeError: ``value`` is of another type; the message shows the right forms.
        ValueError: ``value`` is not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise TypeError(
            f"timeout={value!r} must be seconds (e.g. timeout=1800) or a "
            "datetime.timedelta (e.g. timeout=timedelta(minutes=30))"
        )
    if not isinstance(value, timedelta):
        value = timedelta(seconds=value)
    if value <= timedelta(0):
        raise ValueError(f"timeout={value} must be positive")
    return value


class _Owned(BaseModel):
    """The sections the library owns, validated together so errors carry the full key path."""

    model_config = ConfigDict(frozen=True)

    parallel: ParallelConfig = ParallelConfig()
    dist: DistConfig = DistConfig()
    seed: int = Field(default=1024, ge=0, le=MAX_SEED)


class Section(Mapping[str, Any]):
    """A read-only config section with attribute and key access: ``s.lr`` and ``s["lr"]``.

    Nested dicts become sections too; lists and other values are kept as given.
    """

    __slots__ = ("_data", "_path")

    def __init__(self, data: Mapping[str, Any], path: str = "config") -> None:
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
        pydantic.ValidationError: a bad value in ``parallel``, ``dist`` or ``seed``; the error
            names the key path and what would be valid.
        ConfigError: ``data`` is not a mapping.
    """

    __slots__ = ("parallel", "dist", "seed")

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
        owned = _Owned.model_validate(
            {k: data[k] for k in ("parallel", "dist", "seed") if k in data}
        )
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
    def from_file(cls, path: str | Path) -> "Config":
        """Read a config file: ``.py``, ``.json``, ``.toml``, ``.yaml`` or ``.yml``.

        In a ``.py`` file every top-level name that does not start with ``_`` and is not a
        module, function or class becomes a key. The file's folder is importable while it runs,
        and modules it imports are removed from ``sys.modules`` afterwards.

        Returns:
            The validated :class:`Config`.

        Raises:
            ConfigError: the file does not exist, has an unsupported suffix, or does not parse
                (the message has the file and line).
            pydantic.ValidationError: a bad value in an owned section.
        """
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        suffix = path.suffix.lower()
        readers = {".py": _read_py, ".json": _read_json, ".toml": _read_toml, ".yaml": _read_yaml, ".yml": _read_yaml}
        if suffix not in readers:
            raise ConfigError(
                f"config file {str(path)!r} has suffix {suffix!r}; use .py, .json, .toml or .yaml"
            )
        data = readers[suffix](path)
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        return cls(data)


def load_config(config: "Config | Mapping[str, Any] | str | Path | None") -> Config:
    """Return a :class:`Config` from a Config, a dict, a file path, or None (all defaults).

    Raises:
        ConfigError: an unreadable file or an unsupported type.
        pydantic.ValidationError: a bad value in an owned section.
    """
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, Path)):
        return Config.from_file(config)
    return Config(config)


def _read_py(path: Path) -> dict[str, Any]:
    folder = str(path.resolve().parent)
    modules_before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        namespace = runpy.run_path(str(path), run_name="__parallelctx_config__")
    except SyntaxError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:
        raise ConfigError(f"{path}: running the config raised {type(exc).__name__}: {exc}") from exc
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
        for name in set(sys.modules) - modules_before:
            del sys.modules[name]
    return {
        key: value
        for key, value in namespace.items()
        if not key.startswith("_")
        and not isinstance(value, (types.ModuleType, types.FunctionType, type))
    }


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: JSON error: {exc.msg}") from None


def _read_toml(path: Path) -> Any:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML error: {exc}") from None


def _read_yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: YAML error: {exc}") from None
