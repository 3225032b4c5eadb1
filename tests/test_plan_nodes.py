"""`parallelctx plan` on nodes: placement warnings (checked against brute force), JSON, text, picture."""

from __future__ import annotations

import ast
import json
import struct
import subprocess
import sys
import zlib
from itertools import permutations
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parallelctx import LayoutError, plan
from parallelctx.cli import main
from parallelctx.cli.placement import node_ids, node_spans, placement_warnings

ROOT = Path(__file__).resolve().parent.parent
TOKENS = ("tp", "cp", "ep", "dp", "pp")


# ----------------------------------------------------------------------------- brute force
def brute_crossing(world: int, order: str, sizes: dict[str, int], axis: str, per_node: int) -> bool:
    """Independent of parallelctx: does any group of ``axis`` hold ranks of two nodes?

    Ranks are mixed-radix numbers over the order string (fastest token first, unnamed tokens
    appended in the canonical order); a group is the ranks that agree on every other coordinate.
    """
    tokens = order.split("-")
    tokens += [t for t in TOKENS if t not in tokens]
    nodes_of_key: dict[tuple[int, ...], set[int]] = {}
    for rank in range(world):
        rest, coords = rank, {}
        for token in tokens:
            rest, coords[token] = divmod(rest, sizes[token])
        key = tuple(coords[t] for t in tokens if t != axis)
        nodes_of_key.setdefault(key, set()).add(rank // per_node)
    return any(len(nodes) > 1 for nodes in nodes_of_key.values())


def expected_warnings(world: int, t: int, c: int, p: int, e: int, et: int, order: str, g: int) -> set:
    dense = {"tp": t, "cp": c, "ep": 1, "dp": world // (t * c * p), "pp": p}
    expert = {"tp": et, "cp": 1, "ep": e, "dp": world // (et * e * p), "pp": p}
    out = set()
    if world % g:
        out.add(("uneven_nodes", None))
    for mode, axis, sizes in (
        ("tensor", "tp", dense),
        ("context", "cp", dense),
        ("expert_tensor", "tp", expert),
    ):
        if sizes[axis] > 1 and brute_crossing(world, order, sizes, axis, g):
            out.add(("crosses_nodes", mode))
    return out


ORDERS = ["-".join(p) for p in permutations(TOKENS)]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(
    t=st.sampled_from([1, 2, 3, 4]),
    c=st.sampled_from([1, 2]),
    p=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([1, 2, 4]),
    e=st.sampled_from([1, 2]),
    et=st.sampled_from([None, 1, 2]),
    order=st.sampled_from(ORDERS),
    g=st.integers(1, 12),
)
def test_node_warning_exactly_when_a_group_crosses_nodes(t, c, p, d, e, et, order, g) -> None:
    world = t * c * p * d
    try:
        layout = plan(world, tensor=t, pipeline=p, context=c, expert=e, expert_tensor=et, order=order)
    except LayoutError:
        assume(False)
    got = {(w.kind, w.mode) for w in placement_warnings(layout, g)}
    assert got == expected_warnings(world, t, c, p, e, layout.expert_tensor, order, g)


def test_warning_names_the_fix(capsys) -> None:
    # tensor on the slow side of data: each tensor group straddles two nodes of 4
    assert (
        main(
            [
                "plan",
                "--world-size",
                "16",
                "--tensor",
                "4",
                "--order",
                "dp-tp",
                "--nproc-per-node",
                "4",
                "--json",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    kinds = {(w["kind"], w["mode"]) for w in printed["warnings"]}
    assert kinds == {("crosses_nodes", "tensor"), ("crosses_nodes", "expert_tensor")}
    assert "order='tp-cp-dp'" in printed["warnings"][0]["suggestion"]
    assert "warning: 4 of 4 tensor groups (size 4) span up to" in captured.err
    assert printed["placement"]["modes"]["tensor"]["max_nodes"] == 4
    # the suggested order is quiet
    assert (
        main(
            [
                "plan",
                "--world-size",
                "16",
                "--tensor",
                "4",
                "--order",
                "tp-cp-dp",
                "--nproc-per-node",
                "4",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["warnings"] == []


def test_sizes_too_large_for_a_node_and_uneven_nodes() -> None:
    warnings = placement_warnings(plan(16, tensor=8), 4)
    assert [w.mode for w in warnings] == ["tensor", "expert_tensor"]
    assert "at most nproc_per_node=4" in warnings[0].suggestion
    uneven = placement_warnings(plan(12, tensor=2), 8)
    assert (
        uneven[0].kind == "uneven_nodes"
        and "nproc_per_node=8 does not divide world_size=12" in uneven[0].message
    )
    with pytest.raises(LayoutError, match="nproc_per_node=0 must be a positive integer"):
        placement_warnings(plan(8), 0)


def test_spans_per_mode() -> None:
    layout = plan(16, tensor=2, pipeline=2)
    spans = {s.mode: s for s in node_spans(layout, node_ids(16, 8))}
    assert spans["tensor"].describe() == "inside one node"
    assert spans["pipeline"].describe() == "spans 2 nodes" and spans["pipeline"].crossing == 8
    assert spans["global"].max_nodes == 2


# ----------------------------------------------------------------------------- JSON and text
def test_json_keys_kept_and_extended(capsys) -> None:
    args = ["plan", "--world-size", "16", "--tensor", "2", "--pipeline", "2", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain == plan(16, tensor=2, pipeline=2).to_dict()  # no placement keys without G
    assert main(args + ["--nproc-per-node", "8"]) == 0
    placed = json.loads(capsys.readouterr().out)
    assert {k: placed[k] for k in plain} == plain
    assert set(placed) - set(plain) == {"placement", "warnings"} and placed["placement"]["nodes"] == 2


def test_config_and_nodes(capsys) -> None:
    assert (
        main(
            [
                "plan",
                "--config",
                str(ROOT / "configs/demo_3d.py"),
                "--nodes",
                "2",
                "--nproc-per-node",
                "4",
                "--json",
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed == {
        **plan(8, tensor=2, pipeline=2).to_dict(),
        "placement": printed["placement"],
        "warnings": [],
    }
    assert main(["plan", "--tensor", "2"]) == 2
    assert "give --world-size N, or --nodes N with --nproc-per-node G" in capsys.readouterr().err


def test_large_world_json_is_summarised(tmp_path, capsys) -> None:
    assert main(["plan", "--world-size", "1048576", "--tensor", "8", "--pipeline", "16", "--json"]) == 0
    out = capsys.readouterr()
    assert len(out.out) < 50_000 and "--output FILE" in out.err
    summary = json.loads(out.out)
    assert summary["truncated"] and summary["summary"]["tensor"] == {
        "group_size": 8,
        "groups": 131072,
        "first": [
            [0, 1, 2, 3, 4, 5, 6, 7],
            [8, 9, 10, 11, 12, 13, 14, 15],
            [16, 17, 18, 19, 20, 21, 22, 23],
            [24, 25, 26, 27, 28, 29, 30, 31],
        ],
    }
    target = tmp_path / "plan.json"
    assert main(["plan", "--world-size", "64", "--tensor", "4", "--output", str(target)]) == 0
    assert json.loads(target.read_text()) == plan(64, tensor=4).to_dict()


def test_text_readable_for_1024_ranks(capsys) -> None:
    assert (
        main(["plan", "--world-size", "1024", "--tensor", "8", "--pipeline", "4", "--nproc-per-node", "8"])
        == 0
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 60 and max(map(len, lines)) <= 120
    assert "on 128 node(s) of 8 ranks" in out and "inside one node" in out and "spans 4 nodes" in out


def _imports_at_top(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
    return names


def test_plan_path_is_torch_free() -> None:
    for name in ("cli/placement", "cli/picture", "cli/main", "cli/plan", "cli/tables", "planning/layout"):
        top = _imports_at_top(ROOT / "parallelctx" / f"{name}.py")
        assert not {n for n in top if n.split(".")[0] in ("torch", "matplotlib")}, (name, top)
        assert not top & {".check", ".verify", ".timing", "..launch", "..context", ".demo"}, (name, top)


# ----------------------------------------------------------------------------- picture
def _png_chunks(data: bytes) -> dict[bytes, list[bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks: dict[bytes, list[bytes]] = {}
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]
        chunks.setdefault(kind, []).append(body)
        pos += 12 + length
    return chunks


def test_png_has_one_panel_per_mode(tmp_path) -> None:
    from parallelctx.cli.picture import picture_modes

    target = tmp_path / "plan.png"
    assert (
        main(
            [
                "plan",
                "--world-size",
                "16",
                "--tensor",
                "2",
                "--pipeline",
                "2",
                "--nproc-per-node",
                "8",
                "--png",
                str(target),
            ]
        )
        == 0
    )
    chunks = _png_chunks(target.read_bytes())
    width, height = struct.unpack(">II", chunks[b"IHDR"][0][:8])
    assert width >= 800 and height >= 300
    text = dict(chunk.split(b"\0", 1) for chunk in chunks.get(b"tEXt", []))
    panels = text[b"Description"].decode().removeprefix("panels: ").split(",")
    expected = [m.value for m in picture_modes(plan(16, tensor=2, pipeline=2))]
    assert panels == expected and "global" not in panels and "context" not in panels
    assert len(panels) == 10


def test_svg_panels_and_errors(tmp_path, monkeypatch) -> None:
    from parallelctx.cli.picture import PictureError, draw

    target = tmp_path / "plan.svg"
    layout = plan(8, tensor=2, context=2)
    names = draw(layout, 4, target)
    svg = target.read_text()
    assert svg.count('id="panel-') == len(names) and 'id="panel-context"' in svg
    with pytest.raises(PictureError, match="pass --nproc-per-node G"):
        draw(layout, None, target)
    with pytest.raises(PictureError, match="use a .png or .svg file"):
        draw(layout, 4, tmp_path / "plan.gif")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PictureError, match=r"pip install 'parallelctx\[plot\]'"):
        draw(layout, 4, target)


def test_plan_into_a_closed_pipe_stops_quietly() -> None:
    # `parallelctx plan --json | head -c 10`: the reader leaves early; no traceback, exit 141.
    proc = subprocess.Popen(
        [sys.executable, "-m", "parallelctx", "plan", "--world-size", "16384", "--tensor", "2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10) == b'{"global":'
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err
