"""Issue 34's program, one rank, under real torchrun (8 ranks, megatron-core):

    torchrun --standalone --nproc-per-node 8 tests/torchrun_megatron_rounds.py OUT_DIR [eager]

For each of four layouts: a default group of the program's own on the launcher's store,
Megatron's own ``initialize_model_parallel(..., create_gloo_process_groups=True)``, its getters
read, ``destroy_model_parallel()`` and ``destroy_process_group()``; then ``launch_from_torch``
with the same layout, ``parallelctx.megatron.install()``, the getters again (they must name the
same ranks) and ``gpc.destroy()``. With ``eager``, gpc's gloo groups connect as they are made
(``dist.gloo_lazy_init=False``). Writes OUT_DIR/rank-<R>.json when every round passed.

``STALL_RANK=r``: rank r is stopped (SIGSTOP, then SIGCONT) for ``STALL_S`` seconds (default
0.5) as it enters each launch's ``init_process_group``, as the OS may run a rank late. Before
issue 34's fix a faster rank could then finish that launch, install, read and destroy while the
late rank still connected its default group, which failed with "Gloo connectFullMesh failed ...
Connection closed by peer".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch.distributed as dist

warnings.simplefilter("ignore")
from megatron.core import parallel_state as ps  # noqa: E402

import parallelctx  # noqa: E402
import parallelctx.megatron  # noqa: E402
from parallelctx import gpc  # noqa: E402

LAYOUTS = [
    dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    dict(tensor_model_parallel_size=2, context_parallel_size=2),
    dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
    dict(tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1),
]
GETTERS = [
    "get_tensor_model_parallel_group",
    "get_data_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_context_parallel_group",
    "get_expert_model_parallel_group",
    "get_data_parallel_group_gloo",
]


def gpc_config(sizes: dict[str, int], eager: bool) -> dict:
    """gpc's config for Megatron's sizes."""
    parallel: dict = {
        "tensor": sizes["tensor_model_parallel_size"],
        "pipeline": sizes.get("pipeline_model_parallel_size", 1),
        "context": sizes.get("context_parallel_size", 1),
    }
    if "expert_model_parallel_size" in sizes:
        parallel["expert"] = {"size": sizes["expert_model_parallel_size"]}
        if "expert_tensor_parallel_size" in sizes:
            parallel["expert"]["tensor"] = sizes["expert_tensor_parallel_size"]
    return {"parallel": parallel, "dist": {"gloo_lazy_init": not eager, "timeout": 120}}


def read() -> dict[str, list[int]]:
    """Every getter's group, as its ranks."""
    return {name: dist.get_process_group_ranks(getattr(ps, name)()) for name in GETTERS}


def stall_this_rank() -> None:
    """Have a helper process stop this process for STALL_S seconds when it enters the fourth
    launch's init_process_group (calls 1, 3, 5, 7 are the program's own default groups)."""
    pause = os.environ.get("STALL_S", "0.5")
    command = f"while read x; do kill -STOP {os.getpid()}; sleep {pause}; kill -CONT {os.getpid()}; done"
    helper = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE)
    real, calls = dist.init_process_group, [0]

    def init_process_group(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] % 2 == 0 and helper.stdin is not None:
            helper.stdin.write(b"go\n")
            helper.stdin.flush()
        return real(*args, **kwargs)  # type: ignore[arg-type]

    dist.init_process_group = init_process_group  # type: ignore[assignment]


def main(out_dir: str, eager: bool) -> None:
    """The four rounds on this rank; writes its record."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("STALL_RANK") == str(rank):
        stall_this_rank()
    for i, sizes in enumerate(LAYOUTS):
        store = dist.PrefixStore(f"round/{i}", dist.TCPStore(addr, port, is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        ps.initialize_model_parallel(**sizes, create_gloo_process_groups=True)
        theirs = read()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        del store
        parallelctx.launch_from_torch(gpc_config(sizes, eager))
        parallelctx.megatron.install()
        ours = read()
        gpc.destroy()
        assert ours == theirs, (i, ours, theirs)
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "rounds": len(LAYOUTS)}))


if __name__ == "__main__":
    main(sys.argv[1], "eager" in sys.argv[2:])
