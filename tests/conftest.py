"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from parallelctx.env import is_launcher_variable


@pytest.fixture
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher's variables in this test's environment (so detection sees a plain process),
    and gloo on the loopback interface. Returns the monkeypatch for more changes."""
    for key in list(os.environ):
        if is_launcher_variable(key):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    return monkeypatch


@pytest.fixture
def world_of_one() -> Iterator[Callable[[Any], Any]]:
    """``start(config)`` launches gpc as a world of one in this process; torn down after the test."""
    from parallelctx import gpc, launch

    def start(config: Any = None) -> Any:
        return launch(config)

    try:
        yield start
    finally:
        gpc.destroy()
