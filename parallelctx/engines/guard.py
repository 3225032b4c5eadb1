"""The engines' own everyday calls that would train a wrong model under gpc's model
parallelism, made right or refused by name.

Accelerate, Lightning Fabric and Ray Train were written for data parallelism over every
process. Under tensor, pipeline or expert parallelism (or context parallelism, for data),
four of their calls go wrong without a word:

=========================  =====================================  ===========================
call                       what it does                           here
=========================  =====================================  ===========================
model wrapper              DDP over every process: broadcasts     Fabric (DDP strategy) and
                           rank 0's shard to every rank, then     Ray: DDP over gpc's data ×
                           averages different shards              context group; Accelerate:
                                                                  refused (no group option)
dataloader wrapper         a sampler over every process: the      refused, with the sampler
                           ranks of one tensor group read         to use
                           different rows
clip by norm               each rank's own shard norm: replicas   made right:
                           drift apart                            :func:`parallelctx.clip.clip_grad_norm_`
save / load                rank 0's file only: tensor rank 1      refused, naming
                           resumes from rank 0's shard            :func:`parallelctx.engines.save`
=========================  =====================================  ===========================

:class:`EngineGuard` replaces those methods on the engines' classes (only the engines already
imported when gpc launches; the engine made the default group first, so it is) and puts them
back at ``gpc.destroy()``; for Ray Train it replaces the two names its ``prepare_model`` and
``prepare_data_loader`` build with (``DistributedDataParallel``, ``DistributedSampler``) in Ray's
own modules, which covers Train V1 and V2 and names bound before the launch. Each replacement
reads the context at call time and does what the engine does when the layout has nothing to
fear (data parallelism alone).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..clip import clip_grad_norm_ as whole
from ..guard.patch import Patches
from ..planning.layout import ParallelMode

__all__ = ["EngineGuard", "EngineMisuseError"]

M = ParallelMode

DDP_RECIPE = (
    "wrap the model yourself: torch.nn.parallel.DistributedDataParallel(model, "
    "process_group=gpc.get_group(ParallelMode.DATA_CONTEXT))"
)
SAMPLER_RECIPE = (
    "give the DataLoader torch.utils.data.DistributedSampler(dataset, num_replicas=gpc.data.size, "
    "rank=gpc.data.rank) yourself (the ranks of one tensor, pipeline or context group read the same rows)"
)
SAVE_RECIPE = (
    "save and load with parallelctx.engines.save(path, model, optimizer) / "
    "parallelctx.engines.load(path, model, optimizer), which keep every model-parallel shard"
)


class EngineMisuseError(RuntimeError):
    """An engine's call would train or save a wrong model under gpc's layout; the message
    names the call, the layout and the recipe."""


def _sizes(ctx: Any, modes: tuple[ParallelMode, ...]) -> str:
    """``tensor=2, pipeline=2``: the modes among ``modes`` whose size is above 1 ('' if none)."""
    return ", ".join(f"{m.value}={ctx.get_world_size(m)}" for m in modes if ctx.get_world_size(m) > 1)


def model_parallel(ctx: Any) -> str:
    """The model-parallel sizes above 1 (tensor, pipeline, expert) as text; '' when every rank
    holds the whole model (or gpc is not launched)."""
    if not ctx.is_initialized(M.GLOBAL):
        return ""
    return _sizes(ctx, (M.TENSOR, M.PIPELINE, M.EXPERT))


def not_data_alone(ctx: Any) -> str:
    """The sizes that make gpc's data group smaller than the world (tensor, pipeline, context,
    expert is within data), as text; '' when the data group is the world."""
    if not ctx.is_initialized(M.GLOBAL) or ctx.get_world_size(M.DATA) == ctx.get_world_size(M.GLOBAL):
        return ""
    return _sizes(ctx, (M.TENSOR, M.PIPELINE, M.CONTEXT))


class EngineGuard:
    """The replaced engine methods of one launch (see the module docstring)."""

    def __init__(self) -> None:
        self._patches = Patches()

    def __bool__(self) -> bool:
        """Whether any engine method is replaced now."""
        return bool(self._patches)

    def install(self, ctx: Any) -> None:
        """Replace the methods of every engine imported now, for ``ctx`` (the parallel context,
        read at each call); returns None. Idempotent: a second call first puts back the first's."""
        self.restore()
        if "accelerate" in sys.modules:
            self._accelerate(ctx)
        for name in ("lightning_fabric", "lightning.fabric"):
            if name in sys.modules:
                self._fabric(ctx, sys.modules[name])
        if "ray.train.torch" in sys.modules or "ray.train.torch.train_loop_utils" in sys.modules:
            self._ray(ctx)
        if "deepspeed.runtime.pipe.module" in sys.modules:
            self._deepspeed(ctx)

    def restore(self) -> None:
        """Put every replaced method back; returns None."""
        self._patches.restore()

    # ------------------------------------------------------------------ helpers
    def _wrap(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        if name in vars(owner) or hasattr(owner, name):

            def build(current: Callable[..., Any]) -> Callable[..., Any]:
                return functools.wraps(current)(make(current))

            self._patches.replace(owner, name, build)

    def _refuse(
        self, owner: type, name: str, when: Callable[[Any], str], ctx: Any, why: str, fix: str
    ) -> None:
        call = f"{owner.__name__}.{name}"

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def refusing(*args: Any, **kwargs: Any) -> Any:
                sizes = when(ctx)
                if sizes:
                    raise EngineMisuseError(f"{call}() under gpc's {sizes}: {why}; {fix}")
                return original(*args, **kwargs)

            return refusing

        self._wrap(owner, name, make)

    # ------------------------------------------------------------------ Accelerate
    def _accelerate(self, ctx: Any) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DistributedType

        wrapper = "it wraps the model in DDP over every process, whose first broadcast gives every rank rank 0's shard"

        def make_model(original: Callable[..., Any]) -> Callable[..., Any]:
            def prepare_model(
                self: Any, model: Any, device_placement: Any = None, evaluation_mode: bool = False
            ) -> Any:
                sizes = model_parallel(ctx)
                if sizes and not evaluation_mode:
                    raise EngineMisuseError(
                        f"Accelerator.prepare(model) under gpc's {sizes}: {wrapper}; {DDP_RECIPE}, and pass "
                        "accelerator.prepare only the optimizer, scheduler and dataloaders"
                    )
                return original(
                    self, model, device_placement=device_placement, evaluation_mode=evaluation_mode
                )

            return prepare_model

        self._wrap(Accelerator, "prepare_model", make_model)
        self._refuse(
            Accelerator,
            "prepare_data_loader",
            not_data_alone,
            ctx,
            "it shards the batches over every process",
            SAMPLER_RECIPE + ", and do not pass the DataLoader to accelerator.prepare",
        )

        def make_clip(original: Callable[..., Any]) -> Callable[..., Any]:
            def clip_grad_norm_(self: Any, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
                plain = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
                if not model_parallel(ctx) or self.distributed_type not in plain:
                    return original(self, parameters, max_norm, norm_type)
                self.unscale_gradients()
                return whole(list(parameters), max_norm, norm_type)

            return clip_grad_norm_

        self._wrap(Accelerator, "clip_grad_norm_", make_clip)
        rank0 = "Accelerate writes (and reads back) rank 0's files only, so the other shards are lost"
        for name in ("save_state", "load_state", "save_model"):
            self._refuse(Accelerator, name, model_parallel, ctx, rank0, SAVE_RECIPE)

    # ------------------------------------------------------------------ Lightning Fabric
    def _fabric(self, ctx: Any, module: Any) -> None:
        fabric = module.Fabric
        strategies = sys.modules.get(module.__name__ + ".strategies")
        ddp = getattr(strategies, "DDPStrategy", None)

        @contextlib.contextmanager
        def data_group(strategy: Any) -> Iterator[None]:
            """DDP over gpc's data × context group for the body, where Fabric's strategy is DDP."""
            sizes = model_parallel(ctx)
            if not sizes:
                yield
                return
            if ddp is None or not isinstance(strategy, ddp):
                raise EngineMisuseError(
                    f"Fabric.setup under gpc's {sizes} with the {type(strategy).__name__}: parallelctx makes "
                    f"only Fabric's DDP strategy use gpc's data group; use strategy='ddp', or {DDP_RECIPE}"
                )
            want = ctx.get_group(M.DATA_CONTEXT)
            kwargs = strategy._ddp_kwargs
            given = kwargs.get("process_group")
            if given is not None:
                import torch.distributed as dist

                if dist.get_process_group_ranks(given) != ctx.get_ranks_in_group(M.DATA_CONTEXT):
                    raise EngineMisuseError(
                        f"Fabric's DDPStrategy(process_group=...) has ranks {dist.get_process_group_ranks(given)}, "
                        f"but this rank's data × context group under gpc's {sizes} is "
                        f"{ctx.get_ranks_in_group(M.DATA_CONTEXT)}; give it gpc.get_group(ParallelMode.DATA_CONTEXT)"
                    )
                yield
                return
            strategy._ddp_kwargs = {**kwargs, "process_group": want}
            try:
                yield
            finally:
                strategy._ddp_kwargs = kwargs

        for name in ("setup", "setup_module"):

            def make_setup(original: Callable[..., Any]) -> Callable[..., Any]:
                def setup(self: Any, *args: Any, **kwargs: Any) -> Any:
                    with data_group(self.strategy):
                        return original(self, *args, **kwargs)

                return setup

            self._wrap(fabric, name, make_setup)

        def make_loaders(original: Callable[..., Any]) -> Callable[..., Any]:
            def setup_dataloaders(
                self: Any, *loaders: Any, use_distributed_sampler: bool = True, **kwargs: Any
            ) -> Any:
                sizes = not_data_alone(ctx)
                if sizes and use_distributed_sampler:
                    raise EngineMisuseError(
                        f"Fabric.setup_dataloaders() under gpc's {sizes}: its sampler shards the rows over every "
                        f"process; {SAMPLER_RECIPE}, and pass use_distributed_sampler=False"
                    )
                return original(self, *loaders, use_distributed_sampler=use_distributed_sampler, **kwargs)

            return setup_dataloaders

        self._wrap(fabric, "setup_dataloaders", make_loaders)

        def make_clip(original: Callable[..., Any]) -> Callable[..., Any]:
            def clip_gradients(
                self: Any,
                module: Any,
                optimizer: Any,
                clip_val: float | None = None,
                max_norm: float | None = None,
                norm_type: float = 2.0,
                error_if_nonfinite: bool = True,
            ) -> Any:
                plain = ddp is not None and isinstance(self.strategy, ddp)
                if max_norm is None or clip_val is not None or not model_parallel(ctx) or not plain:
                    return original(
                        self, module, optimizer, clip_val, max_norm, norm_type, error_if_nonfinite
                    )
                opt = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper
                self.strategy.precision.unscale_gradients(opt)
                params = list(self.strategy.precision.main_params(opt))
                return whole(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

            return clip_gradients

        self._wrap(fabric, "clip_gradients", make_clip)
        rank0 = "Fabric's DDP strategy writes rank 0's file only and every rank loads it, so the other shards are lost"
        for name in ("save", "load"):
            self._refuse(fabric, name, model_parallel, ctx, rank0, SAVE_RECIPE)

    # ------------------------------------------------------------------ DeepSpeed
    def _deepspeed(self, ctx: Any) -> None:
        """DeepSpeed's ``PipelineModule`` builds its own topology (and refuses ``mpu=``): one that
        places the ranks elsewhere than gpc's layout is refused when it is built
        (:func:`parallelctx.deepspeed.check_pipe_topology`)."""
        from deepspeed.runtime.pipe.module import PipelineModule

        from ..deepspeed import check_pipe_topology

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(
                self: Any,
                layers: Any,
                num_stages: Any = None,
                topology: Any = None,
                *args: Any,
                **kwargs: Any,
            ) -> None:
                check_pipe_topology(topology, num_stages, ctx)
                original(self, layers, num_stages, topology, *args, **kwargs)

            return __init__

        self._wrap(PipelineModule, "__init__", make)

    # ------------------------------------------------------------------ Ray Train
    def _ray(self, ctx: Any) -> None:
        """Ray Train's ``prepare_model`` (V1 ``_TorchAccelerator`` and V2 module function alike)
        builds ``DistributedDataParallel(model, **kwargs)`` and ``prepare_data_loader`` a
        ``DistributedSampler(dataset)`` by the names its module imported: those two names are
        replaced in each Ray module that holds them, so every way to reach them (including a
        ``from ray.train.torch import prepare_model`` made before the launch) is covered."""
        for name in ("ray.train.torch.train_loop_utils", "ray.train.v2.torch.train_loop_utils"):
            module = sys.modules.get(name)
            if module is None:
                continue
            if hasattr(module, "DistributedDataParallel"):
                self._patches.replace(module, "DistributedDataParallel", lambda ddp: _ray_ddp(ddp, ctx))
            if hasattr(module, "DistributedSampler"):
                self._patches.replace(
                    module, "DistributedSampler", lambda sampler: _ray_sampler(sampler, ctx)
                )
        torch_module = sys.modules.get("ray.train.torch")
        for owner in (
            torch_module,
            sys.modules.get("ray.train.torch.train_loop_utils"),
            sys.modules.get("ray.train.v2.torch.train_loop_utils"),
        ):
            if owner is not None and callable(getattr(owner, "prepare_model", None)):
                self._wrap(owner, "prepare_model", lambda original: _ray_no_fsdp(original, ctx))


def _ray_ddp(ddp: Callable[..., Any], ctx: Any) -> Callable[..., Any]:
    """Ray's DDP constructor, given gpc's data × context group under model parallelism."""

    def distributed_data_parallel(module: Any, *args: Any, **kwargs: Any) -> Any:
        sizes = model_parallel(ctx)
        if sizes:
            import torch.distributed as dist

            want = ctx.get_ranks_in_group(M.DATA_CONTEXT)
            given = kwargs.get("process_group")
            if given is None:
                kwargs["process_group"] = ctx.get_group(M.DATA_CONTEXT)
            elif dist.get_process_group_ranks(given) != want:
                raise EngineMisuseError(
                    "ray.train.torch.prepare_model(parallel_strategy_kwargs={'process_group': ...}) has ranks "
                    f"{dist.get_process_group_ranks(given)}, but this rank's data × context group under gpc's "
                    f"{sizes} is {want}; give it gpc.get_group(ParallelMode.DATA_CONTEXT) or leave it out "
                    "(parallelctx then gives it)"
                )
        return ddp(module, *args, **kwargs)

    return distributed_data_parallel


def _ray_sampler(sampler: type, ctx: Any) -> type:
    """Ray's DistributedSampler name: a subclass that refuses to be built (Ray builds one over
    every worker) when gpc's data group is smaller than the world; ``isinstance`` answers as
    for the original, so a user's own DistributedSampler is still recognised and kept."""

    class _Meta(type(sampler)):  # type: ignore[misc]
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, sampler)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, sampler)

    class GuardedDistributedSampler(sampler, metaclass=_Meta):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            sizes = not_data_alone(ctx)
            if sizes:
                raise EngineMisuseError(
                    f"ray.train.torch.prepare_data_loader() under gpc's {sizes}: its sampler shards the rows "
                    f"over every worker; {SAMPLER_RECIPE}, and pass add_dist_sampler=False"
                )
            super().__init__(*args, **kwargs)

    return GuardedDistributedSampler


def _ray_no_fsdp(original: Callable[..., Any], ctx: Any) -> Callable[..., Any]:
    """Ray's ``prepare_model``, refusing ``parallel_strategy='fsdp'`` under model parallelism."""

    def prepare_model(*args: Any, **kwargs: Any) -> Any:
        sizes = model_parallel(ctx)
        strategy = kwargs.get("parallel_strategy", args[2] if len(args) > 2 else "ddp")
        if sizes and strategy == "fsdp":
            raise EngineMisuseError(
                f"ray.train.torch.prepare_model(parallel_strategy='fsdp') under gpc's {sizes}: FSDP over every "
                "worker would shard across model-parallel ranks; shard with FSDP2 on gpc.device_mesh, or "
                "use parallel_strategy='ddp'"
            )
        return original(*args, **kwargs)

    return prepare_model
