"""Dry runs (docs/dry_run.md): ``parallelctx dry-run`` as one rank and as a sweep, the
``simulate=`` launch, the cross-rank checks, and ``simulate=True`` plugin tests.

Every run that launches goes through a fresh process (the CLI, or ``python -c``), as users run it.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parallelctx import plan
from parallelctx.cli.sweep import check_all, check_membership, check_plan, parse_ranks
from parallelctx.dryrun import parse_simulate, torchrun_environment
from parallelctx.layout import ParallelMode
from parallelctx.planning.covering import covering_ranks

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "dry_run" / "train.py"
pytest_plugins = ["pytester"]


def _cli(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "parallelctx", "dry-run", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def _script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_one_rank_of_16384_reports_plans_groups_coords_and_seeds(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = _cli("--world-size", 16384, "--rank", 12345, "--json", out, TRAIN, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dry-run rank 12345 of 16384" in proc.stdout
    report = json.loads(out.read_text())
    layout = plan(16384, tensor=8, pipeline=16)
    want = {m.value: layout.group_of(m, 12345) for m in layout.modes() if m is not ParallelMode.GLOBAL}
    assert report["groups"] == {m: g for m, g in want.items() if g}
    for mode in report["groups"]:
        assert report["coords"][mode] == layout.local_rank(mode, 12345)
    assert report["coords"]["global"] == 12345
    assert (report["world_size"], report["rank"], report["nproc_per_node"]) == (16384, 12345, 8)
    from parallelctx.seed import STREAMS, mode_seed

    seeds = {str(getattr(k, "value", k)): mode_seed(layout, 12345, k, 1234) for k in STREAMS}
    assert report["seeds"] == seeds
    # gpc's groups (tensor, pipeline, data, model and one one-rank group), local synchronization
    assert report["launch_new_group_calls"] == report["new_group_calls"] == 5
    assert all(c["local"] for c in report["new_groups"])
    assert isinstance(report["launch_s"], float) and report["launch_s"] > 0
    assert report["values"] == {"weight_shard": [512, 4096], "mesh_shape": [16, 1, 128, 1, 8]}
    assert report["same_across"] == {"weight_shard": "tensor", "mesh_shape": "data"}


def test_one_rank_prints_the_report_and_runs_the_script_with_torchruns_variables(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import os, sys
        import parallelctx
        from parallelctx import gpc
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
        print("ENV", [os.environ[n] for n in names], sys.argv[1:])
        parallelctx.launch_from_torch()  # the config comes from --config
        print("GPC", gpc.get_world_size("tensor"), gpc.local_rank, gpc.node_rank, gpc.num_nodes,
              gpc.num_processes_on_current_node, gpc.backend)
        """,
    )
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"parallel": {"tensor": 4}}))
    proc = _cli(
        "--world-size",
        64,
        "--rank",
        13,
        "--nproc-per-node",
        4,
        "--config",
        cfg,
        script,
        "--lr",
        "3",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ENV ['13', '64', '1', '4', '3', '16'] ['--lr', '3']" in proc.stdout
    assert "GPC 4 1 3 16 4 fake" in proc.stdout
    printed = proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1]
    assert json.loads(printed)["groups"]["tensor"] == [12, 13, 14, 15]


def test_a_failing_script_fails_the_dry_run_with_its_error(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import parallelctx
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=3)))
        """,
    )
    proc = _cli("--world-size", 16, "--rank", 0, "--quiet", script, cwd=tmp_path)
    assert proc.returncode == 1
    assert "tensor=3" in proc.stdout and "FAILED" in proc.stdout


SKIPPER = """
import torch.distributed as dist
import parallelctx
from parallelctx import gpc
parallelctx.launch_from_torch(dict(parallel=dict(tensor=4, pipeline=4)))
dist.new_group([4, 5])
if gpc.get_global_rank() != 17:
    dist.new_group([0, 1, 2, 3])
