"""``python -m parallelctx``: see :mod:`parallelctx.cli`."""

import sys

from .cli import main

sys.exit(main())
