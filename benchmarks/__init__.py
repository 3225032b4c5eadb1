"""Benchmarks of parallelctx against Megatron-core and DeviceMesh.

Run ``python -m benchmarks.run`` (or ``make bench``); see :mod:`benchmarks.run` and
``docs/performance.md``.
"""
