"""The torch-free tools and the dry run with ``parallel.modules`` (docs/modules.md#plan-picture-and-dry-run):
``parallelctx plan`` (text, JSON, placement, picture), the sweep's per-module checks, ``parallelctx
dry-run`` of one rank and of many, and ``parallelctx check`` under torchrun.

Every expectation is computed from the plan (``ParallelConfig.module_plan``, ``Layout.groups``,
the seed formula), never copied from the tools' output. Runs that launch go through a fresh
process (the CLI), as users run them.
"""

from __future__ import annotations

import copy
import json
import re
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from parallelctx import ParallelMode
from parallelctx.cli import main
from parallelctx.cli.placement import INTRA_NODE_MODES, layout_nodes, node_spans, placement_warnings
from parallelctx.cli.sweep import check_all, check_membership, check_plan, covering_set, parse_ranks, plan_of
from parallelctx.config import Config
from parallelctx.planning.covering import COVERED_MODES
from parallelctx.planning.layout import LayoutError, plan
from parallelctx.planning.modules import ModulePlan
from parallelctx.runtime.seed import STREAMS, mode_seed

ROOT = Path(__file__).resolve().parent.parent

# vision on ranks 0-1 (data 2), language on ranks 2-7 (tensor 2 x pipeline 3)
DISJOINT = {"modules": {"vision": {"ranks": 2}, "language": {"ranks": 6, "tensor": 2, "pipeline": 3}}}
# vision and audio on ranks 0-3 (colocated), language on ranks 4-7
MIXED = {
    "modules": {
        "vision": {"ranks": 4, "tensor": 2},
        "audio": {"colocated_with": "vision", "pipeline": 4},
        "language": {"ranks": 4, "tensor": 2, "pipeline": 2},
    }
}
# the 16,384-rank disjoint job of docs/dry_run.md: a data-parallel vision encoder beside the
# language model at tensor 8 x pipeline 4 x data 448
BIG = {"modules": {"vision": {"ranks": 2048}, "language": {"ranks": 14336, "tensor": 8, "pipeline": 4}}}


def _plan(parallel: dict[str, Any], world: int | None = None) -> ModulePlan:
    return Config({"parallel": parallel}).parallel.module_plan(world)


