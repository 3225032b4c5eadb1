"""The checks of single values: integers (:func:`_strict_int`), timeouts (:func:`to_timedelta`),
rendezvous URLs (:func:`validate_init_method`, and :func:`check_init_method_env` at launch) and
the wording of an unknown key. Shared by the config models (``schema.py``) and ``launch()``'s
argument checks (``args.py``).
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import operator
import os
import re
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..planning.limits import MAX_TIMEOUT_SECONDS, MIN_TIMEOUT_SECONDS
from .errors import ConfigError, _shown

__all__ = ["DEFAULT_TIMEOUT", "check_init_method_env", "to_timedelta", "validate_init_method"]


DEFAULT_TIMEOUT = timedelta(minutes=30)


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
