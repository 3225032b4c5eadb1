"""Reading a config file (``.py``, ``.json``, ``.toml``, ``.yaml``/``.yml``) into a mapping:
size and encoding limits, the parser of each suffix, and errors that name the file and line.
Validation is :meth:`Config.from_file`'s, in ``schema.py``.
"""

from __future__ import annotations

import json
import runpy
import sys
import tomllib
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..planning.limits import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_NODES
from .errors import ConfigError

__all__ = ["read_config_file"]


def read_config_file(path: Path) -> Mapping[str, Any]:
    """Read the config file ``path`` with the parser of its suffix (``.py``, ``.json``, ``.toml``,
    ``.yaml``, ``.yml``), unvalidated; see :meth:`Config.from_file` for what each reads.

    Returns:
        The mapping at the file's top level.

    Raises:
        ConfigError: the file does not exist, is a folder, cannot be read, is larger than 16 MiB,
            is not UTF-8, has an unsupported suffix, does not parse (the message has the file and
            line) or holds no mapping at the top level; every message names the file.
    """
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; pass the path of a config file in it")
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
        raise ConfigError(f"config file {str(path)!r} has suffix {suffix!r}; use .py, .json, .toml or .yaml")
    data = readers[suffix](path)
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


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
