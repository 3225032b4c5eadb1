"""The validated training config: pydantic v2 models for the sections parallelctx owns
(``parallel``, ``dist``, ``seed``) and attribute access to every other section.

A config comes from a dict, a :class:`Config`, or a file (``.py``, ``.json``, ``.toml``,
``.yaml``/``.yml``). Sizes that depend on the world size are checked at launch, by
:func:`parallelctx.layout.plan`.

The package by concern; no file of it imports torch:

* :mod:`.errors`: :class:`ConfigError`, :class:`ConfigValidationError` and their wording
  (:func:`validation_error`, :func:`near_miss_section`); it imports nothing of the package.
* :mod:`.values`: the checks of single values (integers, :func:`to_timedelta`,
  :func:`validate_init_method`, :func:`check_init_method_env`), ``DEFAULT_TIMEOUT``.
* :mod:`.files`: reading a ``.py``, ``.json``, ``.toml`` or ``.yaml`` file into a mapping.
* :mod:`.sections`: :func:`misplaced_section`, which top-level entry holds an owned section's
  content under another name (``parallelism = dict(tensor=2)``, ``Seed = 3``), and the
  ``user_sections`` override.
* :mod:`.schema`: the pydantic models, :class:`Section`, :class:`Config` and :func:`load_config`.
* :mod:`.args`: the checks of ``launch()``'s arguments (also ``parallelctx.args``; not
  re-exported here).

Imports go one way: ``errors`` <- ``values`` <- ``sections`` <- ``schema``, and ``errors`` <- ``files`` <-
``schema``. This module re-exports the names ``parallelctx.config`` has always offered.
"""

from __future__ import annotations

from .errors import OWNED_SECTIONS as OWNED_SECTIONS
from .errors import ConfigError, ConfigValidationError, near_miss_section
from .errors import _rebuild_validation_error as _rebuild_validation_error  # pickles made before the split
from .errors import validation_error as validation_error
from .schema import (
    AxisConfig,
    Config,
    ConfigLike,
    DataConfig,
    DistConfig,
    ExpertConfig,
    ParallelConfig,
    Section,
    load_config,
)
from .schema import HangReportConfig as HangReportConfig
from .sections import misplaced_section
from .values import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from .values import check_init_method_env, to_timedelta, validate_init_method

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
    "misplaced_section",
    "near_miss_section",
    "to_timedelta",
    "validate_init_method",
]
