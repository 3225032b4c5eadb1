"""The command-line tools: ``parallelctx plan | check | env`` and the demo.

Modules: :mod:`.main` (parser and dispatch), :mod:`.plan`, :mod:`.env`, :mod:`.check` (the
``check`` command) with :mod:`.verify` (proving a launched context by collectives) and
:mod:`.timing` (all-reduce timing), :mod:`.placement` (ranks on nodes), :mod:`.tables` (the rich
table and text picture), :mod:`.picture` (the matplotlib picture, extra ``plot``) and
:mod:`.demo`. These import the library; the library never imports them.
"""

from __future__ import annotations

from .main import build_parser, check_arguments, main

__all__ = ["build_parser", "check_arguments", "main"]