gpc.destroy()
"""


@pytest.mark.parametrize("world", [64, pytest.param(256, marks=pytest.mark.sweeps)])
def test_sweep_of_all_ranks_names_the_rank_that_skips_a_world_group(tmp_path: Path, world: int) -> None:
    script = _script(tmp_path, SKIPPER)
    proc = _cli("--world-size", world, "--ranks", "all", script, cwd=tmp_path, timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if "skipped" in ln]
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("rank 17 skipped new_group([0, 1, 2, 3]), call 2 of the 2"), lines
    assert "job.py:8" in lines[0]
    assert (
        f"{world} of {world} ranks" in proc.stdout
        and "0 ranks failed, 1 cross-rank mismatches" in proc.stdout
    )


@pytest.mark.sweeps
def test_sweep_of_the_covering_set_names_the_ranks_of_one_data_index_that_skip_a_world_group(
    tmp_path: Path,
) -> None:
    script = _script(
        tmp_path,
        """
        import sys
        import torch.distributed as dist
        import parallelctx
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=2, pipeline=4)))
        # rank = tensor + 2 * data + 16 * stage: with --bug the ranks of data index 5 skip it
        if "--bug" not in sys.argv or (dist.get_rank() // 2) % 8 != 5:
            dist.new_group([0, 1])
        """,
    )
    out = tmp_path / "sweep.json"
    proc = _cli("--world-size", 64, "--ranks", "cover", "--json", out, script, "--bug", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    layout = plan(64, tensor=2, pipeline=4)
    swept = sorted(int(r) for r in json.loads(out.read_text())["reports"])
    assert swept == covering_ranks(layout) and len(swept) == 8 and "8 of 64 ranks" in proc.stdout
    data_5 = [r for r in swept if layout.local_rank("data", r) == 5]
    named = [ln.split()[1] for ln in proc.stdout.splitlines() if "skipped new_group([0, 1])" in ln]
    assert named == [str(r) for r in data_5] and len(named) == 1, proc.stdout
    clean = _cli("--world-size", 64, "--ranks", "cover", script, cwd=tmp_path)
    assert clean.returncode == 0 and "8 of 64 ranks" in clean.stdout, clean.stdout + clean.stderr
    # the layout comes from rank 0's launch: a rank 0 that never launches leaves nothing to cover
    broken = _script(tmp_path, "raise SystemExit('no config here')\n", name="broken.py")
    proc = _cli("--world-size", 64, "--ranks", "cover", broken, cwd=tmp_path)
    assert proc.returncode == 1 and "1 of 64 ranks" in proc.stdout, proc.stdout + proc.stderr
    assert "--ranks cover: no launch of gpc finished on rank 0" in proc.stdout


def test_sweep_passes_a_consistent_script_and_writes_every_report(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    proc = _cli("--world-size", 1024, "--ranks", "sample:6", "--json", out, TRAIN, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 of 1024 ranks" in proc.stdout and "all checks passed" in proc.stdout
    saved = json.loads(out.read_text())
    assert {0, 1023} <= {int(r) for r in saved["reports"]} and len(saved["reports"]) == 6
    assert saved["mismatches"] == [] and saved["failures"] == []


def test_sweep_names_ranks_whose_same_across_values_differ_and_missing_local_members(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import torch.distributed as dist
        import parallelctx
        from parallelctx import gpc
        from parallelctx.dryrun import record
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=4)))
        rank = gpc.get_global_rank()
        record("hidden", 1024 if rank != 6 else 1000, same_across="tensor")
        if rank == 0:
            dist.new_group([0, 1], use_local_synchronization=True)
        """,
    )
    proc = _cli("--world-size", 8, "--ranks", "all", script, cwd=tmp_path)
    assert proc.returncode == 1
    assert "'hidden' must be the same across the tensor group [4, 5, 6, 7]" in proc.stdout
    assert "ranks [4, 5, 7]: 1024; ranks [6]: 1000" in proc.stdout
    assert "ranks [1] are members of new_group([0, 1], use_local_synchronization=True)" in proc.stdout


def test_sweep_names_a_local_group_made_after_different_group_counts(tmp_path: Path) -> None:
    # With 4 pipeline stages only the first and last hold an embedding group, so a group of
    # ranks 0 (first stage) and 1 (a middle stage) made after launch gets a different torch name
    # on each: a real 4-rank gloo job times out in this new_group on rank 1.
    script = _script(
        tmp_path,
        """
        import torch.distributed as dist
        import parallelctx
        from parallelctx import gpc
        parallelctx.launch_from_torch(dict(parallel=dict(pipeline=4)))
        if gpc.get_global_rank() < 2:
            dist.new_group([0, 1], use_local_synchronization=True)
        """,
    )
    proc = _cli("--world-size", 4, "--ranks", "all", script, cwd=tmp_path)
    assert proc.returncode == 1
    assert "new_group([0, 1], use_local_synchronization=True) at " in proc.stdout
    assert (
        "job.py:7 comes after 3 process groups on most of its members but not on ranks [1] (after 2)"
        in proc.stdout
    )


