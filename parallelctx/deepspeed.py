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

ZeRO-3 partitions each parameter over the group it was built in, so with context parallelism the
model must be built under :func:`zero_init` (``deepspeed.zero.Init`` on gpc's data × context group,
its dtype given through the config). The engine checks it: when DeepSpeed's engine, while it is
being built, asks the mpu for the sequence-data-parallel group, :func:`check_zero_partitions`
runs on the engine's model and a parameter partitioned over another group (or, with context > 1,
not built under ``zero.Init`` at all) raises :class:`ZeroPartitionError` out of
``deepspeed.initialize``, naming the parameter, the two groups and the fix. In the same place it
checks Megatron's mark (:func:`check_shard_marks`) and, with pipeline > 1 and clipping on, that
DeepSpeed's gradient norm counts the replicated parameters of every stage (ZeRO-3 and float32
without ZeRO count them on model-parallel rank 0 alone, i.e. on the first stage: refused).

DeepSpeed's ``PipelineModule`` takes no mpu: :func:`pipe_topology` gives it gpc's placement, a
module built with another is refused when it is built (:func:`check_pipe_topology`, run by
:mod:`parallelctx.engines.guard`), and :func:`check_pipe_engine` checks the engine
``deepspeed.initialize`` returns (marks, and the stage-norm rule above).
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import sys
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from .planning.layout import Layout, ParallelMode

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.topology import ProcessTopology
    from deepspeed.runtime.zero.partition_parameters import Init

__all__ = [
    "DeepSpeedMPU",
    "PipeTopologyError",
    "ZeroPartitionError",
    "check_pipe_engine",
    "check_pipe_topology",
    "check_shard_marks",
    "check_zero_partitions",
    "mpu",
    "pipe_axes",
    "pipe_topology",
    "zero_init",
]

M = ParallelMode
logger = logging.getLogger(__name__)

FIX = "with parallelctx.deepspeed.zero_init(config): model = ..."
"""The recipe every ZeRO-3 refusal names (docs/engines.md#deepspeed)."""

_SECTIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
"""The DeepSpeed config section that makes ``zero.Init`` build parameters of each half dtype."""


_SET_BY_ZERO_INIT = frozenset(
    {"data_parallel_group", "sequence_data_parallel_group", "config_dict_or_path", "mpu"}
)
"""The ``deepspeed.zero.Init`` arguments :func:`zero_init` sets itself."""


class PipeTopologyError(ValueError):
    """DeepSpeed's ``PipelineModule`` would place the ranks on other pipeline, data or tensor
    coordinates than gpc's layout (or gpc's layout has an axis DeepSpeed's pipeline has not)."""


class ZeroPartitionError(ValueError):
    """A ZeRO-3 parameter is (or would be) partitioned over a group other than gpc's data × context."""


class DeepSpeedMPU:
    """The model parallel unit DeepSpeed's ``mpu=`` expects, answering from a parallel context.

    Every method returns what gpc answers for the mode in the module docstring's table at the time
    of the call, and raises ``NotLaunchedError`` when the context is not launched.
    """

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._checked: weakref.WeakSet[Any] = weakref.WeakSet()  # engines whose model was checked

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
        """The data × context process group (where ZeRO partitions).

        Asked by DeepSpeed's engine while it is being built, it first checks the engine's model:
        with :func:`check_zero_partitions` under ZeRO-3, with :func:`check_shard_marks`, and,
        with pipeline > 1, that DeepSpeed's gradient norm counts every stage's replicated
        parameters (module docstring).

        Raises:
            ZeroPartitionError: ZeRO-3 and a parameter of the engine's model is partitioned over
                another group, or (context > 1) was not built under ``zero.Init``.
            ValueError: ``gradient_clipping`` is on and an unmarked parameter differs across the
                tensor group (:func:`check_shard_marks`), or, with pipeline > 1, ZeRO-3 or float32
                without ZeRO would leave the replicated parameters of every stage but the first
                out of the norm.
        """
        group = self._ctx.get_group(M.DATA_CONTEXT)
        engine = _engine_being_built()
        if engine is not None and engine not in self._checked:  # DeepSpeed asks several times
            self._checked.add(engine)
            if engine.zero_optimization_stage() == 3:
                check_zero_partitions(engine.module, self._ctx)
            check_shard_marks(engine.module, float(engine.gradient_clipping() or 0.0), self._ctx)
            _check_stage_norm(
                engine,
                self._ctx,
                "ZeRO stage 1 or 2 (their norm counts them on tensor rank 0 of every stage)",
            )
        return group