def _config(tmp_path: Path, parallel: dict[str, Any], name: str = "cfg.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"parallel": parallel}))
    return path


def _fmt(groups: list[list[int]]) -> str:
    return " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)


def _crossing(groups: list[list[int]], per_node: int) -> int:
    """Brute force: the groups holding ranks of two nodes (node = rank // per_node)."""
    return sum(len({r // per_node for r in g}) > 1 for g in groups)


# ----------------------------------------------------------------------------- plan: text
def _sections(out: str) -> dict[str, str]:
    """The text of each module's section of ``plan``'s output, by module name."""
    parts = re.split(r"^module (\w+): ", out, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_plan_text_shows_each_modules_ranks_groups_and_grid(tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path, MIXED)
    assert main(["plan", "--config", str(cfg)]) == 0  # the world: the ranks the modules cover
    out = capsys.readouterr().out
    mods = _plan(MIXED, 8)
    assert out.startswith("parallelctx plan: 3 modules on 8 ranks")
    for line in mods.describe().splitlines():
        assert f"  {line}\n" in out
    sections = _sections(out)
    assert list(sections) == list(mods.names)
    for name, text in sections.items():
        lay = mods.layouts[name]
        heading = text.splitlines()[0]
        assert heading.startswith(
            f"ranks {lay.offset}-{lay.offset + lay.world_size - 1} ({lay.world_size} ranks)"
        )
        others = [o for o in mods.names if o != name and mods.layouts[o].ranks == lay.ranks]
        assert ("colocated with " + ", ".join(others) in heading) == bool(others), heading
        assert ("the language module" in heading) == (name == mods.language)
        rows = {
            m: (int(size), int(count), members)
            for m, size, count, members in re.findall(r"│ (\w+)\s+│\s+(\d+) │\s+(\d+) │ (.*?)\s+│", text)
        }
        assert list(rows) == [m.value for m in lay.shown_modes()]
        for mode in lay.shown_modes():
            groups = lay.groups(mode)
            assert rows[mode.value] == (len(groups[0]), len(groups), _fmt(groups)), (name, mode)
        # the grid: every cell a rank of the module, where the plan puts it
        stage = None
        cells = set()
        for line in text.splitlines():
            if line.startswith("pipeline stage "):
                stage = int(line.split()[2].rstrip(":"))
                continue
            row = re.match(r"  dp (\d+)\s+(.*)", line)
            if row and stage is not None:
                for column, rank in enumerate(int(r) for r in row.group(2).split()):
                    coords = lay.coords(rank)
                    assert (coords["pp"], coords["dp"], coords["tp"]) == (stage, int(row.group(1)), column)
                    cells.add(rank)
        assert cells == set(lay.ranks), name


def test_plan_refuses_size_flags_and_a_world_the_modules_do_not_cover(tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path, DISJOINT)
    assert main(["plan", "--config", str(cfg), "--tensor", "2"]) == 2
    err = capsys.readouterr().err
    assert "--tensor sets the sizes of one layout" in err and "parallel.modules.<name>.tensor" in err
    assert main(["plan", "--config", str(cfg), "--world-size", "16"]) == 2
    assert "world_size=16" in capsys.readouterr().err
    assert main(["plan", "--config", str(cfg), "--nodes", "2", "--nproc-per-node", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 8


# ----------------------------------------------------------------------------- plan: JSON
def test_plan_json_gives_every_modules_groups(tmp_path: Path, capsys) -> None:
    cfg = _config(tmp_path, MIXED)
    assert main(["plan", "--config", str(cfg), "--world-size", "8", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    mods = _plan(MIXED, 8)
    assert printed["world_size"] == 8 and printed["language"] == mods.language
    assert list(printed["modules"]) == list(mods.names)
    for name, lay in mods.layouts.items():
        entry = printed["modules"][name]
        assert entry["ranks"] == [lay.ranks[0], lay.ranks[-1]]
        assert entry["layout"] == lay.describe()
        assert entry["colocated_with"] == [
            o for o in mods.names if o != name and mods.layouts[o].ranks == lay.ranks
        ]
        assert entry["groups"] == {m.value: lay.groups(m) for m in ParallelMode}
    # --output writes the same object
    target = tmp_path / "plan.json"
    assert main(["plan", "--config", str(cfg), "--output", str(target)]) == 0
    assert json.loads(target.read_text()) == printed


def test_plan_json_places_each_module_on_the_nodes(tmp_path: Path, capsys) -> None:
    # language on ranks 3-8 with tensor 2 and 4 ranks per node: its tensor group [3, 4] crosses
    parallel = {"modules": {"vision": {"ranks": 3}, "language": {"ranks": 6, "tensor": 2, "pipeline": 3}}}
    cfg = _config(tmp_path, parallel)
    assert main(["plan", "--config", str(cfg), "--nproc-per-node", "4", "--json"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    mods = _plan(parallel, 9)
    assert printed["placement"]["nodes"] == 3 and printed["placement"]["nproc_per_node"] == 4
    want_warnings = [("uneven_nodes", None, None)]  # 9 ranks on nodes of 4, said once for the job
    for name, lay in mods.layouts.items():
        spans = printed["placement"]["modules"][name]
        for mode in ParallelMode:
            groups = lay.groups(mode)
            assert spans[mode.value]["crossing"] == _crossing(groups, 4), (name, mode)
            assert spans[mode.value]["groups"] == len(groups)
        for mode in INTRA_NODE_MODES:
            if lay.size(mode) > 1 and _crossing(lay.groups(mode), 4):
                want_warnings.append(("crosses_nodes", mode.value, name))
    got = [(w["kind"], w["mode"], w["module"]) for w in printed["warnings"]]
    assert got == want_warnings and ("crosses_nodes", "tensor", "language") in got
    assert "warning: module language: " in captured.err


def test_plan_json_of_a_large_job_is_summarised_per_module(tmp_path: Path, capsys) -> None:
    parallel = {
        "modules": {"vision": {"ranks": 2048}, "language": {"ranks": 30720, "tensor": 8, "pipeline": 4}}
    }
    cfg = _config(tmp_path, parallel)
    assert main(["plan", "--config", str(cfg), "--json"]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert summary["truncated"] and "--output FILE" in out.err and len(out.out) < 50_000
    mods = _plan(parallel, 32768)
    for name, lay in mods.layouts.items():
        tensor = summary["modules"][name]["summary"]["tensor"]
        groups = lay.group_array("tensor")
        assert tensor == {
            "group_size": groups.shape[1],
            "groups": groups.shape[0],
            "first": groups[:4, :16].tolist(),
        }


def test_placement_of_a_modules_layout_counts_its_global_ranks() -> None:
    lay = _plan({"modules": {"a": {"ranks": 3}, "b": {"ranks": 6, "tensor": 2, "context": 3}}}).layouts["b"]
    assert lay.offset == 3
    for g in (2, 3, 4, 6):
        spans = {s.mode: s for s in node_spans(lay, layout_nodes(lay, g))}
        for mode in ParallelMode:
            assert spans[mode.value].crossing == _crossing(lay.groups(mode), g), (g, mode)
        warned = {w.mode for w in placement_warnings(lay, g, whole_job=False)}
        want = {m.value for m in INTRA_NODE_MODES if lay.size(m) > 1 and _crossing(lay.groups(m), g)}
        assert warned == want, g
    assert placement_warnings(plan(9), 4)[0].kind == "uneven_nodes"  # the job's own warning stays


# ----------------------------------------------------------------------------- picture
def test_picture_cells_are_the_plans_groups_on_the_whole_jobs_ranks() -> None:
    from parallelctx.cli.picture import NO_GROUP, OUTSIDE, cell_groups, module_panels, picture_modes

    mods = _plan(MIXED, 8)
    panels = module_panels(mods)
    assert list(panels) == list(mods.names)
    for name, lay in mods.layouts.items():
        assert panels[name] == [ParallelMode.GLOBAL, *picture_modes(lay)]
        for mode in panels[name]:
            cells = cell_groups(lay, mode, 8)
            groups = lay.groups(mode)
            for rank in range(8):
                if rank not in lay.ranks:
                    assert cells[rank] == OUTSIDE
                    continue
                holding = [i for i, g in enumerate(groups) if rank in g]
                assert cells[rank] == (holding[0] if holding else NO_GROUP), (name, mode, rank)


def _png_description(data: bytes) -> str:
    pos, text = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]
        if kind == b"tEXt":
            key, value = body.split(b"\0", 1)
            text[key] = value.decode()
        pos += 12 + length
    return text[b"Description"]


def test_picture_draws_one_block_per_module(tmp_path: Path, capsys) -> None:
    from parallelctx.cli.picture import PictureError, draw_modules, module_panels

    cfg = _config(tmp_path, DISJOINT)
    png = tmp_path / "modules.png"
    assert main(["plan", "--config", str(cfg), "--nproc-per-node", "4", "--png", str(png)]) == 0
    assert capsys.readouterr().out == ""  # the picture instead of the text
    mods = _plan(DISJOINT, 8)
    want = [f"{name}:{mode.value}" for name, modes in module_panels(mods).items() for mode in modes]
    assert _png_description(png.read_bytes()) == "panels: " + ",".join(want)
    svg = tmp_path / "modules.svg"
    assert draw_modules(mods, 4, svg) == want
    ids = re.findall(r'id="panel-([\w-]+)"', svg.read_text())
    assert ids == [p.replace(":", "-") for p in want]
    with pytest.raises(PictureError, match="pass --nproc-per-node G"):
        draw_modules(mods, None, svg)
    assert main(["plan", "--config", str(cfg), "--svg", str(svg)]) == 2
    assert "pass --nproc-per-node G" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the sweep's checks
def _reports(parallel: dict[str, Any], world: int) -> dict[int, dict[str, Any]]:
    """What a correct dry run of every rank records, built from the plan alone."""
    mods = _plan(parallel, world)
    out = {}
    for rank in range(world):
        modules = {}
        for name in mods.of_rank(rank):
            lay = mods.layouts[name]
            groups = {m.value: lay.group_of(m, rank) for m in ParallelMode if m is not ParallelMode.GLOBAL}
            modules[name] = {
                "ranks": [[lay.ranks[0], lay.ranks[-1]]],
                "groups": {m: g for m, g in groups.items() if g},
            }
        primary = mods.primary(rank)
        out[rank] = {
            "rank": rank,
            "world_size": world,
            "parallel": parallel,
            "module": primary,
            "modules": modules,
            "groups": modules[primary]["groups"],
            "new_groups": [],
        }
    return out


def test_sweep_checks_pass_the_plans_groups_and_name_a_wrong_module_group() -> None:
    good = _reports(MIXED, 8)
    assert check_all(good) == []
    mods = _plan(MIXED, 8)
    assert mods.primary(1) == "vision" and "audio" in mods.of_rank(1)
    bad = copy.deepcopy(good)
    bad[1]["modules"]["audio"]["groups"]["pipeline"] = [1, 2]  # audio's, not the primary module's
    audio = mods.layouts["audio"]
    assert check_plan(bad) == [
        f"rank 1: its audio pipeline group is [1, 2] but plan says {audio.group_of('pipeline', 1)}"
    ]
    group = audio.group_of("pipeline", 1)
    assert group == audio.group_of("pipeline", 0) == audio.group_of("pipeline", 2)
    assert check_membership(bad) == [
        f"audio pipeline group: rank 0 lists {group} but rank 1 lists [1, 2]",
        f"audio pipeline group: rank 1 lists [1, 2] but rank 2 lists {group}",
    ]
    # a rank that lost a module, answers for another, or lists other ranks for it
    bad = copy.deepcopy(good)
    del bad[5]["modules"]["language"]
    bad[2]["module"] = "audio"
    bad[6]["modules"]["language"]["ranks"] = [[4, 6]]
    found = check_plan(bad)
    assert "rank 5: its report holds modules none but plan says language (in the config's order)" in found
    assert "rank 2: gpc answers for module 'audio' but plan says 'vision'" in found
    assert "rank 6: module language's ranks are 4-6 but plan says 4-7" in found
    # a report of one layout for a job of modules
    bad = copy.deepcopy(good)
    del bad[3]["modules"]
    assert any(m.startswith("rank 3: its report holds no modules") for m in check_plan(bad))


def test_a_value_declared_the_same_across_another_modules_group_is_checked_there() -> None:
    from parallelctx.cli.sweep import check_same_across

    reports = _reports(MIXED, 8)
    mods = _plan(MIXED, 8)
    audio = mods.layouts["audio"]
    for rank, rep in reports.items():
        if "audio" in rep["modules"]:  # one value per audio pipeline group ...
            rep["same_across"] = {"shape": "audio:pipeline"}
            rep["values"] = {"shape": audio.group_of("pipeline", rank)[0]}
    assert check_same_across(reports) == []
    odd = audio.group_of("pipeline", 1)[-1]
    reports[odd]["values"]["shape"] = 99  # ... but one rank recorded another
    (found,) = check_same_across(reports)
    assert found.startswith("'shape' must be the same across the audio:pipeline group") and "99" in found
    with pytest.raises(LayoutError, match="needs same_across"):
        from parallelctx.dryrun import record

        record("shape", 1, module="audio")


def test_membership_of_a_large_group_is_compared_in_linear_time() -> None:
    # 4096 swept members of one data group (a data-parallel module swept whole): seconds would
    # be the square of the group's size, compared member by member
    members = list(range(4096))
    reports = {r: {"groups": {"data": members}} for r in members}
    begin = time.perf_counter()
    assert check_membership(reports) == []
    assert time.perf_counter() - begin < 2.0
    reports[17] = {"groups": {"data": [17]}}
    assert check_membership(reports) == [
        f"data group: rank {r} lists {_short(members)} but rank 17 lists [17]" for r in range(17)
    ]


def _short(ranks: list[int]) -> str:
    return f"[{', '.join(map(str, ranks[:12]))}, ... ({len(ranks)} ranks)]" if len(ranks) > 12 else str(ranks)


def test_cover_holds_every_coordinate_of_every_module() -> None:
    mods = _plan(BIG, 16384)
    ranks = parse_ranks("cover", 16384, layout=mods)
    assert ranks == covering_set(mods) and ranks[0] == 0 and ranks[-1] == 16383
    for name, lay in mods.layouts.items():
        mine = [r for r in ranks if r in lay.ranks]
        for mode in COVERED_MODES:
            held = {lay.local_rank(mode, r) for r in mine if lay.group_of(mode, r)}
            assert held == set(range(lay.size(mode))), (name, mode)
    assert len(ranks) == 2048 + len([r for r in ranks if r >= 2048])  # vision: data 2048, every rank
    with pytest.raises(ValueError, match="not world_size=8"):
        parse_ranks("cover", 8, layout=mods)
    with pytest.raises(LayoutError, match="world_size=16"):
        plan_of(DISJOINT, 16)


# ----------------------------------------------------------------------------- dry runs
def _dry(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "parallelctx", "dry-run", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def _script(tmp_path: Path, parallel: dict[str, Any], body: str = "") -> Path:
    path = tmp_path / "job.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import sys
            import torch
            import torch.distributed as dist
            import parallelctx
            from parallelctx import gpc
            parallelctx.launch_from_torch(dict(parallel={parallel!r}, seed=77))
            """
        )
        + textwrap.dedent(body)
        + "gpc.destroy()\n"
    )
    return path


def test_one_rank_of_colocated_modules_reports_every_module(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = _dry("--world-size", 8, "--rank", 1, "--json", out, _script(tmp_path, MIXED), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    mods = _plan(MIXED, 8)
    assert report["module"] == mods.primary(1) == "vision"
    assert list(report["modules"]) == list(mods.of_rank(1)) == ["vision", "audio"]
    for name, entry in report["modules"].items():
        lay = mods.layouts[name]
        want = {m.value: lay.group_of(m, 1) for m in ParallelMode if m is not ParallelMode.GLOBAL}
        assert entry["groups"] == {m: g for m, g in want.items() if g}, name
        assert entry["coords"] == {m.value: lay.local_rank(m, 1) for m in ParallelMode if lay.group_of(m, 1)}
        assert entry["ranks"] == [[lay.ranks[0], lay.ranks[-1]]] and entry["layout"] == lay.describe()
        number = mods.index(name)
        assert entry["seeds"] == {
            str(getattr(k, "value", k)): mode_seed(lay, 1, k, 77, number) for k in STREAMS
        }
    primary = report["modules"]["vision"]
    assert (report["groups"], report["coords"], report["seeds"]) == (
        primary["groups"],
        primary["coords"],
        primary["seeds"],
    )
    assert Config({"parallel": report["parallel"]}).parallel.module_plan(8) == mods  # loads again
    assert "dry-run rank 1 of 8: vision: tensor=1 pipeline=0 data=0 context=0, audio: tensor=0" in proc.stdout


def test_cover_sweep_of_a_disjoint_job_checks_every_module(tmp_path: Path) -> None:
    # the code path of the 16,384-rank sweep below, at 16 ranks
    parallel = {"modules": {"vision": {"ranks": 4}, "language": {"ranks": 12, "tensor": 2, "pipeline": 2}}}
    out = tmp_path / "sweep.json"
    proc = _dry(
        "--world-size", 16, "--ranks", "cover", "--json", out, _script(tmp_path, parallel), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mods = _plan(parallel, 16)
    saved = json.loads(out.read_text())
    swept = sorted(int(r) for r in saved["reports"])
    assert swept == covering_set(mods) and f"{len(swept)} of 16 ranks" in proc.stdout
    assert "all checks passed" in proc.stdout and saved["mismatches"] == []
    for rank in swept:
        rep = saved["reports"][str(rank)]
        (name,) = mods.of_rank(rank)
        lay = mods.layouts[name]
        assert rep["module"] == name and list(rep["modules"]) == [name]
        assert rep["modules"][name]["groups"]["data"] == lay.group_of("data", rank)


def test_sweep_names_another_modules_group_a_rank_skips(tmp_path: Path) -> None:
    # rank 1 skips an all-reduce on audio's pipeline group (audio is not the module gpc answers for)
    body = """
    group = gpc.module("audio").get_group("pipeline") if "audio" in gpc.modules else None
    if group is not None and dist.get_rank() != 1:
        dist.all_reduce(torch.zeros(2), group=group)
    """
    proc = _dry("--world-size", 8, "--ranks", "all", _script(tmp_path, MIXED, body), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    members = _plan(MIXED, 8).layouts["audio"].group_of("pipeline", 1)
    named = [ln for ln in proc.stdout.splitlines() if f"audio pipeline group {members}" in ln]
    assert named and "rank 1" in named[0], proc.stdout


@pytest.mark.sweeps
def test_cover_sweep_of_16384_ranks_in_two_disjoint_modules(tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    seen.mkdir()
    body = f"""
    open({str(seen)!r} + "/" + str(dist.get_rank()), "w").close()
    """
    begin = time.perf_counter()
    proc = _dry(
        "--world-size",
        16384,
        "--ranks",
        "cover",
        "--quiet",
        _script(tmp_path, BIG, body),
        cwd=tmp_path,
        timeout=3000,
    )
    took = time.perf_counter() - begin
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    mods = _plan(BIG, 16384)
    swept = sorted(int(p.name) for p in seen.iterdir())
    assert swept == covering_set(mods) and f"{len(swept)} of 16384 ranks" in proc.stdout
    assert "all checks passed" in proc.stdout
    for lay in mods.layouts.values():  # every data index of both modules, every stage and tensor rank
        for mode in ("tensor", "pipeline", "data"):
            held = {lay.local_rank(mode, r) for r in swept if r in lay.ranks}
            assert held == set(range(lay.size(mode))), mode
    print(f"16,384-rank cover sweep: {len(swept)} ranks in {took:.0f} s")


# ----------------------------------------------------------------------------- check (torchrun)
def test_verify_of_module_layouts_on_global_ranks() -> None:
    from parallelctx.cli.verify import problems, verify

    mods = _plan(MIXED, 8)
    for name, lay in mods.layouts.items():
        honest = {}
        for rank in lay.ranks:
            honest[rank] = {}
            for mode in ParallelMode:
                members = lay.group_of(mode, rank)
                if members:
                    local = members.index(rank)
                    honest[rank][mode.value] = {
                        "members": members, "order": members, "cpu_members": members, "local_rank": local,
                        "size": len(members), "next": members[(local + 1) % len(members)],
                        "prev": members[(local - 1) % len(members)], "first": local == 0,
                        "last": local == len(members) - 1,
                    }  # fmt: skip
        assert problems(verify(lay, honest)) == [], name
        other = mods.layouts["audio" if name == "vision" else "vision"]
        if other.ranks == lay.ranks:  # a colocated module's groups are not this module's
            assert problems(verify(other, honest)), name


def _torchrun(args: list[str], timeout: int = 280) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "8", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_check_under_torchrun_proves_every_modules_groups(tmp_path: Path) -> None:
    cfg = _config(tmp_path, MIXED)
    options = ["--config", str(cfg), "--sizes", "4KiB", "--iters", "1", "--json", "--quiet"]
    proc = _torchrun(["-m", "parallelctx", "check", *options])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    report = json.loads(line)
    mods = _plan(MIXED, 8)
    assert report["ok"] and report["world_size"] == 8 and list(report["modules"]) == list(mods.names)
    assert report["module_seeds"] == {"ok": True, "problems": []}
    for name, lay in mods.layouts.items():
        got = report["modules"][name]
        assert got["module"] == name and got["layout"] == lay.describe() and got["seeds"]["ok"]
        for mode in ParallelMode:
            array = lay.group_array(mode)
            entry = got["modes"][mode.value]
            assert entry["ok"] and (entry["groups"], entry["group_size"]) == array.shape, (name, mode)
        timing = got["modes"]["tensor"]["timing"]
        if lay.tensor > 1:
            assert [g["ranks"] for g in timing["groups"]] == lay.groups("tensor")
    # a module's tensor group swapped for its data group, as a bug in group creation would
    script = tmp_path / "tamper.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            from parallelctx import ParallelMode
            from parallelctx.cli import build_parser
            from parallelctx.cli.check import run

            def tamper(gpc):
                if "language" in gpc.modules:
                    ctx = gpc.module("language")
                    ctx._groups[ParallelMode.TENSOR] = ctx._groups[ParallelMode.DATA]
                    ctx._cpu_groups[ParallelMode.TENSOR] = ctx._cpu_groups[ParallelMode.DATA]

            sys.exit(run(build_parser().parse_args(["check", *sys.argv[1:]]), prepare=tamper))
            """
        )
    )
    proc = _torchrun([str(script), *options])
    assert proc.returncode != 0
    report = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))
    failed = {(n, m) for n, r in report["modules"].items() for m, e in r["modes"].items() if not e["ok"]}
    assert ("language", "tensor") in failed and all(n == "language" for n, _ in failed), failed
    rank = mods.layouts["language"].ranks[0]
    want = mods.layouts["language"].group_of("tensor", rank)
    assert any(
        p.startswith(f"tensor.members on rank {rank}: got") and p.endswith(f"expected {want}")
        for p in report["modules"]["language"]["modes"]["tensor"]["problems"]
    )
    assert all(r["ok"] for n, r in report["modules"].items() if n != "language")
