"""One rank of the elastic-restart tests, started by real torchrun with ``--max-restarts``:

    torchrun ... --max-restarts N tests/torchrun_restart.py OUT_DIR PLAN [--plain]

Each attempt launches with ``launch_from_torch`` (tensor=2, pipeline=2, or tensor=2 on two
ranks), proves every group by collectives (``check.probe_groups`` against the pure layout) and
an all-reduce over the tensor group against the serial sum, writes
OUT_DIR/attempt-<A>-rank-<R>.json, then destroys. PLAN is JSON, ``{"<attempt>": {"rank": R,
"point": P, "delay": S}}``: on that attempt (this agent's TORCHELASTIC_RESTART_COUNT) rank R
dies with ``os._exit(3)`` at point P: ``before`` the launch, ``launch`` (S seconds after the
launch began, wherever it then is), ``after`` the launch and its proof, ``collective`` (instead
of joining a world all-reduce the others are in), ``destroy`` (inside ``gpc.destroy()``).
The record holds the key prefix the launch agreed on (every rank's must match, no attempt's may
repeat). With ``--plain`` the script uses torch alone (``init_process_group`` from torchrun's
variables, a world all-reduce) instead of parallelctx, for comparison.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

TIMEOUT = 30  # dist.timeout of every launch, seconds


def _die() -> None:
    os._exit(3)


def _record_prefixes(seen: list[str]) -> None:
    """Wrap parallelctx's rendezvous meet wherever it was imported, to record the agreed prefix."""
    from parallelctx import rendezvous

    original = rendezvous.meet

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        prefix, hosts = original(*args, **kwargs)
        seen.append(prefix)
        return prefix, hosts

    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.startswith("parallelctx") and getattr(module, "meet", None) is original:
            module.meet = recording  # type: ignore[attr-defined]


def _plain(out: Path, attempt: int, rank: int, kill: dict | None) -> int:
    start = time.perf_counter()
    record: dict = {"attempt": attempt, "rank": rank}
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
        value = torch.ones(1)
        dist.all_reduce(value)
        record.update(launched=True, world_sum=value.item(), launch_s=time.perf_counter() - start)
    except Exception as exc:
        record.update(launched=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    (out / f"attempt-{attempt}-rank-{rank}.json").write_text(json.dumps(record))
    if not record["launched"]:
        return 1
    if kill is not None and kill["rank"] == rank:
        _die()
    dist.destroy_process_group()
    return 0


def main() -> int:
    """Run this attempt on this rank; return 0 when it completed (torchrun restarts on non-zero)."""
    started_at = time.time()
    out, plan = Path(sys.argv[1]), json.loads(sys.argv[2])
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    kill = plan.get(str(attempt))
    point = kill["point"] if kill is not None and kill["rank"] == rank else None
    if "--plain" in sys.argv[3:]:
        return _plain(out, attempt, rank, kill)
    import parallelctx
    from parallelctx import ParallelMode, gpc
    from parallelctx.cli.verify import probe_groups, problems, verify

    if point == "before":
        _die()
    if point == "launch":
        timer = threading.Timer(float(kill["delay"]), _die)  # type: ignore[index]
        timer.daemon = True
        timer.start()
    prefixes: list[str] = []
    _record_prefixes(prefixes)
    world = int(os.environ["WORLD_SIZE"])
    parallel = {"tensor": 2, "pipeline": 2} if world % 4 == 0 else {"tensor": 2}
    start = time.perf_counter()
    parallelctx.launch_from_torch({"parallel": parallel, "dist": {"timeout": TIMEOUT}})
    launch_s = time.perf_counter() - start
    layout = gpc.layout
    errors = problems(verify(layout, {rank: probe_groups(gpc)}))
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=gpc.get_group(ParallelMode.TENSOR))
    expected = float(sum(r + 1 for r in gpc.get_ranks_in_group(ParallelMode.TENSOR)))
    record = {
        "attempt": attempt,
        "rank": rank,
        "prefix": prefixes[-1] if prefixes else None,
        "layout": layout.describe(),
        "errors": errors,
        "tensor_sum": value.item(),
        "tensor_expected": expected,
        "launch_s": launch_s,
        "started_at": started_at,
        "launched_at": time.time(),
        "hosts": list(gpc.hostnames),
    }
    (out / f"attempt-{attempt}-rank-{rank}.json").write_text(json.dumps(record))
    if point == "after":
        _die()
    if point == "collective":
        _die()
    total = torch.ones(1)
    dist.all_reduce(total)  # the others wait here when a rank died at "collective"
    if point == "destroy":
        gpc.add_destroy_hook(_die)
    gpc.destroy()
    if point == "launch":
        _die()  # the timer did not fire yet (a fast machine): this attempt still loses the rank
    return 0


if __name__ == "__main__":
    sys.exit(main())
