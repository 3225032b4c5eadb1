"""One rank of the RNG check, started by real torchrun (4 ranks, tensor=2, pipeline=2):

    torchrun --standalone --nproc-per-node 4 tests/torchrun_rng.py OUT_DIR

Launches with ``launch_from_torch`` and records, in OUT_DIR/rank-<R>.json:

* ``alike``: the sets of streams of this rank that drew the same 8 numbers (should be none);
* ``checkpoint_mismatches``: the checkpointed regions (``parallelctx.checkpoint`` reentrant and
  non-reentrant, torch's checkpoint with ``rng_context_fn``; entered under TENSOR, DATA or the
  replica stream; backward inside, outside or under another stream; one region and nested) whose output, gradients or streams afterwards differ from the plain run (should be none);
* ``int_off_by_one``: what ``assert_same_across`` said about int64 tensors that differ by one
  across the tensor group (should be an AssertionError);
* ``draws``: this rank's draws, for the caller to compare across ranks.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from rng_cases import checkpoint_mismatches, stream_draws, streams_alike

import parallelctx
from parallelctx import REPLICA, gpc
from parallelctx import ParallelMode as M
from parallelctx.testing import assert_same_across


def main(out_dir: str) -> None:
    """Run the three checks on this rank and write its record."""
    warnings.filterwarnings("ignore", "None of the inputs have requires_grad")  # nested reentrant
    parallelctx.launch_from_torch({"parallel": {"tensor": 2, "pipeline": 2}})
    try:
        rank = gpc.get_global_rank()
        draws = stream_draws(8)
        ids = torch.tensor([2**53 + gpc.get_local_rank("tensor")], dtype=torch.int64)
        try:
            assert_same_across("tensor", ids, what="token ids")
            verdict = "passed"
        except AssertionError as exc:
            verdict = f"AssertionError: {exc}"
        record = {
            "rank": rank,
            "alike": streams_alike(draws),
            "checkpoint_mismatches": checkpoint_mismatches((M.TENSOR, M.DATA, REPLICA)),
            "int_off_by_one": verdict,
            "draws": draws,
        }
        Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(record))
    finally:
        gpc.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
