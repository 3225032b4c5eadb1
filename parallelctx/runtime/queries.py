"""What a launched context answers from the :class:`~parallelctx.runtime.startup.Launched` value it
adopted: :class:`LaunchQueries`, a base class of ``gpc`` and of ``gpc.module(name)``.

The values the launch made (config, layout, hosts, device, meshes), the seeds and RNG streams,
and the summary. The context (:mod:`parallelctx.context`) is the one writer of its ``launched``
value and answers the per-mode queries itself, from its tables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..guard.recorder import DryRun
from ..planning.views import Adopted
from .rngstate import RNGState
from .seed import RNGStreams, Stream
from .startup import Launched, local_rank_of

__all__ = ["LaunchQueries"]


class LaunchQueries:
    """The values a launch made, the seeds and the summary; answered from ``_launched`` (which
    the subclass, the context, adopts) and never from torch's state."""

    _launched: Launched
    _dry_run: DryRun | None

    @property
    def launched(self) -> Launched:
        """The value this context adopted: everything the launch made (empty before launch)."""
        return self._launched

    @property
    def dry_run(self) -> DryRun | None:
        """The :class:`parallelctx.dryrun.DryRun` this process records when it is a dry run,
        else None; it outlives :meth:`destroy` until the next real launch."""
        return self._dry_run

    config = Adopted("config", "The validated :class:`Config`.")
    layout = Adopted("layout", "The rank :class:`Layout` of this world.")
    backend = Adopted("backend", 'The default group\'s backend, e.g. ``"gloo"``.')
    hostnames = Adopted("hostnames", "The host name of every global rank, in rank order.")
    local_rank = Adopted(
        "local_rank", "This process's rank on its node (the launcher's, else from host names)."
    )
    rng_streams = Adopted("streams", "The per-mode :class:`~parallelctx.seed.RNGStreams`.")
    device = Adopted("device", "The device :meth:`set_device` picked (the CPU until then).")
    group_creations = Adopted("group_calls", "How many ``new_group`` calls this rank made for gpc's groups.")
    num_processes_on_current_node = Adopted(
        "hostnames", "Ranks on this rank's host.", lambda names, v: local_rank_of(names, v.rank)[1]
    )
    num_nodes = Adopted("hostnames", "Distinct hosts in the job.", lambda names, v: len(set(names)))
    node_rank = Adopted(
        "hostnames",
        "Index of this host among the job's hosts, ordered by their lowest global rank.",
        lambda names, v: list(dict.fromkeys(names)).index(names[v.rank]),
    )
    device_mesh = Adopted(
        "layout",
        "A ``DeviceMesh`` over the dense axes (``pp``, ``dp``, ``cp``, ``tp``), built once on gpc's groups.",
        lambda layout, v: v.device_mesh("dense"),
    )
    expert_device_mesh = Adopted(
        "layout",
        "The ``DeviceMesh`` of the expert grid (``pp``, ``edp``, ``ep``, ``etp``), built once.",
        lambda layout, v: v.device_mesh("expert"),
    )

    # ------------------------------------------------------------------ seeds
    def get_seed(self, mode: Stream) -> int:
        """Return the seed of ``mode``'s RNG stream on this rank (``mode`` may be ``"replica"``).
        Raises NotLaunchedError before :meth:`set_seed`, LayoutError for a name of no stream."""
        streams: RNGStreams = self.rng_streams
        return streams.seeds[self._launched.stream_key(mode)]

    @contextlib.contextmanager
    def seed(self, mode: Stream) -> Iterator[None]:
        """``with gpc.seed(mode):`` runs the body on ``mode``'s RNG stream (CPU and CUDA
        generators; ``"replica"``: the stream that differs across data-parallel replicas) and
        switches back after; the stream resumes where it stopped. Raises as :meth:`get_seed`."""
        streams: RNGStreams = self.rng_streams
        with streams.fork(self._launched.stream_key(mode)):
            yield

    def get_rng_state(self) -> RNGState:
        """Return every RNG stream of this rank (Python's, numpy's, torch's default generators,
        each mode's stream) as a picklable :class:`RNGState` for :meth:`set_rng_state` when
        resuming. Raises NotLaunchedError before :meth:`set_seed`."""
        self.rng_streams  # noqa: B018 - NotLaunchedError before set_seed
        return self._launched.rng_state()

    def set_rng_state(self, state: RNGState) -> None:
        """Restore every stream from ``state`` (also inside ``with gpc.seed(...)``).

        Raises:
            NotLaunchedError: before :meth:`set_seed`.
            TypeError: ``state`` is not an :class:`RNGState`.
            ValueError: ``state`` was taken on another rank, world size or layout, or with CUDA
                state where this rank has none (or the reverse); the message says which.
        """
        self.rng_streams  # noqa: B018 - NotLaunchedError before set_seed
        self._launched.restore_rng(state)

    def summary(self) -> str:
        """Return the one-line launch summary (with modules: which module gpc answers for, and
        the rank's modules)."""
        v = self._launched
        where = f"module {v.module} of {', '.join(v.modules)}: " if v.module is not None else ""
        return (
            f"parallelctx: {where}{self.layout.describe()} backend={self.backend} nodes={self.num_nodes} "
            f"procs/node={self.num_processes_on_current_node} seed={self.config.seed} "
            f"groups made on this rank={self.group_creations}"
        )
