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

:class:`EngineGuard` replaces those methods on the engines' classes (the engines imported when
gpc launches, and an engine imported later while gpc is launched, as its import ends: an
import watch on ``sys.meta_path``) and puts them back at ``gpc.destroy()``; for Ray Train it
replaces the two names its ``prepare_model`` and ``prepare_data_loader`` build with
(``DistributedDataParallel``, ``DistributedSampler``) in Ray's own modules, which covers Train
V1 and V2 and names bound before the launch. Each replacement reads the context at call time
and does what the engine does when the layout has nothing to fear (data parallelism alone).

Under model parallelism Fabric's DDP strategy gets gpc's group and its one-device strategy is
left as it is (it wraps nothing); any other (FSDP, DeepSpeed, ...) is refused at ``setup``.
Fabric's ``setup_dataloaders`` keeps a loader's own ``DistributedSampler`` (the recipe's) and
refuses only the loaders it would give its own sampler over every process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from ..clip import clip_grad_norm_ as whole
from ..guard.patch import Patches
from ..planning.layout import ParallelMode

__all__ = ["WATCHED", "EngineGuard", "EngineMisuseError"]

M = ParallelMode

WATCHED = frozenset(
    {
        "accelerate",
        "lightning_fabric",
        "lightning.fabric",
        "ray.train.torch",
        "ray.train.torch.train_loop_utils",
        "ray.train.v2.torch.train_loop_utils",
        "deepspeed.runtime.pipe.module",
        "deepspeed.runtime.pipe.engine",
    }
)
"""The modules whose import (after gpc launched) makes the guard install again."""

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
    if not ctx.is_initialized(M.GLOBAL):
        return ""
    if ctx.launched.plan is not None:  # parallel.modules: the engine's world is the job's
        if ctx.get_world_size(M.DATA) == ctx.launched.world_size:
            return ""
        return (
            _sizes(ctx, (M.TENSOR, M.PIPELINE, M.CONTEXT))
            or f"module {ctx.launched.module} (not the whole job)"
        )
    if ctx.get_world_size(M.DATA) == ctx.get_world_size(M.GLOBAL):
        return ""
    return _sizes(ctx, (M.TENSOR, M.PIPELINE, M.CONTEXT))


class _ImportWatch(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while a guard is installed: when a module of :data:`WATCHED`
    is imported, ``on_import()`` runs as soon as its code has run (the engine's classes exist),
    so that an engine imported after gpc launched is guarded too. Finds nothing itself: the spec
    is the one the finders after it give."""

    def __init__(self, on_import: Callable[[], None]) -> None:
        self._on_import = on_import

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec the later finders give for ``fullname``, its loader made to call
        ``on_import()`` after the module ran, for a module of :data:`WATCHED`; None for any other
        (the import system asks the next finder)."""
        if fullname not in WATCHED:
            return None
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        # a file loader is one object per module: its exec_module can be wrapped for this import
        if isinstance(
            loader, (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)
        ):
            run = loader.exec_module

            def exec_module(module: ModuleType) -> None:
                vars(loader).pop("exec_module", None)  # the class's again
                run(module)
                self._on_import()

            vars(loader)["exec_module"] = exec_module
        return spec


class EngineGuard:
    """The replaced engine methods of one launch (see the module docstring)."""

    def __init__(self) -> None:
        self._patches = Patches()
        self._watch: _ImportWatch | None = None

    def __bool__(self) -> bool:
        """Whether any engine method is replaced now."""
        return bool(self._patches)

    def install(self, ctx: Any) -> None:
        """Replace the methods of every engine imported now, for ``ctx`` (the parallel context,
        read at each call), and watch the imports: an engine imported later while ``ctx`` is
        launched is guarded as its import ends. ``ctx.destroy()`` puts everything back
        (:meth:`restore`, added as its hook). Idempotent: a second call first puts back the
        first's methods. Returns None."""
        self._patches.restore()
        if "accelerate" in sys.modules:
            self._accelerate(ctx)
        for name in ("lightning_fabric", "lightning.fabric"):
            if name in sys.modules:
                self._fabric(ctx, sys.modules[name])
        if "ray.train.torch" in sys.modules or "ray.train.torch.train_loop_utils" in sys.modules:
            self._ray(ctx)
        if "deepspeed.runtime.pipe.module" in sys.modules:
            self._deepspeed(ctx)
        if self._watch is None:

            def on_import() -> None:
                if ctx.is_initialized(M.GLOBAL):
                    self.install(ctx)

            self._watch = _ImportWatch(on_import)
            sys.meta_path.insert(0, self._watch)
            # guard_engines adds the same hook (kept once) and, for a guard that replaced
            # something at the launch, a fresh guard after a reform; this one only watched
            again = None if self._patches else functools.partial(self.install, ctx)
            ctx.add_destroy_hook(self.restore, on_reform=again)

    def restore(self) -> None:
        """Put every replaced method back and stop watching the imports; returns None."""
        if self._watch is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self._watch)
            self._watch = None
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
        # the engines that measure the norm themselves (DeepSpeed through gpc's mpu); every other
        # type (one process, DDP on any device) clips by torch's norm of this rank's shard
        own_clip = {
            getattr(DistributedType, n)
            for n in ("DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM")
            if hasattr(DistributedType, n)
        }

        def make_model(original: Callable[..., Any]) -> Callable[..., Any]:
            def prepare_model(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
                # (model, device_placement=None, evaluation_mode=False)
                evaluation_mode = kwargs.get("evaluation_mode", args[1] if len(args) > 1 else False)
                sizes = model_parallel(ctx)
                if sizes and not evaluation_mode:
                    raise EngineMisuseError(
                        f"Accelerator.prepare(model) under gpc's {sizes}: {wrapper}; {DDP_RECIPE}, and pass "
                        "accelerator.prepare only the optimizer, scheduler and dataloaders"
                    )
                return original(self, model, *args, **kwargs)

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
                if not model_parallel(ctx) or self.distributed_type in own_clip:
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
        # Fabric's DeepSpeedStrategy is a DDPStrategy that neither builds torch's DDP nor clips
        not_ddp = tuple(c for c in (getattr(strategies, "DeepSpeedStrategy", None),) if c is not None)
        single = getattr(strategies, "SingleDeviceStrategy", None)

        def plain_ddp(strategy: Any) -> bool:
            return ddp is not None and isinstance(strategy, ddp) and not isinstance(strategy, not_ddp)

        def plain_grads(strategy: Any) -> bool:
            """Whether each rank holds its own gradients as plain tensors (DDP, one device):
            torch's clip then measures this rank's shard."""
            return plain_ddp(strategy) or (single is not None and isinstance(strategy, single))

        @contextlib.contextmanager
        def data_group(strategy: Any) -> Iterator[None]:
            """DDP over gpc's data × context group for the body, where Fabric's strategy is DDP;
            one device's strategy left as it is (it wraps nothing); any other refused."""
            sizes = model_parallel(ctx)
            if not sizes:
                yield
                return
            if single is not None and isinstance(strategy, single):
                yield  # no wrapper: the module stays this rank's
                return
            if not plain_ddp(strategy):
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
                # Fabric keeps a loader's own DistributedSampler; it replaces any other sampler
                from torch.utils.data import DistributedSampler

                replaced = [
                    i
                    for i, dl in enumerate(loaders)
                    if not isinstance(getattr(dl, "sampler", None), DistributedSampler)
                ]
                if sizes and use_distributed_sampler and replaced:
                    raise EngineMisuseError(
                        f"Fabric.setup_dataloaders() under gpc's {sizes}: the DataLoader at position {replaced} "
                        "has no DistributedSampler, and Fabric's sampler would shard its rows over every process; "
                        f"{SAMPLER_RECIPE} (Fabric keeps it), or pass use_distributed_sampler=False"
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
                if (
                    max_norm is None
                    or clip_val is not None
                    or not model_parallel(ctx)
                    or not plain_grads(self.strategy)
                ):
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
        (:func:`parallelctx.deepspeed.check_pipe_topology`), and the ``PipelineEngine``
        ``deepspeed.initialize`` builds for it is checked as it is built
        (:func:`parallelctx.deepspeed.check_pipe_engine`: marks, DeepSpeed's stage norm)."""
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
        engines = sys.modules.get("deepspeed.runtime.pipe.engine")
        if engines is not None:
            from ..deepspeed import check_pipe_engine

            def make_engine(original: Callable[..., Any]) -> Callable[..., Any]:
                def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                    original(self, *args, **kwargs)
                    check_pipe_engine(self, ctx)  # a PipelineModule's engine never asks gpc's mpu

                return __init__

            self._wrap(engines.PipelineEngine, "__init__", make_engine)

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
