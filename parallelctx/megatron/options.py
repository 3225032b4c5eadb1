"""``initialize_model_parallel``'s keyword options, checked against gpc's launch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..context import gpc
from ..planning.layout import Layout, ParallelMode
from .release import Release

__all__ = ["Options", "parse_options"]


@dataclass(frozen=True)
class Options:
    """The options of Megatron's ``initialize_model_parallel`` that change the installed state."""

    virtual: int | None = None
    all_gather: bool = False
    hierarchical_cp: tuple[int, ...] = ()
    hybrid_cp: bool = False
    gloo: bool = True
    gtp: bool = False  # gtp_remat_size > 1: Megatron 0.19 makes no gloo groups then
    egtp: bool = False  # expert_gtp_remat_size > 1: no expert gloo groups


# Options that only exist to set NCCL communicator properties at group creation: gpc's groups
# are made at launch, so only Megatron's default is accepted.
_REFUSED_UNLESS_DEFAULT: dict[str, tuple[Any, str]] = {
    "use_sharp": (
        False,
        "SHARP must be enabled (NCCL_COLLNET_ENABLE) when the data-parallel communicator is created, "
        "and gpc's groups are made at launch",
    ),
    "sharp_enabled_group": (None, "it only applies with use_sharp=True, which is not supported"),
    "nccl_communicator_config_path": (
        None,
        "per-group NCCL communicator options (min_ctas, max_ctas, cga_cluster_size) must be given when "
        "a group is created, and gpc's groups are made at launch with the default options",
    ),
    "high_priority_stream_groups": (
        None,
        "NCCL stream priority is a communicator option set when a group is created, and gpc's groups "
        "are made at launch with the default options",
    ),
}


def _option_error(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"install({name}={value!r}) is not supported: {why}")


def _check_same(name: str, value: Any, mine: Any, key: str) -> None:
    if value != mine:
        raise ValueError(
            f"install({name}={value!r}) differs from gpc's {key}={mine!r}: the groups come from gpc's "
            f"launch; set {key} in the config, or drop {name}"
        )