def mpu(ctx: Any = None) -> DeepSpeedMPU:
    """Return the object to pass as ``deepspeed.initialize(..., mpu=...)``, on gpc's groups.

    Args:
        ctx: the parallel context (default: ``gpc``).

    Returns:
        A :class:`DeepSpeedMPU` answering from ``ctx`` (table in the module docstring).

    Raises:
        NotLaunchedError: the context is not launched (launch gpc before ``deepspeed.initialize``).
    """
    ctx = _context(ctx)
    ctx.get_global_rank()  # raises NotLaunchedError, naming the fix, before DeepSpeed sees the object
    return DeepSpeedMPU(ctx)


def _context(ctx: Any) -> Any:
    """``ctx``, or gpc when it is None."""
    if ctx is None:
        from .context import gpc

        return gpc
    return ctx


def _engine_being_built(depth: int = 4) -> Any:
    """The ``DeepSpeedEngine`` whose ``_configure_distributed_model`` called the mpu, or None.

    DeepSpeed hands the mpu no model; the engine under construction (its ``module`` already set)
    is the ``self`` of that method a frame or two up (DeepSpeed 0.19.8). Anywhere else (a user's
    call, a later call of the engine, DeepSpeed not imported) there is none and nothing is checked.
    """
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    if engine_module is None:
        return None
    frame = sys._getframe(1).f_back  # skip this function and the mpu method
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "_configure_distributed_model":
            engine = frame.f_locals.get("self")
            if isinstance(engine, engine_module.DeepSpeedEngine) and "module" in engine.__dict__:
                return engine
        frame = frame.f_back
    return None


def _ranks_text(ranks: list[int]) -> str:
    """``ranks`` for a message: whole up to 16, else the first 8 and the count."""
    if len(ranks) <= 16:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:8]))}, ...] ({len(ranks)} ranks)"


def check_zero_partitions(model: torch.nn.Module, ctx: Any = None) -> None:
    """Check that ZeRO-3 partitions every parameter of ``model`` over gpc's data × context group.

    ZeRO-3 all-gathers a parameter and reduce-scatters its gradient over the group it was built
    in (``param.ds_process_group``, set by ``deepspeed.zero.Init``); a parameter built without
    ``zero.Init`` is partitioned by ``deepspeed.initialize`` over ``mpu.get_data_parallel_group()``,
    gpc's DATA group, which leaves out the context ranks. DeepSpeed-MoE expert parameters
    (``param.allreduce = False``) keep their own groups and are not checked. DeepSpeed's engine
    runs this check itself under ZeRO-3 with ``mpu=parallelctx.deepspeed.mpu()``.

    Args:
        model: the model, after it was built (under :func:`zero_init` for ZeRO-3).
        ctx: the parallel context (default: ``gpc``).

    Raises:
        ZeroPartitionError: a parameter is partitioned over a group whose ranks are not this rank's
            data × context group, or, with context > 1, a parameter was not built under
            ``zero.Init``; the message names the parameter, the groups and the fix.
        NotLaunchedError: the context is not launched.
    """
    ctx = _context(ctx)
    want = sorted(ctx.get_ranks_in_group(M.DATA_CONTEXT))
    context = int(ctx.get_world_size(M.CONTEXT))
    for name, param in model.named_parameters():
        if getattr(param, "allreduce", True) is False:  # DeepSpeed-MoE: an expert's own groups
            continue
        group = getattr(param, "ds_process_group", None)
        if not hasattr(param, "ds_id") or group is None:
            if context > 1:
                raise ZeroPartitionError(
                    f"ZeRO-3 with context {context}: parameter {name!r} was not built under "
                    f"zero.Init, so DeepSpeed would partition it over gpc's data group "
                    f"{_ranks_text(sorted(ctx.get_ranks_in_group(M.DATA)))} and never reduce its "
                    f"gradient over the context ranks {_ranks_text(sorted(ctx.get_ranks_in_group(M.CONTEXT)))}"
                    f" (the context ranks drift apart); build the model under `{FIX}`"
                )
            continue
        ranks = sorted(dist.get_process_group_ranks(group))
        if ranks != want:
            raise ZeroPartitionError(
                f"ZeRO-3: parameter {name!r} is partitioned over ranks {_ranks_text(ranks)} (the "
                f"group zero.Init was given), not over gpc's data × context group "
                f"{_ranks_text(want)}, so its gradient would be reduced over the wrong ranks; build "
                f"the model under `{FIX}`, which partitions over gpc's data × context group"
            )


