"""Correct point-to-point (and uneven all_gather) patterns a dry-run sweep must pass (tests/test_call_ledger.py):
``python dryrun_p2p_patterns.py PATTERN`` on 4 ranks, pipeline 2."""

import sys

import torch
import torch.distributed as dist
from torch.distributed import P2POp, batch_isend_irecv, irecv, isend  # before the dry run wraps them

from parallelctx import ParallelMode, gpc, launch_from_torch

pattern = sys.argv[1]
launch_from_torch({"parallel": {"pipeline": 2}})
stage = gpc.get_local_rank(ParallelMode.PIPELINE)
peer = gpc.get_next_global_rank(ParallelMode.PIPELINE)
out, inp = torch.ones(4), torch.zeros(4)
if pattern == "isend_then_recv":  # each rank: isend, blocking recv, wait
    req = dist.isend(out, dst=peer)
    dist.recv(inp, src=peer)
    req.wait()
elif pattern == "irecv_then_send":  # each rank: irecv, blocking send, wait
    req = dist.irecv(inp, src=peer)
    dist.send(out, dst=peer)
    req.wait()
elif pattern == "p2pop":  # a 1F1B-like step with P2POp, given torch's functions imported at the top
    for _micro in range(3):
        ops = [P2POp(isend, out, peer), P2POp(dist.irecv, inp, peer)]
        for work in batch_isend_irecv(ops if stage == 0 else ops[::-1]):
            work.wait()
    if stage == 0:
        dist.batch_isend_irecv([dist.P2POp(irecv, inp, peer)])[0].wait()
    else:
        dist.send(out, dst=peer)
elif pattern == "anysrc":  # stage 0 receives from whoever sends; then all reduce
    if stage == 0:
        got = dist.recv(inp)
        assert isinstance(got, int) and got != dist.get_rank(), got
    else:
        dist.send(out, dst=peer)
    dist.all_reduce(out)
elif pattern == "uneven_all_gather":  # each rank's own shape (NCCL gathers lists of any shapes)
    group = gpc.get_group(ParallelMode.PIPELINE)
    outs = [torch.zeros(i + 1, 3) for i in range(2)]
    dist.all_gather(outs, torch.zeros(stage + 1, 3), group=group)
    dist.all_gather(outs, torch.zeros(stage + 1, 3), group=group, async_op=True).wait()
gpc.destroy()