def parse_options(layout: Layout, options: dict[str, Any], release: Release) -> Options:
    """Validate ``install``'s keyword options against gpc's launch and the installed release's
    ``initialize_model_parallel`` (docs/migration.md's table).

    Returns:
        The options that shape the installed state.

    Raises:
        TypeError: an option the installed release's ``initialize_model_parallel`` does not have.
        ValueError: an option refused, or one that contradicts gpc's layout; the message names
            it and says why.
    """
    unknown = sorted(set(options) - set(release.options))
    if unknown:
        raise TypeError(
            f"install() got unknown options {unknown}: megatron-core {release.version}'s "
            f"initialize_model_parallel has no such option; its options: {', '.join(release.options)}"
        )
    get = options.get
    sizes = {
        "tensor_model_parallel_size": (layout.tensor, "parallel.tensor"),
        "pipeline_model_parallel_size": (layout.pipeline, "parallel.pipeline"),
        "context_parallel_size": (layout.context, "parallel.context"),
        "expert_model_parallel_size": (layout.expert, "parallel.expert.size"),
        "gtp_remat_size": (layout.gtp_remat, "parallel.gtp_remat"),
        "expert_gtp_remat_size": (layout.expert_gtp_remat, "parallel.expert.gtp_remat"),
    }
    for name, (mine, key) in sizes.items():
        if name in options:
            _check_same(name, options[name], mine, key)
    if "expert_tensor_parallel_size" in options:
        etp = options["expert_tensor_parallel_size"]
        _check_same(
            "expert_tensor_parallel_size",
            layout.tensor if etp is None else etp,
            layout.expert_tensor,
            "parallel.expert.tensor",
        )
    if "order" in options:
        order = options["order"]
        try:
            theirs = Layout(
                layout.world_size,
                layout.tensor,
                layout.pipeline,
                layout.context,
                layout.expert,
                layout.expert_tensor,
                order,
                layout.replicate,
                layout.gtp_remat,
                layout.expert_gtp_remat,
            ).to_dict()
        except ValueError as exc:
            raise ValueError(
                f"install(order={order!r}) is not a valid order for gpc's sizes: {exc}"
            ) from None
        if theirs != layout.to_dict():
            raise ValueError(
                f"install(order={order!r}) gives other groups than gpc's parallel.order={layout.order!r}; "
                "set parallel.order in the config, or drop order"
            )
    if "distributed_timeout_minutes" in options:
        minutes = options["distributed_timeout_minutes"]
        timeout = gpc.config.dist.timeout
        if minutes is None or timedelta(minutes=minutes) != timeout:
            raise ValueError(
                f"install(distributed_timeout_minutes={minutes!r}) differs from gpc's dist.timeout={timeout}: "
                "the groups use gpc's timeout; set dist.timeout in the config, or drop the option"
            )
    backend = get("pipeline_model_parallel_comm_backend")
    if backend is not None and backend != str(dist.get_backend()):
        raise _option_error(
            "pipeline_model_parallel_comm_backend",
            backend,
            f"the pipeline groups are gpc's, on its backend {dist.get_backend()!r}; a separate backend "
            "for pipeline communication (e.g. 'ucc') needs groups parallelctx does not make",
        )
    for name, (default, why) in _REFUSED_UNLESS_DEFAULT.items():
        value = get(name, default)
        if value != default and not (name == "high_priority_stream_groups" and value == []):
            raise _option_error(name, value, why)
    offset = get("rank_offset", 0)
    if offset != 0:
        raise _option_error(
            "rank_offset",
            offset,
            "it shifts Megatron's groups onto a sub-world starting at that rank (e.g. a second model "
            "on other ranks), and gpc's groups cover the whole world from rank 0; use 0",
        )
    local_world = get("local_world_size")
    if local_world is not None and local_world != layout.world_size:
        raise _option_error(
            "local_world_size",
            local_world,
            f"gpc's groups span its whole world of {layout.world_size} ranks; give None or {layout.world_size}",
        )
    instances = get("num_distributed_optimizer_instances", 1)
    if instances != 1:
        raise _option_error(
            "num_distributed_optimizer_instances",
            instances,
            "several distributed-optimizer instances need the data axis split into replicate x shard "
            "groups, which gpc does not make yet; use 1 (one instance spanning the data-parallel ranks)",
        )
    for name in ("get_embedding_ranks", "get_position_embedding_ranks"):
        fn = get(name)
        if fn is None:
            continue
        default = (
            ps.default_embedding_ranks
            if name == "get_embedding_ranks"
            else ps.default_position_embedding_ranks
        )
        pipes = layout.groups(ParallelMode.PIPELINE)
        if any(list(fn(pipe)) != list(default(pipe)) for pipe in pipes):
            raise _option_error(
                name,
                fn,
                "it picks other ranks than Megatron's default for some pipeline; custom embedding "
                "groups would need groups that span pipeline stages, which gpc makes only at launch "
                "(its EMBEDDING group holds the first and last stage)",
            )
    virtual = get("virtual_pipeline_model_parallel_size")
    if virtual is not None:
        if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={virtual!r} must be a positive integer or None"
            )
        if layout.pipeline < 2:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={virtual} needs a pipeline of size > 1, but "
                f"parallel.pipeline is {layout.pipeline}; drop it or configure a pipeline"
            )
    hierarchical = tuple(get("hierarchical_context_parallel_sizes") or ())
    if hierarchical:
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in hierarchical):
            raise ValueError(
                f"hierarchical_context_parallel_sizes={list(hierarchical)!r} must be positive integers"
            )
        if math.prod(hierarchical) != layout.context:
            raise ValueError(
                f"hierarchical_context_parallel_sizes={list(hierarchical)!r} multiply to "
                f"{math.prod(hierarchical)}, not to parallel.context={layout.context}; give sizes whose "
                "product is the context size"
            )
    hybrid = bool(get("hybrid_context_parallel", False))
    dp_cp = layout.data * layout.context
    if hybrid and dp_cp % 2:
        raise ValueError(
            f"hybrid_context_parallel=True needs an even number of data x context ranks, not {dp_cp}; "
            "change parallel.context or the world size, or drop the option"
        )
    return Options(
        virtual=virtual,
        all_gather=bool(get("create_all_gather_group", False)),
        hierarchical_cp=hierarchical,
        hybrid_cp=hybrid,
        gloo=bool(get("create_gloo_process_groups", True)),
        gtp=layout.gtp_remat > 1,
        egtp=layout.expert_gtp_remat > 1,
    )
