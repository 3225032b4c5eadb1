"""``parallelctx env``: which launcher started this process and what it said."""

from __future__ import annotations

import argparse
import json
import sys

from .stderr import say

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Run ``parallelctx env`` with parsed ``args``; return the exit code (0 ok, 2 detection failed)."""
    from ..env import LaunchEnvError, detect

    try:
        found = detect()
    except LaunchEnvError as exc:
        say(f"parallelctx env: {exc}")
        return 2
    info = found.as_dict()
    if args.json:
        json.dump(info, sys.stdout)
        sys.stdout.write("\n")
        return 0
    info.pop("variables")
    rows = [(key, "-" if value is None else str(value)) for key, value in info.items()]
    rows += list(found.variables)
    width = max(len(key) for key, _ in rows)
    sys.stdout.write(f"{'field':<{width}}  value\n{'-' * width}  {'-' * 5}\n")
    for i, (key, value) in enumerate(rows):
        if i == len(info):
            sys.stdout.write(f"{'read from the environment':<{width}}\n")
        sys.stdout.write(f"{key:<{width}}  {value}\n")
    return 0
