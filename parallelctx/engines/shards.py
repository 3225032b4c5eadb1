"""Save and resume a model and its optimizer under gpc's model parallelism, with every shard.

The engines' own checkpoints (Accelerate's ``save_state``, Fabric's ``save``) write what rank 0
holds; under tensor or pipeline parallelism that is one shard of the model, and on resume every
rank reads it. :func:`save` and :func:`load` use ``torch.distributed.checkpoint`` (DCP) over the
whole world, under keys that name the model-parallel coordinates of the rank that holds each
shard (``tp1.pp0.ep0.etp0.gtp0.egtp0/model/w1``): every shard is written once, the data and
context replicas of the same shard share one copy (DCP's own deduplication: one replica's values,
so replicas must be equal, as data parallelism keeps them), and each rank reads back exactly its
own. The state dicts are torch's (``torch.distributed.checkpoint.state_dict``: a DDP wrapper's
``module.`` prefix and the optimizer's parameter ids become names). The model-parallel sizes are saved too:
a resume under others is refused by name instead of loading the wrong shards; data, context and
the order may change.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..context import gpc
from ..planning.layout import Layout, ParallelMode

__all__ = ["load", "save", "shard_key"]

M = ParallelMode
_LAYOUT = "parallelctx.layout"

# The axes that cut the model: a rank's coordinates on them name its shard. Data and context
# ranks hold copies of the same shard (the keys leave them out, so a resume may change them).
_SHARD_AXES = (
    ("tp", M.TENSOR, "tensor"),
    ("pp", M.PIPELINE, "pipeline"),
    ("ep", M.EXPERT, "expert"),
    ("etp", M.EXPERT_TENSOR, "expert_tensor"),
    ("gtp", M.GTP_REMAT, "gtp_remat"),
    ("egtp", M.EXPERT_GTP_REMAT, "expert_gtp_remat"),
)


def shard_key() -> str:
    """This rank's coordinates on every axis that cuts the model, as a key:
    ``tp{t}.pp{p}.ep{e}.etp{x}.gtp{g}.egtp{h}`` (tensor, pipeline, expert, expert-tensor,
    gtp_remat and expert gtp_remat ranks). The data and context replicas of a shard share it.

    Raises:
        NotLaunchedError: gpc is not launched.
    """
    rank, layout = gpc.get_global_rank(), _layout()
    return ".".join(f"{short}{layout.local_rank(mode, rank)}" for short, mode, _ in _SHARD_AXES)


def _layout() -> Layout:
    """gpc's layout. Raises NotLaunchedError before launch."""
    gpc.get_global_rank()
    layout = gpc.launched.layout
    if layout is None:
        raise RuntimeError("gpc is launched without a layout; parallelctx.engines.save/load need one")
    if gpc.launched.plan is not None:
        raise RuntimeError(
            "parallelctx.engines.save/load do not take a job with parallel.modules yet: the modules' "
            "shards would share keys and one module's weights would load into another's model; save "
            "each module's model with torch.distributed.checkpoint under a path of its own"
        )
    return layout


def _layout_text() -> str:
    """The sizes of the axes that cut the model (what a resume must keep; data, context and the
    order may change: the keys are coordinates, not global ranks)."""
    layout = _layout()
    return " ".join(f"{name}={getattr(layout, name)}" for _, _, name in _SHARD_AXES)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside Lightning Fabric's wrapper (``fabric.setup``'s ``_FabricModule``
    names its parameters ``_forward_module.module.w1`` but its state dict ``w1``: torch's state
    dict helpers would save under one name and look for the other); any other module as it is."""
    inner = getattr(model, "_original_module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    model = _unwrap(model)
    if optimizer is None:
        model_sd, _ = get_state_dict(model, [])
        return {"model": model_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _agree(problem: str, path: str) -> None:
    """Every rank learns whether any rank found a ``problem`` ('' for none) before the DCP
    collectives start, and all raise together (one all-reduce over the world's CPU group): a rank
    that fails alone would leave the others waiting in DCP for the whole timeout.

    Raises:
        ValueError: this rank's problem, or the lowest failing rank's number and the path.
    """
    flag = torch.tensor([float(gpc.get_global_rank()) if problem else float("inf")])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=gpc.get_cpu_group(M.GLOBAL))
    if problem:
        raise ValueError(problem)
    if flag.item() != float("inf"):
        raise ValueError(f"rank {int(flag.item())} could not use the checkpoint at {path} (it says why)")


def save(
    path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Write ``model``'s (and ``optimizer``'s) state of every rank to the folder ``path``; every
    rank of the world calls it (a collective over the default group). Returns None.

    Raises:
        NotLaunchedError: gpc is not launched.
        ValueError: on every rank, when the state of some rank's model or optimizer could not be
            read (that rank names its error).
        Whatever ``torch.distributed.checkpoint.save`` raises (a folder it cannot write).
    """
    where = os.fspath(path)
    problem, state = "", {}
    try:
        state = {shard_key(): _state(model, optimizer), _LAYOUT: _layout_text()}
    except Exception as exc:  # every rank must hear of it before DCP's collectives
        problem = f"parallelctx.engines.save({where!r}): this rank's state could not be read: {exc!r}"
    _agree(problem, where)
    dcp.save(state, checkpoint_id=where)


def load(
    path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Read this rank's shard of the model (and the optimizer's state) from the folder ``path``
    written by :func:`save`, into ``model`` and ``optimizer`` in place; every rank of the world
    calls it. The sizes of the axes that cut the model (tensor, pipeline, expert, gtp_remat)
    must be the saved ones; data, context and the order may differ. Returns None.

    Raises:
        NotLaunchedError: gpc is not launched.
        ValueError: on every rank: some rank cannot read ``path``, it was not written by
            :func:`save`, it was saved under other model-parallel sizes (both named), or it holds
            no optimizer state and ``optimizer`` was given.
        Whatever ``torch.distributed.checkpoint.load`` raises (a missing key).
    """
    where, key = os.fspath(path), shard_key()
    problem, saved = "", None
    try:
        metadata = dcp.FileSystemReader(where).read_metadata().state_dict_metadata
        saved = metadata.get(_LAYOUT)
        if saved is None:
            problem = f"{where} was not written by parallelctx.engines.save (no layout in it)"
        elif optimizer is not None and not any(k.startswith(f"{key}.optim") for k in metadata):
            problem = (
                f"the checkpoint at {where} holds no optimizer state (it was saved without one): "
                "load it with parallelctx.engines.load(path, model), or save with the optimizer"
            )
    except Exception as exc:
        problem = f"parallelctx.engines.load({where!r}): {exc!r}"
    _agree(problem, where)
    mine = {_LAYOUT: ""}
    dcp.load(mine, checkpoint_id=where)
    if mine[_LAYOUT] != _layout_text():
        raise ValueError(
            f"the checkpoint at {where} was saved with {mine[_LAYOUT]!r}, and this job runs "
            f"{_layout_text()!r}: its shards do not fit; resume with the saved model-parallel sizes "
            "(data, context and the order may change)"
        )
    state = {key: _state(model, optimizer)}
    dcp.load(state, checkpoint_id=where)
    loaded, model = state[key], _unwrap(model)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=loaded["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
