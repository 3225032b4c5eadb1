"""The one helper the tests use to prove a process group by collectives (not by what gpc stored)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def probe_group(group: Any, world: int, rank: int) -> dict[str, Any]:
    """Prove ``group`` on this rank with real collectives (every member must call it).

    Returns:
        ``members``: the global ranks whose one-hot vectors an all-reduce over the group summed
        (``[-1]`` when a rank was counted twice); ``sum``: that vector; ``order``: the global ranks
        all-gathered over the group, in group-rank order; ``group_rank``: this rank's rank in it;
        ``timeout``: the group's timeout in seconds as torch holds it (CPU backend).
    """
    onehot = torch.zeros(world, dtype=torch.int64)
    onehot[rank] = 1
    dist.all_reduce(onehot, group=group)
    members = torch.nonzero(onehot).flatten().tolist() if int(onehot.max()) == 1 else [-1]
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.tensor([rank]), group=group)
    backend = group._get_backend(torch.device("cpu"))
    return {
        "members": members,
        "sum": onehot.tolist(),
        "order": [int(t.item()) for t in gathered],
        "group_rank": dist.get_rank(group),
        "timeout": backend.options._timeout.total_seconds(),
    }
