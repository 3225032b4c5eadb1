"""``python -m parallelctx``: see :mod:`parallelctx.cli`."""

import sys

from .cli.main import main

sys.exit(main())