def test_sweep_reports_a_rank_that_fails_and_its_output(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import parallelctx
        from parallelctx import gpc
        parallelctx.launch_from_torch(dict(parallel=dict(pipeline=2)))
        if gpc.get_global_rank() == 3:
            print("about to fail")
            raise RuntimeError("shape 7 does not divide on the last stage")
        """,
    )
    proc = _cli("--world-size", 4, "--ranks", "0,3", "--jobs", 2, script, cwd=tmp_path)
    assert proc.returncode == 1
    assert "rank 3 failed: RuntimeError: shape 7 does not divide on the last stage" in proc.stdout
    assert "about to fail" in proc.stdout
    assert "rank 0 failed" not in proc.stdout


@pytest.mark.slow
def test_sweep_kills_and_names_every_rank_that_hangs(tmp_path: Path) -> None:
    # Ten hanging ranks at once: ten kills in one sweep, each named, and the others still pass.
    script = _script(
        tmp_path,
        """
        import time
        import parallelctx
        from parallelctx import gpc
        parallelctx.launch_from_torch()
        if 0 < gpc.get_global_rank() < 11:
            time.sleep(600)
        """,
    )
    proc = _cli(
        "--world-size", 12, "--ranks", "all", "--jobs", 12, "--rank-timeout", 10, script, cwd=tmp_path, timeout=200
    )  # fmt: skip
    assert proc.returncode == 1
    failed = [ln for ln in proc.stdout.splitlines() if " failed: " in ln]
    assert failed == ["ranks 1-10 (10 ranks) failed: did not finish within --rank-timeout 10 s (killed)"]
    assert "10 ranks failed" in proc.stdout


def test_simulate_launch_in_process_runs_the_bridges_and_restores_torch() -> None:
    code = textwrap.dedent(
        """
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
        import torch, torch.distributed as dist
        from torch.distributed.tensor import Shard, distribute_tensor
        import parallelctx, parallelctx.megatron, parallelctx.torchtitan
        from parallelctx import gpc
        original = dist.new_group
        parallelctx.launch(dict(parallel=dict(tensor=8, pipeline=16)),
                           simulate=dict(world_size=131072, rank=99999))
        assert dist.new_group is not original
        tp = gpc.device_mesh["tp"]
        with torch.device("meta"):
            w = distribute_tensor(torch.empty(1024, 64), tp, [Shard(0)])
        print("LOCAL", list(w.to_local().shape))
        from torch.distributed.fsdp import fully_shard
        model = torch.nn.Linear(64, 4096, device="meta")
        fully_shard(model, mesh=gpc.device_mesh["dp"])
        print("FSDP", list(model.weight.to_local().shape))
        print("TITAN", parallelctx.torchtitan.parallel_dims().tp)
        print("MEGATRON", parallelctx.megatron.process_groups().pp.size())
        parallelctx.megatron.install()
        from megatron.core import parallel_state
        print("PARALLEL_STATE", parallel_state.get_pipeline_model_parallel_rank())
        x = torch.ones(2)
        for _ in range(3):
            dist.all_reduce(x, group=gpc.get_group("data"))
        dist.broadcast(x, 0)
        print("NODES", gpc.num_nodes, gpc.node_rank, gpc.local_rank)
        report = gpc.dry_run.report()
        gpc.destroy()
        assert dist.new_group is original and not dist.is_initialized()
        assert gpc.dry_run.report()["groups"] == report["groups"]
        print("COLLECTIVES", report["collectives"])
        parallelctx.launch(rank=0, world_size=1)  # a real launch again
        print("REAL", gpc.backend, gpc.get_world_size("global"))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "LOCAL [128, 64]" in out and "TITAN 8" in out and "MEGATRON 16" in out
    assert "PARALLEL_STATE 12" in out  # 99999 // (8 * 1024)
    assert "FSDP [4, 64]" in out  # 4096 rows over 1024 data ranks
    assert "NODES 16384 12499 7" in out
    assert "COLLECTIVES {'all_reduce': 3, 'broadcast': 1}" in out
    logged = [ln for ln in out.splitlines() if ln.startswith("LOG parallelctx dry run: torch.distributed.")]
    assert len(logged) == 2, logged  # once per kind
    assert "REAL gloo 1" in out


def test_parse_simulate_and_ranks_name_the_bad_value() -> None:
    sim = parse_simulate({"world_size": 16384, "rank": 12345})
    assert (sim.nproc_per_node, sim.local_rank, sim.node) == (8, 1, 1543)
    assert torchrun_environment(sim)["GROUP_WORLD_SIZE"] == "2048"
    with pytest.raises(ValueError, match="rank=16384 must lie in"):
        parse_simulate({"world_size": 16384, "rank": 16384})
    with pytest.raises(ValueError, match="unknown keys"):
        parse_simulate({"world_size": 4, "rank": 0, "ranks": 1})
    with pytest.raises(ValueError, match="nproc_per_node=3"):
        parse_simulate({"world_size": 16, "rank": 0, "nproc_per_node": 3})
    assert parse_ranks("0,17,9000", 16384) == [0, 17, 9000]
    assert parse_ranks(" cover", 64, layout=plan(64, tensor=2, pipeline=4)) == [0, 8, 19, 27, 36, 44, 55, 63]
    with pytest.raises(ValueError, match="--ranks cover needs the layout"):
        parse_ranks("cover", 64)
    with pytest.raises(ValueError, match="the layout has 32 ranks, not world_size=64"):
        parse_ranks("cover", 64, layout=plan(32, tensor=2))
    with pytest.raises(ValueError, match="'covr' is not a rank; use all, cover,"):
        parse_ranks("covr", 64)
    picked = parse_ranks("sample:10", 1024)
    assert len(picked) == 10 and picked[0] == 0 and picked[-1] == 1023
    with pytest.raises(ValueError, match="rank 9000 is outside"):
        parse_ranks("0,9000", 1024)


def _report(rank: int, groups: dict[str, list[int]]) -> dict:
    parallel = {"tensor": {"size": 2}}
    return {"rank": rank, "world_size": 4, "parallel": parallel, "groups": groups, "new_groups": []}


def test_checks_name_ranks_whose_groups_disagree_with_plan_or_with_each_other() -> None:
    layout = plan(4, tensor=2)
    good = {
        r: _report(r, {m.value: layout.group_of(m, r) for m in layout.modes() if m.value != "global"})
        for r in range(4)
    }
    assert check_all(good) == []
    bad = copy.deepcopy(good)
    bad[1]["groups"]["tensor"] = [1, 2]
    assert any(
        m.startswith("rank 1: its tensor group is [1, 2] but plan says [0, 1]") for m in check_plan(bad)
    )
    found = check_membership(bad)
    assert "tensor group: rank 0 lists [0, 1] but rank 1 lists [1, 2]" in found
    assert "tensor group: rank 1 lists [1, 2] but rank 2 lists [2, 3]" in found


def test_plugin_simulate_true_runs_a_4096_rank_test_on_the_pool(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import os
        from pathlib import Path
        import pytest, torch.distributed as dist
        from parallelctx import gpc
        from parallelctx.dryrun import record

        @pytest.mark.parallel(world_size=4096, tensor=8, pipeline=16, simulate=True)
        def test_default_ranks(tmp_path):
            assert gpc.get_world_size("global") == 4096 and gpc.get_world_size("tensor") == 8
            record("tp", 8, same_across="tensor")
            gpc.device_mesh
            (tmp_path / f"rank{gpc.get_global_rank()}-pid{os.getpid()}").touch()
            Path(f"played-{gpc.get_global_rank()}").touch()

        @pytest.mark.parallel(world_size=256, tensor=4, pipeline=4, simulate=True, ranks=[0, 1, 17, 255])
        def test_skip_named():
            if gpc.get_global_rank() != 17:
                dist.new_group([0, 1, 2, 3])

        @pytest.mark.parallel(world_size=64, simulate=True, ranks=[5, 40])
        def test_failure_names_the_simulated_rank():
            assert gpc.get_global_rank() != 40, "wrong on the last rank"
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    played = sorted(int(p.name.split("-")[1]) for p in pytester.path.glob("played-*"))
    layout = plan(4096, tensor=8, pipeline=16)
    assert played == covering_ranks(layout) and len(played) == 32 and {0, 4095} <= set(played)
    for axis, size in (("tp", 8), ("pp", 16), ("dp", 32)):  # every coordinate of every axis
        assert {layout.coords(r)[axis] for r in played} == set(range(size)), axis
    text = result.stdout.str()
    assert "rank 17 skipped new_group([0, 1, 2, 3])" in text
    assert "dry run of rank 40 of 64" in text and "wrong on the last rank" in text


@pytest.mark.sweeps
def test_plugin_simulate_default_ranks_find_bugs_on_interior_ranks(pytester: pytest.Pytester) -> None:
    # Before the covering set the default ranks were the first and last of each pipeline stage
    # and of the world: all three buggy tests passed.
    pytester.makepyfile(
        """
        import pytest, torch.distributed as dist

        @pytest.mark.parallel(world_size=64, pipeline=4, simulate=True)
        def test_rank_17_skips_a_world_group():
            if dist.get_rank() != 17:
                dist.new_group([0, 1, 2, 3])

        @pytest.mark.parallel(world_size=64, tensor=2, pipeline=4, simulate=True)
        def test_data_rank_5_skips_a_world_group():
            # the tensor rank is the fastest axis, the data rank the next: data index 5 of 8
            if (dist.get_rank() // 2) % 8 != 5:
                dist.new_group([0, 1])

        @pytest.mark.parallel(world_size=64, tensor=2, pipeline=4, expert=4, simulate=True)
        def test_expert_rank_2_skips_a_world_group():
            # expert index: after the expert-tensor axis (size 2), 4 experts
            if (dist.get_rank() // 2) % 4 != 2:
                dist.new_group([0, 1])

        @pytest.mark.parallel(world_size=64, tensor=2, pipeline=4, simulate=True)
        def test_every_rank_makes_the_group():
            dist.new_group([0, 1])
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-rf")
    result.assert_outcomes(passed=1, failed=3)
    text = result.stdout.str()
    assert "rank 17 skipped new_group([0, 1, 2, 3])" in text
    layout = plan(64, tensor=2, pipeline=4)
    data_5 = [r for r in range(64) if layout.local_rank("data", r) == 5]
    assert any(f"rank {r} skipped new_group([0, 1])" in text for r in data_5), text
    moe = plan(64, tensor=2, pipeline=4, expert=4)
    expert_2 = [r for r in range(64) if moe.local_rank("expert", r) == 2]
    assert any(f"rank {r} skipped new_group([0, 1])" in text for r in expert_2), text


@pytest.mark.slow
def test_the_dry_run_benchmark_runs_once_at_a_tiny_size() -> None:
    """benchmarks.dry_run cannot rot; its timings decide nothing."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.dry_run",
        "--worlds",
        "128",
        "--repeats",
        "1",
        "--sweep-world",
        "8",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| 128 |" in proc.stdout and "Sweep: all 8 ranks" in proc.stdout and "checks passed" in proc.stdout


def _limited_memory() -> None:  # a test that fails must not take the shared machine's memory
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


def test_object_collectives_on_a_receiving_rank_leave_the_list_as_it_was(tmp_path: Path) -> None:
    # Every training script broadcasts its config from rank 0. On the fake backend torch's
    # broadcast_object_list (and scatter/recv_object_list) read object sizes from an
    # uninitialised tensor on the receiving ranks and allocate that many bytes.
    script = _script(
        tmp_path,
        """
        import torch.distributed as dist
        import parallelctx
        from parallelctx import gpc
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=2)))
        got = [None, "kept"]
        dist.broadcast_object_list(got, src=0)
        print("BCAST", got)
        out = [None]
        dist.scatter_object_list(out, None, src=0)
        print("SCATTER", out)
        mine = [None]
        dist.recv_object_list(mine, src=0)
        print("RECV", mine)
        gpc.destroy()
        """,
    )
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "parallelctx", "dry-run", "--world-size", "16", "--rank", "3", "--json", str(out), str(script)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, preexec_fn=_limited_memory,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "BCAST [None, 'kept']" in proc.stdout
    assert "SCATTER [None]" in proc.stdout and "RECV [None]" in proc.stdout
    collectives = json.loads(out.read_text())["collectives"]
    assert collectives == {"broadcast_object_list": 1, "scatter_object_list": 1, "recv_object_list": 1}
    assert "recv_object_list does no communication" in proc.stderr


@pytest.mark.parametrize("launcher", ["launch_from_slurm()", "launch_from_openmpi()", "init_dist('slurm')"])
def test_every_launcher_of_the_script_is_the_dry_run(tmp_path: Path, launcher: str) -> None:
    # docs/dry_run.md: "every launch in the process is the dry run"; a script written for srun
    # or mpirun must not need srun's or mpirun's variables on the login node.
    script = _script(
        tmp_path,
        f"""
        import parallelctx
        from parallelctx import gpc
        parallelctx.{launcher}
        print("RANK", gpc.get_global_rank(), gpc.get_world_size("global"), list(gpc.tensor.ranks))
        """,
    )
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"parallel": {"tensor": 4}}))
    proc = _cli("--world-size", 64, "--rank", 13, "--config", cfg, "--quiet", script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "RANK 13 64 [12, 13, 14, 15]" in proc.stdout


def test_a_relaunch_after_a_dry_run_starts_clean() -> None:
    # A second simulated launch after destroy() is a new dry run (its report counts its own
    # new_group calls), and a real launch afterwards is no dry run: gpc.dry_run is None and
    # record() is a no-op again.
    code = textwrap.dedent(
        """
        import parallelctx
        from parallelctx import gpc
        from parallelctx.dryrun import record
        cfg = dict(parallel=dict(tensor=8, pipeline=16))
        parallelctx.launch(cfg, simulate=dict(world_size=16384, rank=12345))
        record("first", 1)
        first = gpc.dry_run.report()
        gpc.destroy()
        parallelctx.launch(cfg, simulate=dict(world_size=16384, rank=12345))
        second = gpc.dry_run.report()
        gpc.destroy()
        print("SECOND", second["new_group_calls"] == first["new_group_calls"], second["launches"], second["values"])
        parallelctx.launch(rank=0, world_size=1)
        record("real", 2)
        print("REAL", gpc.backend, gpc.dry_run)
        gpc.destroy()
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SECOND True 1 {}" in proc.stdout
    assert "REAL gloo None" in proc.stdout


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--json", "no/such/dir/out.json"], "no/such/dir"),
        (["--ranks", "0,1", "--rank-timeout", "0"], "--rank-timeout 0"),
        (["--ranks", "0,1", "--jobs", "0"], "--jobs 0"),
    ],
)
def test_bad_options_stop_before_the_script_runs(tmp_path: Path, options: list[str], named: str) -> None:
    script = _script(tmp_path, 'print("THE SCRIPT RAN")\n')
    proc = _cli("--world-size", 16, *options, script, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    assert "THE SCRIPT RAN" not in proc.stdout
    assert named in proc.stderr and "Traceback" not in proc.stderr


def test_json_lands_where_it_was_asked_for_when_the_script_changes_directory(tmp_path: Path) -> None:
    work = tmp_path / "elsewhere"
    work.mkdir()
    script = _script(
        tmp_path,
        f"""
        import os
        import parallelctx
        os.chdir({str(work)!r})
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=2)))
        """,
    )
    proc = _cli("--world-size", 16, "--rank", 5, "--json", "out.json", script, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert json.loads((tmp_path / "out.json").read_text())["groups"]["tensor"] == [4, 5]
    assert not (work / "out.json").exists()


def test_a_local_group_made_with_positional_arguments_is_no_world_wide_call(tmp_path: Path) -> None:
    # new_group(ranks, timeout, backend, pg_options, use_local_synchronization): only its
    # members make it, so the ranks that do not are not skipping a world-wide call.
    script = _script(
        tmp_path,
        """
        import torch.distributed as dist
        import parallelctx
        from parallelctx import gpc
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=2)))
        if gpc.get_global_rank() in (0, 1):
            dist.new_group([0, 1], None, None, None, True)
        """,
    )
    out = tmp_path / "sweep.json"
    proc = _cli("--world-size", 4, "--ranks", "all", "--jobs", 2, "--json", out, script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    call = json.loads(out.read_text())["reports"]["0"]["new_groups"][-1]
    assert (call["ranks"], call["local"]) == ([0, 1], True)


def test_a_gloo_side_group_and_a_monitored_barrier_run_in_a_dry_run(tmp_path: Path) -> None:
    # Real jobs on NCCL make a gloo group for CPU work and call monitored_barrier; in a dry run
    # every group is on the fake backend and a barrier returns at once.
    script = _script(
        tmp_path,
        """
        import torch.distributed as dist
        import parallelctx
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=2)))
        cpu = dist.new_group(backend="gloo")
        sub = dist.new_group([2, 3], backend="gloo", use_local_synchronization=True)
        dist.monitored_barrier(group=cpu)
        print("BACKENDS", dist.get_backend(cpu), dist.get_backend(sub))
        """,
    )
    proc = _cli("--world-size", 16, "--rank", 3, "--quiet", script, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "BACKENDS fake fake" in proc.stdout


def test_one_rank_that_hangs_is_stopped_at_rank_timeout_with_its_report(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import time
        import parallelctx
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=2)))
        def wait_for_peers():
            time.sleep(600)
        wait_for_peers()
        """,
    )
    out = tmp_path / "out.json"
    proc = _cli(
        "--world-size", 16, "--rank", 5, "--rank-timeout", 5, "--json", out, script, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["groups"]["tensor"] == [4, 5]
    assert "did not finish within --rank-timeout 5 s" in report["error"]
    assert "wait_for_peers" in proc.stderr  # where it hung
    assert "FAILED (did not finish within --rank-timeout 5 s" in proc.stdout


def test_sweep_ranks_do_not_outlive_a_killed_sweep(tmp_path: Path) -> None:
    # CI kills the sweep (SIGKILL, no chance to clean up): its hanging ranks must still stop
    # within --rank-timeout instead of running on as orphans.
    import os
    import signal
    import time

    script = _script(
        tmp_path,
        """
        import os, time
        from pathlib import Path
        import parallelctx
        parallelctx.launch_from_torch()
        Path(f"pid{os.getpid()}").touch()
        time.sleep(600)
        """,
    )
    cmd = [sys.executable, "-m", "parallelctx", "dry-run", "--world-size", "4", "--ranks", "0,1", "--jobs", "2",
           "--rank-timeout", "4", str(script)]  # fmt: skip
    sweep = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int(p.name[3:]) for p in tmp_path.glob("pid*")]
        assert len(pids) == 2, "the ranks did not start"
    finally:
        sweep.kill()
        sweep.wait(30)

    def alive(pid: int) -> bool:  # a zombie no one reaped yet has stopped
        try:
            return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [p for p in pids if alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived the sweep"


def test_a_sweep_whose_ranks_all_fail_alike_says_so_once(tmp_path: Path) -> None:
    # A layout that does not fit the world fails every rank the same way: one message naming
    # the ranks, not one copy (with its log) per rank.
    script = _script(
        tmp_path,
        """
        import parallelctx
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=8, pipeline=16)))
        """,
    )
    proc = _cli("--world-size", 24, "--ranks", "all", "--jobs", 2, script, cwd=tmp_path, timeout=200)
    assert proc.returncode == 1
    failed = [ln for ln in proc.stdout.splitlines() if " failed: " in ln]
    assert len(failed) == 1 and proc.stdout.count("output ends:") == 1, proc.stdout
    assert "ranks 0-23 (24 ranks) failed: LayoutError: tensor=8 x pipeline=16" in proc.stdout


def test_a_script_that_exits_with_a_message_keeps_the_message(tmp_path: Path) -> None:
    # sys.exit("...") prints the message and exits 1 under torchrun; the dry run must not lose it.
    script = _script(
        tmp_path,
        """
        import sys
        import parallelctx
        parallelctx.launch_from_torch(dict(parallel=dict(tensor=2)))
        sys.exit("hidden size 4095 does not divide by tensor 2")
        """,
    )
    out = tmp_path / "out.json"
    proc = _cli("--world-size", 8, "--rank", 1, "--json", out, script, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1
    assert "hidden size 4095 does not divide by tensor 2" in proc.stderr
    assert json.loads(out.read_text())["error"] == "SystemExit: hidden size 4095 does not divide by tensor 2"
    assert "FAILED (SystemExit: hidden size 4095" in proc.stdout


def test_a_sweep_shows_where_a_hanging_rank_was(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import time
        import parallelctx
        from parallelctx import gpc
        parallelctx.launch_from_torch()
        def wait_for_peers():
            time.sleep(600)
        if gpc.get_global_rank() == 1:
            wait_for_peers()
        """,
    )
    proc = _cli(
        "--world-size",
        2,
        "--ranks",
        "all",
        "--jobs",
        2,
        "--rank-timeout",
        6,
        script,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "rank 1 failed: did not finish within --rank-timeout 6 s (killed)" in proc.stdout
    assert "in wait_for_peers" in proc.stdout, proc.stdout
