"""Documented limits on what parallelctx accepts; nothing here imports anything.

Every value past one of these is refused with an error that names the key or argument and the
limit, instead of failing later inside numpy, torch or the operating system.
"""

from __future__ import annotations

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_NODES",
    "MAX_HOSTS",
    "MAX_SEED",
    "MAX_TIMEOUT_SECONDS",
    "MAX_WORLD_SIZE",
    "MIN_TIMEOUT_SECONDS",
]

MAX_WORLD_SIZE = 2**24
"""The largest world :func:`parallelctx.layout.plan` accepts: 16,777,216 ranks. Far beyond any job
run today, and small enough that the whole-world group arrays (int64) stay in memory."""

MAX_HOSTS = 2**20
"""The most host names a Slurm host list may expand to when the full list is needed."""

MAX_SEED = 2**32 - 1
"""The largest seed (numpy's limit)."""

MIN_TIMEOUT_SECONDS = 0.001
"""The shortest timeout: one millisecond (torch counts timeouts in milliseconds)."""

MAX_TIMEOUT_SECONDS = 365 * 24 * 3600
"""The longest timeout: 365 days. torch stores timeouts in a signed 64-bit count of nanoseconds in
places, so much longer ones wrap around to negative values."""

MAX_CONFIG_BYTES = 16 * 2**20
"""The largest config file read: 16 MiB."""

MAX_CONFIG_DEPTH = 64
"""The deepest nesting of dicts and lists in a config."""

MAX_CONFIG_NODES = 1_000_000
"""The most values (dict entries and list items, shared ones counted each time they appear) in a
config: a YAML alias bomb expands past this and is refused before it takes the memory."""
