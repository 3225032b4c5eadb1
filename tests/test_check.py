"""`parallelctx check`: structured verification, timing summaries, and real torchrun runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_helpers import run_torchrun

from parallelctx import ParallelMode, plan
from parallelctx.cli.timing import bus_bandwidth, format_size, parse_sizes, summarise, timed_modes
from parallelctx.cli.verify import problems, verify

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


def honest_probe(layout, rank: int) -> dict:
    """What probe_groups reports on ``rank`` when the groups really follow ``layout``."""
    out = {}
    for mode in ParallelMode:
        members = layout.group_of(mode, rank)
        if not members:
            continue
        local = members.index(rank)
        out[mode.value] = {
            "members": members,
            "order": members,
            "cpu_members": members,
            "local_rank": local,
            "size": len(members),
            "next": members[(local + 1) % len(members)],
            "prev": members[(local - 1) % len(members)],
            "first": local == 0,
            "last": local == len(members) - 1,
        }
    return out


def test_verify_passes_on_honest_probes() -> None:
    layout = plan(16, tensor=2, pipeline=4, context=2)
    checks = verify(layout, {r: honest_probe(layout, r) for r in range(16)})
    assert [c.mode for c in checks] == [m.value for m in ParallelMode]
    assert all(c.ok for c in checks) and problems(checks) == []
    assert {c.mode: (c.groups, c.group_size) for c in checks}["embedding"] == (4, 2)


def test_verify_names_the_modes_of_a_wrong_layout() -> None:
    real = plan(8, tensor=2, pipeline=2)  # what the job built
    fabricated = plan(8, tensor=2, pipeline=2, order="tp-pp-dp")  # what it is checked against
    checks = {c.mode: c for c in verify(fabricated, {r: honest_probe(real, r) for r in range(8)})}
    failed = {mode for mode, c in checks.items() if not c.ok}
    assert failed == {
        "pipeline",
        "data",
        "model",
        "data_context",
        "embedding",
        "expert_data",
        "expert_model",
    } | {
        # the HSDP parts equal data, data_context and expert_data here (replicate 1): wrong with them
        "data_shard",
        "data_shard_context",
        "expert_data_shard",
    }
    assert "data.members on rank 0: got [0, 2], expected [0, 4]" in checks["data"].problems
    assert checks["tensor"].ok and checks["global"].ok


def test_sizes_and_bandwidth() -> None:
    assert parse_sizes("4KiB, 1MiB,16M,8") == (4096, 1 << 20, 16 << 20, 8)
    assert [format_size(s) for s in (4096, 1 << 20, 100)] == ["4 KiB", "1 MiB", "100 B"]
    with pytest.raises(ValueError, match="'4XB' is not understood; write e.g. 4KiB,1MiB,16MiB"):
        parse_sizes("4XB")
    with pytest.raises(ValueError, match="below 4 bytes"):
        parse_sizes("2")
    assert bus_bandwidth(10**9, 1.0, 2) == pytest.approx(1.0)
    assert bus_bandwidth(10**9, 1.0, 8) == pytest.approx(1.75)
    assert bus_bandwidth(10, 0.0, 8) == 0.0


def test_timed_modes_share_identical_groups() -> None:
    same = dict(timed_modes(plan(8, tensor=2, pipeline=2)))
    assert same[ParallelMode.TENSOR] is None and same[ParallelMode.EXPERT_TENSOR] is ParallelMode.TENSOR
    assert same[ParallelMode.EMBEDDING] is ParallelMode.PIPELINE and ParallelMode.CONTEXT not in same


def test_summarise_finds_slowest_and_outliers() -> None:
    layout = plan(8, tensor=2)
    seconds = {0: 1.0, 1: 1.1, 2: 1.0, 3: 1.2, 4: 9.0, 5: 1.0, 6: 1.1, 7: 1.0}
    gathered = {r: {"tensor": [t / 1000, t]} for r, t in seconds.items()}
    timing = summarise(layout, ParallelMode.TENSOR, gathered, [4096, 1 << 20])
    assert [g.latency_s[-1] for g in timing.groups] == [1.1, 1.2, 9.0, 1.1]
    assert timing.slowest.ranks == [4, 5] and timing.slow_groups == [[4, 5]]
    assert timing.groups[0].busbw_gbs[-1] == pytest.approx(bus_bandwidth(1 << 20, 1.1, 2))


def _torchrun(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    return run_torchrun(8, args, timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_under_torchrun_json() -> None:
    proc = _torchrun(
        [
            "-m",
            "parallelctx",
            "check",
            "--config",
            "configs/demo_3d.py",
            "--sizes",
            "4KiB,64KiB",
            "--iters",
            "2",
            "--json",
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, "one JSON object, on rank 0"
    report = json.loads(lines[0])
    assert report["ok"] is True and report["world_size"] == 8 and report["hosts"] == 1
    assert report["seeds"] == {"ok": True, "problems": []}
    assert set(report["modes"]) == {m.value for m in ParallelMode}
    assert all(m["ok"] and m["problems"] == [] for m in report["modes"].values())
    tensor = report["modes"]["tensor"]["timing"]
    assert len(tensor["groups"]) == 4 and tensor["sizes"] == [4096, 65536]
    for group in tensor["groups"]:  # times are present and positive, never compared
        assert all(t > 0 for t in group["latency_s"]) and all(b > 0 for b in group["busbw_gbs"])
    assert report["modes"]["expert_tensor"]["timing"]["same_as"] == "tensor"
    assert report["modes"]["context"]["timing"] is None
    assert "[5/5] all-reduce in 2 model group(s) of 4" in proc.stderr  # progress on rank 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_check_fails_on_a_tampered_group(tmp_path) -> None:
    proc = _torchrun(
        [
            "tests/check_tamper.py",
            str(tmp_path),
            "--config",
            "configs/demo_3d.py",
            "--sizes",
            "4KiB",
            "--iters",
            "1",
            "--json",
            "--quiet",
        ]
    )
    assert proc.returncode != 0
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert report["ok"] is False
    failed = {mode for mode, m in report["modes"].items() if not m["ok"]}
    assert "tensor" in failed and "pipeline" not in failed and "data" not in failed
    assert "tensor.members on rank 0: got [0, 2], expected [0, 1]" in report["modes"]["tensor"]["problems"]
    codes = sorted(p.read_text() for p in tmp_path.glob("rank-*.rc"))
    assert codes == ["1"] * 8, "every rank exits non-zero"


def _seed_probes(layout, seed_of) -> list[dict]:
    """What probe_seeds gathers when each stream is seeded with ``seed_of(rank, mode)``."""
    import torch

    from parallelctx.seed import STREAMS

    out = []
    for rank in range(layout.world_size):
        seeds = {str(m): seed_of(rank, m) for m in STREAMS}
        draws = {}
        for mode in STREAMS:
            values = torch.rand(8, generator=torch.Generator().manual_seed(seeds[str(mode)])).tolist()
            draws[str(mode)] = [values[:4], values[4:]]
        out.append({"rank": rank, "coords": layout.coords(rank), "seeds": seeds, "draws": draws})
    return out


def test_verify_seeds_catches_streams_that_draw_alike_despite_distinct_seeds() -> None:
    from parallelctx.cli.verify import verify_seeds
    from parallelctx.seed import STREAM_SLOTS, mode_seed

    layout = plan(4, tensor=2, pipeline=2)
    assert verify_seeds(layout, _seed_probes(layout, lambda r, m: mode_seed(layout, r, m, 1024))) == []

    # the first formula: slots 2**32 apart, which the CPU generator drops
    def old(r, m):
        return mode_seed(layout, r, m, 1024) % 2**24 + STREAM_SLOTS[m] * 2**32

    errors = verify_seeds(layout, _seed_probes(layout, old))
    assert any("rank 0: these streams draw the same numbers" in e for e in errors), errors
    assert not any("share a seed" in e for e in errors)


def test_verify_seeds_catches_a_replica_stream_shared_by_the_data_replicas() -> None:
    from parallelctx.cli.verify import verify_seeds
    from parallelctx.seed import REPLICA, mode_seed

    layout = plan(8, tensor=2, pipeline=2)  # data groups of 2

    def same_replicas(r, m):  # the replica stream seeded like the default one: equal across dp
        return mode_seed(layout, r, "global" if m == REPLICA else m, 1024) + (7 if m == REPLICA else 0)

    errors = verify_seeds(layout, _seed_probes(layout, same_replicas))
    assert any("replica stream repeats within data group" in e for e in errors), errors
