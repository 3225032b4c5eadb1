"""The validated training config: pydantic v2 models for the sections parallelctx owns
(``parallel``, ``dist``, ``seed``) and attribute access to every other section.

A config comes from a dict, a :class:`Config`, or a file (``.py``, ``.json``, ``.toml``,
``.yaml``/``.yml``). Sizes that depend on the world size are checked at launch, by
:func:`parallelctx.layout.plan`.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import operator
import os
import re
import runpy
import sys
import tomllib
import types
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from ..planning.layout import DEFAULT_ORDER, Layout, LayoutError, parse_order
from ..planning.limits import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_NODES,
    MAX_SEED,
    MAX_TIMEOUT_SECONDS,
    MIN_TIMEOUT_SECONDS,
)

__all__ = [
    "AxisConfig",
    "Config",
    "ConfigError",
    "ConfigLike",
    "ConfigValidationError",
    "DataConfig",
    "DistConfig",
    "ExpertConfig",
    "ParallelConfig",
    "Section",
    "check_init_method_env",
    "load_config",
    "near_miss_section",
    "to_timedelta",
    "validate_init_method",
]

DEFAULT_TIMEOUT = timedelta(minutes=30)


class ConfigError(ValueError):
    """A config that cannot be read: a missing file, a syntax error, an unsupported source, a
    structure past the limits (too deep, too large, self-referential), a key that would be
    unreachable, or a top-level section named like a misspelt owned one (``paralel``)."""


OWNED_SECTIONS = ("parallel", "dist", "seed")
"""The top-level sections parallelctx validates; every other section is the user's."""


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
    ``name`` most likely misspells, or None for a name of the user's own.

    A near miss is, ignoring case, the owned name itself written otherwise (``Parallel``,
    ``SEED``) or one edit away: a letter left out (``paralel``, ``sed``, ``dst``), one added
    (``parallell``, ``dist_``, ``seeds``) or two neighbours swapped (``dsit``, ``prallel``:
    swaps of non-neighbours count as two edits). For ``parallel``, long enough that no real
    word lies near it, two such edits or one replaced letter also count (``paralell``,
    ``parralel``, ``parallal``). A replaced letter in the short names is not a near miss,
    because it makes real words (``need``, ``feed``, ``disk``, ``list``), and neither are
    ``data``, ``set``, ``seq``, ``test`` or ``distributed``.
    """
    if not isinstance(name, str) or name in OWNED_SECTIONS:
        return None
    lowered = name.lower()
    for owned in OWNED_SECTIONS:
        limit = 2 if len(owned) >= 6 else 1
        if abs(len(lowered) - len(owned)) <= limit and _near_miss_distance(lowered, owned) <= limit:
            return owned
    return None


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened to about ``limit`` characters for messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_int(value: Any) -> int | None:
    """``value`` as an int when it is an integer (int, numpy integer), else None (bool, str,
    bytes, float and everything else)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return None
    try:
        return operator.index(value)
    except (TypeError, ValueError):  # e.g. numpy.bool_, whose __index__ refuses
        return None


def _strict_int(value: Any, what: str, low: int, high: int | None = None) -> int:
    """Return ``value`` as an int in ``[low, high]``; refuse bools, strings, floats and bytes.

    Raises:
        ValueError: the message names ``what``, the value and the valid range.
    """
    span = f"[{low}, {high}]"
    number = _as_int(value)
    if number is None:
        kind = type(value).__name__
        raise ValueError(
            f"{what}={_shown(value)} is of type {kind}, not an integer; give a plain int such as {low + 1}"
        )
    if high is None:
        if number < low:
            raise ValueError(f"{what}={number} must be greater than {low - 1} (an integer of at least {low})")
    elif number < low:
        raise ValueError(f"{what}={number} must be greater than or equal to {low} (an integer in {span})")
    elif number > high:
        raise ValueError(f"{what}={number} must be less than or equal to {high} (an integer in {span})")
    return number


def _closest(key: Any, valid: tuple[str, ...], cutoff: float = 0.7) -> str | None:
    """The valid key ``key`` most likely misspells, or None."""
    if not isinstance(key, str):
        return None
    found = difflib.get_close_matches(key.lower(), valid, n=1, cutoff=cutoff)
    return found[0] if found else None


def _unknown_key(section: str, key: Any, valid: tuple[str, ...]) -> str:
    guess = _closest(key, valid, cutoff=0.6)
    hint = f"did you mean {guess!r}? " if guess else ""
    return f"{section}: unknown key {_shown(key)}; {hint}valid keys: {', '.join(valid)}"


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


