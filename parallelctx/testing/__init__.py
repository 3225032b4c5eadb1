"""Test parallel model code on N ranks with pytest: ``@pytest.mark.parallel(world_size=8, tensor=2)``
runs a test on a reused pool of processes with ``gpc`` launched for the layout (the plugin in
:mod:`parallelctx.testing.plugin`, registered through the ``pytest11`` entry point), and the
assertion helpers below check tensors across the ranks of a group. See docs/testing.md.
"""

from .asserts import assert_differs_across, assert_same_across, gather_across

__all__ = ["assert_differs_across", "assert_same_across", "gather_across"]
