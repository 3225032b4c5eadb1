"""DeepSpeed interop: the ``mpu`` object ``deepspeed.initialize(..., mpu=...)`` takes, on gpc's groups.

DeepSpeed (0.19.8, the optional extra ``deepspeed``) asks a "model parallel unit" for its groups
instead of making its own: ZeRO-1/2 partition optimizer states and gradients over the
sequence-data-parallel group and reduce gradients there (ZeRO-3 partitions each parameter over
the group it was built in: ``get_data_parallel_group()``, unless the model is built under
``deepspeed.zero.Init(data_parallel_group=...)``; docs/engines.md), sums gradient norms over the
model-parallel group, broadcasts the model from the first rank of the data group, and names
its checkpoint files after the model-parallel rank (``mp_rank_XX_model_states.pt``).
:func:`mpu` answers every one of those questions from gpc:

=====================================  ===================  ==============================
DeepSpeed asks                         gpc mode             ranks
=====================================  ===================  ==============================
``get_model_parallel_*``               MODEL                tensor × pipeline
``get_tensor_model_parallel_*``        TENSOR               tensor
``get_pipeline_model_parallel_*``      PIPELINE             pipeline
``get_data_parallel_*``                DATA                 data
``get_sequence_parallel_*``            CONTEXT              context
``get_sequence_data_parallel_*``       DATA_CONTEXT         data × context
=====================================  ===================  ==============================

It has no ``initialize_sequence_parallel`` method on purpose: DeepSpeed takes an object with that
method for its own sequence-parallel helper and then ignores its data-parallel group.

It imports nothing from DeepSpeed; the answers are read from gpc at each call, so a
``gpc.destroy()`` makes every later question raise ``NotLaunchedError`` instead of answering
with torn-down groups.
"""

from __future__ import annotations

from typing import Any

from .planning.layout import ParallelMode

__all__ = ["DeepSpeedMPU", "mpu"]

M = ParallelMode


class DeepSpeedMPU:
    """The model parallel unit DeepSpeed's ``mpu=`` expects, answering from a parallel context.

    Every method returns what gpc answers for the mode in the module docstring's table at the time
    of the call, and raises ``NotLaunchedError`` when the context is not launched.
    """

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    def __repr__(self) -> str:
        # never raises: a log line, a debugger or a traceback's locals may print the object
        if not self._ctx.is_initialized(M.TENSOR):  # every launch has a (maybe size-1) tensor group
            return "DeepSpeedMPU(not launched)"
        return f"DeepSpeedMPU({self._ctx.layout.describe()})"

    # model parallel: tensor × pipeline (Megatron's meaning, which DeepSpeed follows)
    def get_model_parallel_rank(self) -> int:
        """This rank's index in its model-parallel (tensor × pipeline) group."""
        return int(self._ctx.get_local_rank(M.MODEL))

    def get_model_parallel_world_size(self) -> int:
        """The size of the model-parallel (tensor × pipeline) group."""
        return int(self._ctx.get_world_size(M.MODEL))

    def get_model_parallel_group(self) -> Any:
        """The model-parallel (tensor × pipeline) process group."""
        return self._ctx.get_group(M.MODEL)

    # tensor parallel
    def get_tensor_model_parallel_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return int(self._ctx.get_local_rank(M.TENSOR))

    def get_tensor_model_parallel_world_size(self) -> int:
        """The size of the tensor-parallel group."""
        return int(self._ctx.get_world_size(M.TENSOR))

    def get_tensor_model_parallel_group(self) -> Any:
        """The tensor-parallel process group."""
        return self._ctx.get_group(M.TENSOR)

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of the first rank of this rank's tensor-parallel group."""
        return int(self._ctx.get_ranks_in_group(M.TENSOR)[0])

    # pipeline parallel
    def get_pipeline_model_parallel_rank(self) -> int:
        """This rank's pipeline stage."""
        return int(self._ctx.get_local_rank(M.PIPELINE))

    def get_pipeline_model_parallel_world_size(self) -> int:
        """The number of pipeline stages."""
        return int(self._ctx.get_world_size(M.PIPELINE))

    def get_pipeline_model_parallel_group(self) -> Any:
        """The pipeline process group."""
        return self._ctx.get_group(M.PIPELINE)

    # data parallel
    def get_data_parallel_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return int(self._ctx.get_local_rank(M.DATA))

    def get_data_parallel_world_size(self) -> int:
        """The size of the data-parallel group."""
        return int(self._ctx.get_world_size(M.DATA))

    def get_data_parallel_group(self) -> Any:
        """The data-parallel process group."""
        return self._ctx.get_group(M.DATA)

    def get_data_parallel_group_ranks(self) -> list[int]:
        """The global ranks of this rank's data-parallel group, ascending."""
        return list(self._ctx.get_ranks_in_group(M.DATA))

    # sequence parallel = gpc's context parallelism
    def get_sequence_parallel_rank(self) -> int:
        """This rank's index in its context-parallel group."""
        return int(self._ctx.get_local_rank(M.CONTEXT))

    def get_sequence_parallel_world_size(self) -> int:
        """The size of the context-parallel group."""
        return int(self._ctx.get_world_size(M.CONTEXT))

    def get_sequence_parallel_group(self) -> Any:
        """The context-parallel process group."""
        return self._ctx.get_group(M.CONTEXT)

    def get_sequence_data_parallel_rank(self) -> int:
        """This rank's index in its data × context group (where ZeRO-1/2 partition and reduce)."""
        return int(self._ctx.get_local_rank(M.DATA_CONTEXT))

    def get_sequence_data_parallel_world_size(self) -> int:
        """The size of the data × context group."""
        return int(self._ctx.get_world_size(M.DATA_CONTEXT))

    def get_sequence_data_parallel_group(self) -> Any:
        """The data × context process group."""
        return self._ctx.get_group(M.DATA_CONTEXT)


def mpu(ctx: Any = None) -> DeepSpeedMPU:
    """Return the object to pass as ``deepspeed.initialize(..., mpu=...)``, on gpc's groups.

    Args:
        ctx: the parallel context (default: ``gpc``).

    Returns:
        A :class:`DeepSpeedMPU` answering from ``ctx`` (table in the module docstring).

    Raises:
        NotLaunchedError: the context is not launched (launch gpc before ``deepspeed.initialize``).
    """
    if ctx is None:
        from .context import gpc

        ctx = gpc
    ctx.get_global_rank()  # raises NotLaunchedError, naming the fix, before DeepSpeed sees the object
    return DeepSpeedMPU(ctx)
