"""One line to standard error in one ``write``.

``print(text, file=sys.stderr)`` writes the text and its newline in two calls, and standard
error writes through at once: under torchrun, where every rank's standard error is the same
pipe, two ranks' lines came out glued (``...product di...or=3 x ...``, then an empty line).
A line written in one call of at most ``PIPE_BUF`` bytes (4,096 on Linux) is never split.
"""

from __future__ import annotations

import sys

__all__ = ["say"]


def say(text: str) -> None:
    """Write ``text`` and a newline to ``sys.stderr`` in one call, then flush; returns None.

    Raises:
        OSError: standard error cannot be written.
    """
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()
