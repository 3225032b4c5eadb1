"""Guards that watch or patch torch and make no process group: this process's sockets and each
gloo group's event loop, abort, the hang report, the dry run's recorder and the one helper
that patches and restores torch's attributes (docs/internals.md)."""