class ParallelConfig(BaseModel):
    """The ``parallel`` section: sizes of the tensor, pipeline, context and expert axes and the
    rank order string. The data size is derived (``world / (tensor*pipeline*context)``); when
    ``data`` is given it is checked against that at launch. ``data=dict(replicate=R, shard=S)``
    splits the data axis for HSDP (:class:`DataConfig`)."""

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

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        return _only_known_keys("parallel", value, tuple(cls.model_fields))

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

    def to_layout(self, world_size: int) -> Layout:
        """Return the :class:`~parallelctx.layout.Layout` of these sizes and order on a world of
        ``world_size`` ranks: the one place the config's sizes become a layout.

        Returns:
            The validated Layout.

        Raises:
            LayoutError: the sizes do not fit ``world_size``, ``data`` (or ``data.shard``) is
                given and differs from the derived size, or ``data.replicate`` does not divide
                the data size; the message names the values and the fix.
        """
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
        )
        if data.size is not None and data.size != layout.data:
            raise LayoutError(
                f"parallel.data={data.size} but world_size={world_size} / (tensor x pipeline x "
                f"context) = {layout.data}; drop parallel.data (it is derived) or fix the sizes"
            )
        if data.shard is not None and data.shard != layout.shard:
            raise LayoutError(
                f"parallel.data.shard={data.shard} but world_size={world_size} / (tensor x pipeline x "
                f"context x replicate={data.replicate}) = {layout.shard}; drop shard (it is derived) "
                "or fix the sizes"
            )
        return layout


class HangReportConfig(BaseModel):
    """``dist.hang_report``: report a collective that has waited longer than ``after`` seconds.

    ``after`` takes seconds (int or float) or a :class:`datetime.timedelta`, in the range of
    ``dist.timeout``; make it shorter than ``dist.timeout``, or torch raises first. ``log``
    (default True) logs each report as a warning on the ``parallelctx`` logger; the handlers of
    ``gpc.on_hang`` are called either way. See ``docs/reliability.md``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    after: timedelta
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

    @field_validator("after", mode="before")
    @classmethod
    def _seconds_or_timedelta(cls, value: Any) -> Any:
        try:
            return to_timedelta(value, "dist.hang_report.after")
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


_RANGE_TEXT = (
    f"between {MIN_TIMEOUT_SECONDS} and {MAX_TIMEOUT_SECONDS} seconds "
    f"(1 ms to {MAX_TIMEOUT_SECONDS // 86400} days)"
)


def to_timedelta(value: float | timedelta, name: str = "timeout") -> timedelta:
    """Return ``value`` (seconds as an int or float, or a timedelta) as a timedelta.

    The value must be finite and between :data:`~parallelctx.limits.MIN_TIMEOUT_SECONDS` (1 ms)
    and :data:`~parallelctx.limits.MAX_TIMEOUT_SECONDS` (365 days): torch counts timeouts in
    milliseconds and, in places, in signed 64-bit nanoseconds, which longer ones overflow.
    ``name`` is the key or argument the messages name (``"dist.timeout"``, ``"timeout"``).

    Returns:
        The timedelta.

    Raises:
        TypeError: ``value`` is of another type (a bool, a string...); the message shows the right
            forms.
        ValueError: ``value`` is not a finite number, is not positive, or is out of the range; the
            message names ``name`` and states the range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise TypeError(
            f"{name}={_shown(value)} must be seconds (e.g. timeout=1800) or a "
            "datetime.timedelta (e.g. timeout=timedelta(minutes=30))"
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, float) and not math.isfinite(seconds):
        raise ValueError(f"{name}={value} must be a finite number of seconds, {_RANGE_TEXT}")
    if seconds <= 0:
        raise ValueError(f"{name}={_shown(value)} must be positive: {_RANGE_TEXT}")
    if seconds < MIN_TIMEOUT_SECONDS or seconds > MAX_TIMEOUT_SECONDS:
        raise ValueError(f"{name}={_shown(value)} is out of range: a timeout must lie {_RANGE_TEXT}")
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


# --------------------------------------------------------------------------- init_method

_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?")


