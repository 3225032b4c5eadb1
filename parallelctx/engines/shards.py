"""Save and resume a model and its optimizer under gpc's model parallelism, with every shard.

The engines' own checkpoints (Accelerate's ``save_state``, Fabric's ``save``) write what rank 0
holds; under tensor or pipeline parallelism that is one shard of the model, and on resume every
rank reads it. :func:`save` and :func:`load` use ``torch.distributed.checkpoint`` (DCP) over the
whole world, under keys that name the model-parallel coordinates of the rank that holds each
shard (``tp1.pp0.ep0.etp1/model/w1``): every shard is written once, data-parallel replicas of
the same shard share one copy (DCP's own deduplication), and each rank reads back exactly its
own. The state dicts are torch's (``torch.distributed.checkpoint.state_dict``: a DDP wrapper's
``module.`` prefix and the optimizer's parameter ids become names). The layout is saved too: a
resume under another layout is refused by name instead of loading the wrong shards.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..context import gpc
from ..planning.layout import ParallelMode

__all__ = ["load", "save", "shard_key"]

M = ParallelMode
_LAYOUT = "parallelctx.layout"


def shard_key() -> str:
    """This rank's model-parallel coordinates as a key: ``tp{t}.pp{p}.ep{e}.etp{x}`` (tensor,
    pipeline, expert, expert-tensor ranks). Ranks that hold the same shard share it.

    Raises:
        NotLaunchedError: gpc is not launched.
    """
    ranks = [gpc.get_local_rank(m) for m in (M.TENSOR, M.PIPELINE, M.EXPERT, M.EXPERT_TENSOR)]
    return "tp{}.pp{}.ep{}.etp{}".format(*ranks)


def _layout_text() -> str:
    return f"{gpc.launched.layout}"


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


def save(
    path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Write ``model``'s (and ``optimizer``'s) state of every rank to the folder ``path``; every
    rank of the world calls it (a collective over the default group). Returns None.

    Raises:
        NotLaunchedError: gpc is not launched.
        Whatever ``torch.distributed.checkpoint.save`` raises (a folder it cannot write).
    """
    state = {shard_key(): _state(model, optimizer), _LAYOUT: _layout_text()}
    dcp.save(state, checkpoint_id=os.fspath(path))


def load(
    path: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Read this rank's shard of the model (and the optimizer's state) from the folder ``path``
    written by :func:`save`, into ``model`` and ``optimizer`` in place; every rank of the world
    calls it. Returns None.

    Raises:
        NotLaunchedError: gpc is not launched.
        ValueError: the checkpoint was saved under another layout (both named).
        Whatever ``torch.distributed.checkpoint.load`` raises (no such folder, a missing key).
    """
    reader = dcp.FileSystemReader(os.fspath(path))
    saved_layout = reader.read_metadata().state_dict_metadata.get(_LAYOUT)
    if saved_layout is None:
        raise ValueError(f"{os.fspath(path)} was not written by parallelctx.engines.save (no layout in it)")
    mine = {_LAYOUT: ""}
    dcp.load(mine, checkpoint_id=os.fspath(path))
    if mine[_LAYOUT] != _layout_text():
        raise ValueError(
            f"the checkpoint at {os.fspath(path)} was saved under the layout {mine[_LAYOUT]!r}, and this job "
            f"runs {_layout_text()!r}: its shards do not fit; resume with the saved layout"
        )
    state = {shard_key(): _state(model, optimizer)}
    dcp.load(state, checkpoint_id=os.fspath(path))
    loaded, model = state[shard_key()], _unwrap(model)
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=loaded["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
