"""torch.distributed.pipelining on gpc's pipeline group: which stages this rank holds.

torch's ``PipelineStage(submodule, stage_index, num_stages, device, group=...)`` and its schedules
(``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``...) need three things gpc
knows: the pipeline group (``gpc.get_group(ParallelMode.PIPELINE)``), the number of stages, and
the stage indices of this rank. With ``V`` virtual stages per rank (``parallel.pipeline =
dict(size=P, virtual=V)``, an extra key of the pipeline axis, 1 when absent) the model is cut
into ``P·V`` stages and pipeline rank ``r`` holds stages ``r, r + P, r + 2P, ...``: the looped
placement torch's interleaved schedules expect (``stage_index % P`` is the group rank of a stage).

The recipe (docs/engines.md#torchdistributedpipelining)::

    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from parallelctx import gpc, ParallelMode
    from parallelctx.pipelining import num_stages, stage_indices

    group = gpc.get_group(ParallelMode.PIPELINE)
    stages = [PipelineStage(chunks[i], i, num_stages(), gpc.device, group=group) for i in stage_indices()]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)

and the gradients are then all-reduced over ``ParallelMode.DATA`` as in any data-parallel run.
"""

from __future__ import annotations

from typing import Any

from .planning.layout import ParallelMode

__all__ = ["num_stages", "stage_indices", "virtual_size"]


def _ctx(ctx: Any) -> Any:
    if ctx is not None:
        return ctx
    from .context import gpc

    return gpc


def virtual_size(ctx: Any = None) -> int:
    """Return the number of virtual pipeline stages per rank: ``parallel.pipeline.virtual``, else 1.

    Args:
        ctx: the parallel context (default: ``gpc``).

    Raises:
        NotLaunchedError: gpc is not launched.
        ValueError: ``parallel.pipeline.virtual`` is not a positive int, or is absent while another
            key of ``parallel.pipeline`` names a virtual size (``virtual_stages``, Megatron's
            ``virtual_pipeline_model_parallel_size``); the message names the key and the fix.
    """
    pipeline = _ctx(ctx).config.parallel.pipeline
    value = getattr(pipeline, "virtual", None)
    if value is None:
        for key, other in (getattr(pipeline, "model_extra", None) or {}).items():
            if "virtual" in key.lower():  # e.g. Megatron's virtual_pipeline_model_parallel_size
                raise ValueError(
                    f"parallel.pipeline.{key}={other!r} is not read by parallelctx; the number of "
                    "virtual stages per rank is parallel.pipeline.virtual, e.g. "
                    f"pipeline=dict(size={pipeline.size}, virtual={other!r})"
                )
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"parallel.pipeline.virtual={value!r} must be a positive int (the number of model "
            "chunks each pipeline rank holds), e.g. pipeline=dict(size=4, virtual=2)"
        )
    return value


def num_stages(ctx: Any = None) -> int:
    """Return the number of pipeline stages of the model: pipeline size × :func:`virtual_size`.

    Raises:
        NotLaunchedError: gpc is not launched.
        ValueError: ``parallel.pipeline.virtual`` is invalid (see :func:`virtual_size`).
    """
    c = _ctx(ctx)
    return c.get_world_size(ParallelMode.PIPELINE) * virtual_size(c)


def stage_indices(ctx: Any = None) -> list[int]:
    """Return the stage indices this rank holds, ascending: ``r, r + P, ...`` for pipeline rank
    ``r`` of ``P`` (one per virtual stage), the looped placement of torch's interleaved schedules.

    Raises:
        NotLaunchedError: gpc is not launched.
        ValueError: ``parallel.pipeline.virtual`` is invalid (see :func:`virtual_size`).
    """
    c = _ctx(ctx)
    size = c.get_world_size(ParallelMode.PIPELINE)
    rank = c.get_local_rank(ParallelMode.PIPELINE)
    return [rank + i * size for i in range(virtual_size(c))]
