"""Torch-free planning: the parallel modes, the rank layout, the per-mode answer tables, the
dry run's simulated world and every documented limit. Nothing here imports torch or anything
of parallelctx outside this package (docs/internals.md)."""
