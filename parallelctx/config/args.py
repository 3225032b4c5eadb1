"""Validation of the arguments of :func:`parallelctx.launch`, before anything starts.

:func:`validate_launch_args` is pure (no torch, no processes): it checks every argument's type
and range and returns them normalised, so that a bad value fails at once with a message that
names the argument, instead of inside torch (``port=2.5`` silently read as port 2,
``rank='0'``, ``timeout=float('nan')``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..planning.limits import MAX_SEED, MAX_WORLD_SIZE
from .values import _as_int, _shown, _valid_host, to_timedelta, validate_init_method

__all__ = ["BACKENDS", "LaunchArgs", "LaunchArgumentError", "validate_launch_args"]

BACKENDS = ("auto", "nccl", "gloo")


class LaunchArgumentError(ValueError, TypeError):
    """A bad argument to ``launch()``: a wrong type or a value out of range; the message names it.

    Both a ValueError and a TypeError, so ``except ValueError`` and ``except TypeError`` (the
    error ``launch`` documented for a timeout of the wrong type) both catch it.
    """


@dataclass(frozen=True)
class LaunchArgs:
    """The validated, normalised arguments of ``launch()`` (plain ints, a timedelta)."""

    rank: int
    world_size: int
    host: str | None
    port: int | None
    local_rank: int | None
    local_world_size: int | None
    timeout: timedelta | None
    seed: int | None
    backend: str | None
    init_method: str | None


def _int_arg(name: str, value: Any, low: int, high: int, high_text: str | None = None) -> int:
    number = _as_int(value)
    if number is None:
        whole = (isinstance(value, str) and value.strip().isdigit()) or (
            isinstance(value, float) and math.isfinite(value) and value.is_integer()
        )
        try:  # str.strip() drops characters int() refuses, e.g. "0\x1f"
            hint = f" (write {name}={int(value)})" if whole else ""
        except ValueError:
            hint = ""
        raise LaunchArgumentError(
            f"{name}={_shown(value)} is of type {type(value).__name__}; {name} must be an int in "
            f"[{low}, {high_text or high}]{hint}"
        )
    if not low <= number <= high:
        raise LaunchArgumentError(f"{name}={number} must lie in [{low}, {high_text or high}]")
    return number


def validate_launch_args(
    rank: Any = 0,
    world_size: Any = 1,
    host: Any = "127.0.0.1",
    port: Any = None,
    local_rank: Any = None,
    local_world_size: Any = None,
    timeout: Any = None,
    seed: Any = None,
    backend: Any = None,
    init_method: Any = None,
    need_address: bool = True,
) -> LaunchArgs:
    """Check the arguments of ``launch()`` and return them normalised.

    * ``world_size``: an int in ``[1, MAX_WORLD_SIZE]``; ``rank`` an int in ``[0, world_size)``.
    * ``port``: None or an int in 1..65535 (not a bool, float or string); required, with
      ``host``, when ``world_size > 1`` and no ``init_method`` is given.
    * ``host``: None or a non-empty IP address (IPv6 with or without brackets) or host name.
    * ``local_world_size``: None or an int in ``[1, world_size]``; ``local_rank`` None or an int
      in ``[0, local_world_size)`` (``[0, MAX_WORLD_SIZE)`` without it: a process's place on its
      node may lie past a small world's size).
    * ``timeout``: None, or seconds / a timedelta between 1 ms and 365 days
      (:func:`parallelctx.config.to_timedelta`), returned as a timedelta.
    * ``seed``: None or an int in ``[0, 2**32)``; ``backend``: None, ``"auto"``, ``"nccl"`` or
      ``"gloo"``; ``init_method``: None or a URL :func:`parallelctx.config.validate_init_method`
      accepts.

    ``need_address=False`` (the default group exists already and is adopted) lifts the
    host/port requirement.

    numpy integers are accepted and returned as ints. None means "take it from the config".

    Returns:
        A :class:`LaunchArgs`.

    Raises:
        LaunchArgumentError: (a ValueError and a TypeError) the first bad argument; the message
            names it, shows the value and says what is valid.
    """
    world = _int_arg("world_size", world_size, 1, MAX_WORLD_SIZE, f"{MAX_WORLD_SIZE} (MAX_WORLD_SIZE)")
    rank_ = _int_arg("rank", rank, 0, world - 1, f"world_size-1 = {world - 1}")
    local_world = (
        None
        if local_world_size is None
        else _int_arg("local_world_size", local_world_size, 1, world, f"world_size = {world}")
    )
    # Without local_world_size a local rank is only bounded as a world size is: it is the
    # process's place on its node (its device), which may lie past a small world's size (two
    # processes on GPUs 6 and 7; the survivors of gpc.reform() keep theirs).
    limit = local_world if local_world is not None else MAX_WORLD_SIZE
    local = (
        None
        if local_rank is None
        else _int_arg(
            "local_rank",
            local_rank,
            0,
            limit - 1,
            f"local_world_size-1 = {limit - 1}" if local_world is not None else f"{limit - 1}",
        )
    )
    port_ = None if port is None else _int_arg("port", port, 1, 65535)
    if host is not None:
        if not isinstance(host, str):
            raise LaunchArgumentError(
                f"host={_shown(host)} is of type {type(host).__name__}; give a host name or an IP address "
                "as a str"
            )
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not bare or not _valid_host(bare):
            raise LaunchArgumentError(
                f"host={_shown(host)} is neither an IP address nor a host name; give the rank-0 machine, "
                "e.g. host='10.0.0.1'"
            )
    url = None
    if init_method is not None:
        try:
            url = validate_init_method(init_method, "init_method")
        except (TypeError, ValueError) as exc:
            raise LaunchArgumentError(str(exc)) from None
    if world > 1 and url is None and need_address:
        if port_ is None:
            raise LaunchArgumentError(
                f"port=None: a world of {world} needs a rendezvous port; pass port= (an int in 1..65535) "
                "or init_method="
            )
        if not host:
            raise LaunchArgumentError(
                f"host={host!r}: a world of {world} needs the rank-0 machine; pass host= (e.g. '10.0.0.1') "
                "or init_method="
            )
    wait = None
    if timeout is not None:
        try:
            wait = to_timedelta(timeout, "timeout")
        except (TypeError, ValueError) as exc:
            raise LaunchArgumentError(str(exc)) from None
    seed_ = None if seed is None else _int_arg("seed", seed, 0, MAX_SEED)
    if backend is not None and backend not in BACKENDS:
        choices = ", ".join(map(repr, BACKENDS))
        raise LaunchArgumentError(f"backend={_shown(backend)} must be one of {choices}")
    return LaunchArgs(rank_, world, host, port_, local, local_world, wait, seed_, backend, url)