def check_shard_marks(model: torch.nn.Module, clipping: float, ctx: Any = None) -> None:
    """Check that every parameter of ``model`` that differs across gpc's tensor group carries
    Megatron's mark (``param.tensor_model_parallel = True``): DeepSpeed's gradient norm counts an
    unmarked parameter once, as a replica, so an unmarked shard makes the norm too small and
    every clipped step too large. DeepSpeed's engine runs it while it is built with
    ``mpu=parallelctx.deepspeed.mpu()`` (one small all-reduce over the tensor group); ZeRO-3's
    partitioned parameters and DeepSpeed-MoE's experts (``allreduce = False``) are left out.
    Returns None.

    Args:
        model: the engine's model.
        clipping: DeepSpeed's ``gradient_clipping``; 0 (off): a shard without the mark is only
            warned about (nothing reads the norm), else refused.

    Raises:
        ValueError: ``clipping`` > 0 and an unmarked parameter differs across the tensor group
            (named, with the fix; on every rank).
    """
    from .clip import check_marks

    ctx = _context(ctx)
    if ctx.get_world_size(M.TENSOR) <= 1:
        return
    named = [
        (n, p)
        for n, p in model.named_parameters()
        if not hasattr(p, "ds_id") and getattr(p, "allreduce", True) is not False
    ]
    try:
        check_marks([p for _, p in named], M.TENSOR, [repr(n) for n, _ in named])
    except ValueError as exc:
        if clipping > 0:
            raise ValueError(f"deepspeed.initialize with gradient_clipping={clipping:g}: {exc}") from None
        logger.warning("parallelctx: %s (gradient_clipping is off, so nothing reads that norm yet)", exc)


def _unmarked(param: torch.Tensor) -> bool:
    """Whether DeepSpeed's gradient norm takes ``param`` for a replica: no Megatron mark
    (``tensor_model_parallel`` / ``model_parallel``), not a DeepSpeed-MoE expert."""
    marked = getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False)
    return not marked and getattr(param, "allreduce", True) is not False


def _check_stage_norm(engine: Any, ctx: Any, fix: str) -> None:
    """Refuse a DeepSpeed engine whose clipped steps would leave the replicated parameters of every
    pipeline stage but the first out of the gradient norm; returns None.

    DeepSpeed 0.19.8 counts an unmarked parameter on *model-parallel* rank 0 alone under ZeRO-3
    (``stage3.py``) and in float32 without ZeRO (``runtime.utils.clip_grad_norm_``), and that
    group spans the pipeline stages (gpc's MODEL; a PipelineEngine's grid: pipe × model), so the
    replicated parameters of stages 1.. are never counted (ZeRO-1/2 and the bf16/fp16 optimizers
    count them on tensor rank 0 of every stage). One all-reduce of one flag over the world, only
    with clipping on, pipeline > 1 and one of the two; every rank raises the same error.

    Raises:
        ValueError: a stage other than the first holds an unmarked parameter; names the fix.
    """
    clipping = float(engine.gradient_clipping() or 0.0)
    pipeline = int(ctx.get_world_size(M.PIPELINE))
    if clipping <= 0 or pipeline <= 1:
        return
    if engine.zero_optimization_stage() == 3:
        how = "ZeRO-3"
    elif engine.zero_optimization_stage() == 0 and not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        how = "float32 without ZeRO"
    else:
        return
    mine = ctx.get_local_rank(M.PIPELINE) > 0 and any(_unmarked(p) for p in engine.module.parameters())
    flag = torch.tensor([float(mine)], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.get_group(M.GLOBAL))
    if flag.item() > 0:
        import deepspeed

        later = "stage 1" if pipeline == 2 else f"stages 1 to {pipeline - 1}"
        raise ValueError(
            f"DeepSpeed with gradient_clipping={clipping:g}, {how} and pipeline={pipeline}: DeepSpeed "
            f"{deepspeed.__version__} counts a parameter without the tensor_model_parallel mark in the "
            "gradient norm on model-parallel rank 0 alone, and the model-parallel group spans the "
            f"pipeline stages, so the replicated parameters of {later} are left out of the norm and "
            f"every clipped step is too large; use {fix}, or set gradient_clipping=0.0 (DeepSpeed "
            "clips at 1.0 where the key is absent)"
        )