def _valid_host(host: str) -> bool:
    """True for an IPv4/IPv6 address or a DNS-style host name."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return len(host) <= 253 and _HOST_NAME.fullmatch(host) is not None


def validate_init_method(url: str, name: str = "dist.init_method") -> str:
    """Check a torch rendezvous URL in full and return it unchanged.

    * ``tcp://HOST:PORT``: HOST an IP address (IPv6 in brackets) or a host name, PORT in 1..65535;
      no path (a ``?query`` is passed on to torch).
    * ``env://``: nothing after ``//`` but an optional ``?query``; MASTER_ADDR and MASTER_PORT are
      read at launch, where :func:`check_init_method_env` checks them.
    * ``file:///absolute/path``: three slashes and an absolute path to a file (not a folder).

    Returns:
        ``url``.

    Raises:
        TypeError: ``url`` is not a string.
        ValueError: the scheme is none of these, or a part is missing or malformed; the message
            names ``name``, the URL and the right form.
    """
    if not isinstance(url, str):
        raise TypeError(f"{name}={_shown(url)} must be a string such as 'tcp://10.0.0.1:29500'")
    shown = _shown(url, 80)
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise ValueError(f"{name}={shown} contains whitespace or control characters; remove them")
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ("tcp", "env", "file"):
        raise ValueError(f"{name}={shown} must start with tcp://, env:// or file://")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(
            f"{name}={shown}: the port is not a number in 1..65535 (or the address is malformed); write "
            "tcp://HOST:PORT, e.g. tcp://10.0.0.1:29500"
        ) from None
    if parts.fragment:
        raise ValueError(f"{name}={shown} has a '#' fragment, which torch does not read; remove it")
    if scheme == "tcp":
        host = parts.hostname
        if not host or not parts.netloc:
            raise ValueError(
                f"{name}={shown} names no host; write tcp://HOST:PORT, e.g. tcp://10.0.0.1:29500"
            )
        if port is None:
            raise ValueError(f"{name}={shown} names no port; write tcp://{parts.netloc}:PORT, e.g. :29500")
        if not 0 < port < 65536:
            raise ValueError(f"{name}={shown}: port {port} must lie in 1..65535")
        if parts.username or parts.password:
            raise ValueError(f"{name}={shown} holds a user name or password; write tcp://HOST:PORT")
        if not _valid_host(host):
            raise ValueError(f"{name}={shown}: {host!r} is neither an IP address nor a host name")
        if parts.path not in ("", "/"):
            raise ValueError(
                f"{name}={shown} has a path {parts.path!r}, which torch ignores; write tcp://HOST:PORT"
            )
    elif scheme == "env":
        if parts.netloc or parts.path not in ("", "/"):
            raise ValueError(
                f"{name}={shown}: env:// takes the address from MASTER_ADDR and MASTER_PORT, so nothing "
                "may follow env://; write env:// and export them, or write tcp://HOST:PORT"
            )
    else:
        if parts.netloc and parts.netloc != "localhost":
            raise ValueError(
                f"{name}={shown}: {parts.netloc!r} would be read as a host name and dropped; write an "
                "absolute path after three slashes, e.g. file:///tmp/rendezvous"
            )
        if not parts.path or parts.path.endswith("/"):
            raise ValueError(
                f"{name}={shown} names no file; write file:///absolute/path/to/a/file, e.g. "
                "file:///tmp/rendezvous"
            )
    return url


def check_init_method_env(
    init_method: str | None, env: Mapping[str, str] | None = None, name: str = "dist.init_method"
) -> None:
    """Check at launch what an ``init_method`` needs from this machine.

    For ``env://``: MASTER_ADDR is set and not empty and MASTER_PORT is a port in 1..65535 (torch
    would otherwise fail later without naming the key). For ``file:///path``: the folder of the
    file exists. Nothing is checked for ``tcp://`` or None. ``env`` defaults to ``os.environ``.

    Returns:
        None.

    Raises:
        ConfigError: a variable is missing or malformed, or the folder does not exist; the message
            names ``name``, the variable and the fix.
    """
    if init_method is None:
        return
    env = os.environ if env is None else env
    if init_method.startswith("env://"):
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        missing = [var for var, val in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not val]
        if missing:
            raise ConfigError(
                f"{name}='env://' takes the rendezvous address from MASTER_ADDR and MASTER_PORT, but "
                f"{' and '.join(missing)} {'are' if len(missing) > 1 else 'is'} not set; export "
                "MASTER_ADDR=<host of rank 0> and MASTER_PORT=<free port> on every rank, or set "
                f"{name}='tcp://HOST:PORT'"
            )
        if not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
            raise ConfigError(
                f"{name}='env://': MASTER_PORT={_shown(port)} must be a port in 1..65535; export "
                "MASTER_PORT=<free port>"
            )
    elif init_method.startswith("file://"):
        folder = Path(urlsplit(init_method).path).parent
        if not folder.is_dir():
            raise ConfigError(
                f"{name}={init_method!r}: the folder {str(folder)!r} does not exist; create it (on a "
                "file system every rank sees) or choose another path"
            )


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
        ConfigError: a top-level name near an owned one (``paralel``, ``Seed``; see
            :func:`near_miss_section`); ``data`` is not a mapping; it nests deeper than 64 levels, holds more than a
            million values or contains itself (see :mod:`parallelctx.limits`); or a key is named
            like a section method (``items``, ``keys``, ``values``, ``get``...).
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
        for key in data:
            near = near_miss_section(key)
            if near is not None and key == near.upper() and near in data:
                continue  # a constant in capitals beside its section (SEED = 42; seed = SEED)
            if near is not None:
                constant = (
                    f"; a constant in capitals is kept beside its section ({near} = {key})"
                    if key == near.upper()
                    else ""
                )
                raise ConfigError(
                    f"config: top-level section {_shown(key)} is not read by parallelctx; did you mean "
                    f"{near!r}? (names this close to parallel, dist or seed are refused, so that a typo "
                    f"cannot run the job with the defaults; give a section of your own another name{constant})"
                )
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
                A top-level section named like a misspelt owned one is a ConfigError.
        """
        path = Path(path)
        if path.is_dir():
            raise ConfigError(
                f"config file {str(path)!r} is a directory; pass the path of a config file in it"
            )
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        suffix = path.suffix.lower()
        readers = {
            ".py": _read_py,
            ".json": _read_json,
            ".toml": _read_toml,
            ".yaml": _read_yaml,
            ".yml": _read_yaml,
        }
        if suffix not in readers:
            raise ConfigError(
                f"config file {str(path)!r} has suffix {suffix!r}; use .py, .json, .toml or .yaml"
            )
        data = readers[suffix](path)
        if not isinstance(data, Mapping):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
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
        ConfigError: also a section named like a misspelt owned one (``paralel``).
    """
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, Path)):
        return Config.from_file(config)
    return Config(config)


def _read_text(path: Path) -> str:
    """The file's text: at most MAX_CONFIG_BYTES, UTF-8 (a BOM is allowed)."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{path}: {size} bytes, more than the {MAX_CONFIG_BYTES} bytes (16 MiB) a config file "
                "may have"
            )
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save "
            "the file as UTF-8"
        ) from None


