"""The runtime that makes the world: the start-up (functions of values that return one frozen
:class:`~parallelctx.runtime.startup.Launched`), the rendezvous, the group maker, the dry run's
fake world, DeviceMesh from groups, seeds and RNG state (docs/internals.md)."""