def check_pipe_engine(engine: Any, ctx: Any = None) -> None:
    """Check a DeepSpeed ``PipelineEngine`` (what ``deepspeed.initialize`` returns for a
    ``PipelineModule``, which takes no ``mpu``, so the mpu's own checks never see it) against gpc:
    its topology is gpc's (:func:`check_pipe_topology`), every parameter that differs across the
    tensor group carries Megatron's mark (:func:`check_shard_marks`: refused with clipping, warned
    without), and, with pipeline > 1, clipping in float32 without ZeRO, where DeepSpeed 0.19.8's
    norm leaves out the replicated parameters of every stage but the first (docs/engines.md has
    what it costs), is refused. A collective call: every rank calls it, right after
    ``deepspeed.initialize``. Returns None.

    Args:
        engine: the ``deepspeed.runtime.pipe.engine.PipelineEngine``.
        ctx: the parallel context (default: ``gpc``).

    Raises:
        TypeError: ``engine`` is not a PipelineEngine (a plain DeepSpeed engine built with
            ``mpu=parallelctx.deepspeed.mpu()`` was checked while it was built).
        PipeTopologyError: the engine's topology places a rank elsewhere than gpc's layout.
        ValueError: an unmarked parameter differs across the tensor group and clipping is on; or
            clipping in float32 without ZeRO with pipeline > 1 (the fix: ``zero_optimization.stage=1``,
            whose norm counts every stage, or ``gradient_clipping=0.0``).
        NotLaunchedError: the context is not launched.
    """
    ctx = _context(ctx)
    module = sys.modules.get("deepspeed.runtime.pipe.engine")
    if module is None or not isinstance(engine, module.PipelineEngine):
        raise TypeError(
            f"check_pipe_engine({type(engine).__name__}): it checks the PipelineEngine deepspeed.initialize "
            "returns for a PipelineModule; an engine built with mpu=parallelctx.deepspeed.mpu() checks itself"
        )
    check_pipe_topology(engine.module.topology(), None, ctx)
    check_shard_marks(engine.module, float(engine.gradient_clipping() or 0.0), ctx)
    _check_stage_norm(
        engine, ctx, "zero_optimization.stage=1 (its norm counts them on tensor rank 0 of every stage)"
    )