def _parse_failure(path: Path, kind: str, exc: BaseException) -> ConfigError:
    """A ConfigError for a parser that gave up with something other than its own error."""
    if isinstance(exc, RecursionError):
        return ConfigError(
            f"{path}: {kind} nested too deeply to parse; a config may nest at most {MAX_CONFIG_DEPTH} levels"
        )
    return ConfigError(f"{path}: {kind} error: {exc}")


def _read_py(path: Path) -> dict[str, Any]:
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        namespace = runpy.run_path(str(path), run_name="__parallelctx_config__")
    except SyntaxError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:
        raise ConfigError(f"{path}: running the config raised {type(exc).__name__}: {exc}") from exc
    finally:
        # The folder leaves sys.path; the modules the config imported stay in sys.modules, so the
        # classes and enums in its values are the ones model code gets when it imports them.
        if folder in sys.path:
            sys.path.remove(folder)
    return {
        key: value
        for key, value in namespace.items()
        if not key.startswith("_") and not isinstance(value, (types.ModuleType, types.FunctionType, type))
    }


def _read_json(path: Path) -> Any:
    text = _read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: JSON error: {exc.msg}") from None
    except (RecursionError, ValueError) as exc:  # too deep; an integer past Python's digit limit
        raise _parse_failure(path, "JSON", exc) from None


def _read_toml(path: Path) -> Any:
    text = _read_text(path)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: TOML error: {exc}") from None
    except (RecursionError, ValueError) as exc:
        raise _parse_failure(path, "TOML", exc) from None


def _yaml_loader() -> type:
    """A safe YAML loader whose merge keys (``<<: *a``) cannot multiply a mapping without bound."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class _BoundedLoader(base):  # type: ignore[misc, valid-type]
        def flatten_mapping(self, node: Any) -> None:
            super().flatten_mapping(node)
            if len(node.value) > MAX_CONFIG_NODES:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"merge keys ('<<') expand one mapping to more than {MAX_CONFIG_NODES} entries",
                    node.start_mark,
                )

    return _BoundedLoader


def _read_yaml(path: Path) -> Any:
    import yaml

    text = _read_text(path)
    try:
        return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass: no Python objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: YAML error: {exc}") from None
    except (RecursionError, ValueError, OverflowError) as exc:
        raise _parse_failure(path, "YAML", exc) from None