def zero_init(
    config: Mapping[str, Any] | str | None = None,
    *,
    dtype: torch.dtype | None = None,
    ctx: Any = None,
    **kwargs: Any,
) -> Init:
    """Return ``deepspeed.zero.Init`` on gpc's data × context group: build a ZeRO-3 model under it.

    ``with parallelctx.deepspeed.zero_init(config): model = MyModel()`` partitions every parameter
    over gpc's DATA_CONTEXT group (the group DeepSpeed's engine reduces over, with or without
    context parallelism), reads ``config`` with ``mpu=mpu(ctx)`` as ``deepspeed.initialize`` will,
    and builds parameters of the dtype the config gives: bfloat16 with an enabled ``bf16``
    section, float16 with ``fp16``, float32 without either. ``dtype`` is checked against the
    config (or, with no config, makes one with that dtype) and never handed to ``zero.Init``,
    whose ``dtype=`` DeepSpeed 0.19.8 replaces with bfloat16 on a CPU without fp16 support.

    Args:
        config: the DeepSpeed config given to ``deepspeed.initialize`` (a dict or a file path);
            default: a minimal ZeRO-3 one.
        dtype: the parameters' dtype (``torch.float32``, ``torch.bfloat16`` or ``torch.float16``);
            default: the config's.
        ctx: the parallel context (default: ``gpc``).
        **kwargs: further ``deepspeed.zero.Init`` arguments (``module=``, ``remote_device=``...).

    Returns:
        The ``deepspeed.zero.Init`` context manager.

    Raises:
        TypeError: ``kwargs`` holds ``data_parallel_group``, ``sequence_data_parallel_group``,
            ``config_dict_or_path`` or ``mpu`` (zero_init sets them).
        ValueError: ``dtype`` is not one of the three, or differs from the config's; the config's ZeRO stage is not 3.
        ImportError: DeepSpeed is not installed (the optional extra ``deepspeed``).
        NotLaunchedError: the context is not launched.
        RuntimeError: DeepSpeed's ``zero.Init`` would build another dtype than the config's.
    """
    own = sorted(_SET_BY_ZERO_INIT & set(kwargs))
    if own:
        raise TypeError(
            f"zero_init() sets {', '.join(own)} itself (gpc's data × context group, its mpu, the "
            "config as its first argument); for another group call deepspeed.zero.Init directly"
        )
    if dtype is not None and dtype not in (torch.float32, *_SECTIONS):
        raise ValueError(
            f"zero_init(dtype={dtype}): ZeRO-3 builds torch.float32, torch.bfloat16 or torch.float16 parameters"
        )
    ctx = _context(ctx)
    unit = mpu(ctx)
    try:
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError as exc:
        raise ImportError(
            f"parallelctx.deepspeed.zero_init needs DeepSpeed ({exc}): install the optional extra "
            "'deepspeed' (docs/engines.md#deepspeed)"
        ) from None
    if config is None:
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
        if dtype in _SECTIONS:
            config[_SECTIONS[dtype]] = {"enabled": True}
    if isinstance(config, Mapping):
        config = copy.deepcopy(dict(config))  # DeepSpeed keeps (and may change) the dict it reads
    parsed = DeepSpeedConfig(copy.deepcopy(config), unit)
    stage = parsed.zero_optimization_stage
    if stage != 3:
        raise ValueError(
            f"zero_init(config) with zero_optimization.stage={stage}: zero.Init partitions every parameter "
            "as ZeRO-3 does, and a model built so cannot train under another stage; build the model "
            "plainly for stages 0-2 (docs/engines.md), or set zero_optimization.stage=3"
        )
    if "LOCAL_RANK" not in os.environ:  # zero.Init reads it (a bare KeyError otherwise)
        os.environ["LOCAL_RANK"] = str(ctx.local_rank)  # what a launcher sets: gpc's local rank
    gives = (
        torch.bfloat16
        if parsed.bfloat16_config.enabled
        else torch.float16
        if parsed.float16_config.enabled
        else torch.float32
    )
    if dtype is not None and dtype != gives:
        section = _SECTIONS.get(dtype)
        fix = f"enable its {section!r} section" if section else "drop its bf16 / fp16 section"
        raise ValueError(
            f"zero_init(dtype={dtype}): the config gives {gives} parameters, and deepspeed.initialize "
            f"trains with the same config; {fix}, or leave dtype out"
        )
    init = deepspeed.zero.Init(
        data_parallel_group=ctx.get_group(M.DATA_CONTEXT), config_dict_or_path=config, mpu=unit, **kwargs
    )
    if init.dtype != gives:
        raise RuntimeError(
            f"deepspeed.zero.Init would build {init.dtype} parameters where the config gives {gives} "
            f"(DeepSpeed {deepspeed.__version__}; parallelctx.deepspeed is tested with 0.19.8)"
        )
    return init


# ---------------------------------------------------------------------- PipelineModule topology
_PIPE_MODES = {"pipe": M.PIPELINE, "data": M.DATA, "model": M.TENSOR}
"""DeepSpeed's pipeline topology axes, and the gpc mode whose local rank each one is."""

PIPE_FIX = "PipelineModule(..., topology=parallelctx.deepspeed.pipe_topology())"
"""The recipe every PipelineModule refusal names (docs/engines.md#deepspeed)."""


def _coords(layout: Layout) -> dict[str, np.ndarray]:
    """Every rank's local rank in gpc's pipeline, data and tensor groups, by DeepSpeed axis."""
    out = {}
    for axis, mode in _PIPE_MODES.items():
        groups = layout.group_array(mode)
        coord = np.empty(layout.world_size, dtype=np.int64)
        coord[groups] = np.arange(groups.shape[1])  # members are listed in ascending rank
        out[axis] = coord
    return out


def pipe_axes(layout: Layout) -> tuple[list[str], list[int]]:
    """The axes (slowest first) and sizes of the DeepSpeed ``ProcessTopology`` that puts every
    rank of ``layout`` at gpc's pipeline, data and tensor ranks: ``pipe``, ``data``, ``model``
    in the reverse of gpc's order string (``order="tp-pp-dp"`` gives ``["data", "pipe",
    "model"]``). Torch-free rank algebra; checked on every rank, not assumed from the string.

    Returns:
        ``(axes, dims)`` for ``ProcessTopology(axes=axes, dims=dims)``.

    Raises:
        PipeTopologyError: context > 1 or gtp_remat > 1 (DeepSpeed's pipeline has no such axis,
            its data-parallel reduce would leave those ranks out), or no order of DeepSpeed's
            three axes gives gpc's ranks (a data axis split by another, e.g. HSDP's replicate
            placed apart from its shard); named with the fix.
    """
    extra = {"context": layout.context, "gtp_remat": layout.gtp_remat}
    extra = {k: v for k, v in extra.items() if v > 1}
    if extra:
        sizes = ", ".join(f"{k}={v}" for k, v in extra.items())
        raise PipeTopologyError(
            f"DeepSpeed's PipelineModule has axes pipe, data and model only; gpc's {sizes} has no place "
            "in it (its gradients would not be reduced over those ranks): run DeepSpeed's pipeline with "
            "context=1 and gtp_remat=1, or use torch.distributed.pipelining on gpc's groups "
            "(docs/engines.md#torchdistributedpipelining)"
        )
    want = _coords(layout)
    dims = {axis: layout.size(mode) for axis, mode in _PIPE_MODES.items()}
    ranks = np.arange(layout.world_size)
    for axes in itertools.permutations(_PIPE_MODES):
        shape = [dims[a] for a in axes]
        got = np.unravel_index(ranks, shape)
        if all(np.array_equal(got[i], want[a]) for i, a in enumerate(axes)):
            return list(axes), shape
    raise PipeTopologyError(
        f"no order of DeepSpeed's pipe, data and model axes places the ranks as gpc's layout "
        f"({layout.describe()}) does: its data axis is not one stride (HSDP's replicate apart from its "
        "shard in the order string); give parallel.order the data axis in one piece"
    )


def pipe_topology(ctx: Any = None) -> ProcessTopology:
    """DeepSpeed's ``ProcessTopology`` for gpc's layout (:func:`pipe_axes`): pass it as
    ``PipelineModule(..., topology=...)`` so that DeepSpeed's stages, data-parallel groups and
    tensor slices are gpc's pipeline, data and tensor groups, whatever gpc's order.

    Returns:
        ``deepspeed.runtime.pipe.topology.ProcessTopology``.

    Raises:
        NotLaunchedError: the context is not launched.
        PipeTopologyError: from :func:`pipe_axes`.
        ImportError: DeepSpeed is not installed (the ``deepspeed`` extra).
    """
    from deepspeed.runtime.pipe.topology import ProcessTopology

    ctx = _context(ctx)
    ctx.get_global_rank()
    axes, dims = pipe_axes(ctx.launched.layout)
    return ProcessTopology(axes=axes, dims=dims)


def check_pipe_topology(topology: Any, num_stages: int | None, ctx: Any = None) -> None:
    """Check that a ``PipelineModule`` built with ``topology`` (or, when it is None, DeepSpeed's
    default for ``num_stages``: stages outermost, data innermost, no model axis) places every
    rank at gpc's pipeline, data and tensor ranks. parallelctx runs it when a PipelineModule is
    built after gpc launched (:mod:`parallelctx.engines.guard`); before launch or on one rank it
    checks nothing.

    Raises:
        PipeTopologyError: a rank whose stage, data-parallel rank or tensor slice differs from
            gpc's (named with both), a size that differs, or a layout :func:`pipe_axes` refuses.
    """
    ctx = _context(ctx)
    if not ctx.is_initialized(M.GLOBAL) or ctx.get_world_size(M.GLOBAL) <= 1:
        return
    layout = ctx.launched.layout
    pipe_axes(layout)  # refuses what DeepSpeed's pipeline cannot hold
    world = layout.world_size
    if topology is None:
        if num_stages is None or num_stages <= 0 or world % num_stages:
            return  # DeepSpeed refuses it itself
        axes, dims = ["pipe", "data"], [num_stages, world // num_stages]
        given = f"DeepSpeed's default for num_stages={num_stages} (axes {axes}, dims {dims})"
    else:
        axes, dims = list(topology.get_axis_names()), [topology.get_dim(a) for a in topology.get_axis_names()]
        given = f"the topology given (axes {axes}, dims {dims})"
    if int(np.prod(dims)) != world:
        return  # DeepSpeed's grid refuses a topology of another world size itself
    want = _coords(layout)
    got = np.unravel_index(np.arange(world), dims)
    for axis, mode in _PIPE_MODES.items():
        have = got[axes.index(axis)] if axis in axes else np.zeros(world, dtype=np.int64)
        bad = np.flatnonzero(have != want[axis])
        if bad.size:
            r = int(bad[0])
            raise PipeTopologyError(
                f"PipelineModule: {given} puts rank {r} at {axis} rank {int(have[r])}, but gpc's layout "
                f"({layout.describe()}) has it at {mode.value} rank {int(want[axis][r])}: stages, data-parallel "
                f"reduces or tensor slices would pair the wrong ranks; build it with `{PIPE_FIX}`"
            )
