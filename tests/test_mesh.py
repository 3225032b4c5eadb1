"""gpc.device_mesh: dimension names and order, groups reused (none made), DTensor over real ranks.

The pure tests check :func:`parallelctx.mesh.mesh_plan` against the layout for many shapes.
The multi-process tests (gloo) prove each mesh dimension's group by collectives and compare it
with the pure layout in the parent, and shard tensors with DTensor over the mesh.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from probes import probe_group

import parallelctx
from parallelctx import LayoutError, ParallelMode, gpc, plan
from parallelctx.mesh import FLAT_DIMS, MESH_DIMS, MeshError, build_device_mesh, mesh_plan

JOIN_TIMEOUT = 240.0


# --------------------------------------------------------------------------- pure
DENSE = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT = ("pp", "edp_replicate", "edp_shard", "ep", "etp")


def test_default_order_dims_are_torchtitans() -> None:
    p = mesh_plan(plan(16, tensor=2, pipeline=2, context=2))
    assert p.dim_names == DENSE
    assert p.shape == (2, 1, 2, 2, 2)
    assert p.ranks.tolist() == np.arange(16).reshape(2, 1, 2, 2, 2).tolist()
    assert p.modes == (
        ParallelMode.PIPELINE,
        ParallelMode.DATA_REPLICATE,
        ParallelMode.DATA_SHARD,
        ParallelMode.CONTEXT,
        ParallelMode.TENSOR,
    )


def test_hsdp_dims_split_the_data_axis() -> None:
    # torchtitan's dense mesh: arange(W).reshape(pp, dp_replicate, dp_shard, cp, tp)
    p = mesh_plan(plan(32, tensor=2, pipeline=2, replicate=2))
    assert (p.dim_names, p.shape) == (DENSE, (2, 2, 4, 1, 2))
    assert p.ranks.tolist() == np.arange(32).reshape(2, 2, 4, 1, 2).tolist()
    e = mesh_plan(plan(32, tensor=2, pipeline=2, replicate=2, expert=4, expert_tensor=1), "expert")
    assert (e.dim_names, e.shape) == (EXPERT, (2, 2, 2, 4, 1))


def test_internlm_order_puts_data_outermost() -> None:
    p = mesh_plan(plan(8, tensor=2, pipeline=2, order="tp-pp-dp"))
    assert p.dim_names == ("cp", "dp_replicate", "dp_shard", "pp", "tp")  # unnamed axes (cp) come slowest
    assert p.dim_groups(3) == [[0, 2], [1, 3], [4, 6], [5, 7]]  # docs/layout.md's "tp-pp-dp" PIPELINE
    assert p.dim_groups(2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_size_one_axes_are_dimensions_of_size_one() -> None:
    assert mesh_plan(plan(8, tensor=2, pipeline=2)).shape == (2, 1, 2, 1, 2)
    assert mesh_plan(plan(8, tensor=8)).shape == (1, 1, 1, 1, 8)
    assert mesh_plan(plan(8)).shape == (1, 1, 8, 1, 1)
    p = mesh_plan(plan(8, context=4))
    assert (p.dim_names, p.shape) == (DENSE, (1, 1, 2, 4, 1))
    assert p.dim_groups(4) == [[r] for r in range(8)]  # tp of size 1: each rank alone


def test_world_of_one_has_every_dimension_of_size_one() -> None:
    p = mesh_plan(plan(1))
    assert (p.dim_names, p.shape, p.ranks.ravel().tolist()) == (DENSE, (1, 1, 1, 1, 1), [0])
    e = mesh_plan(plan(1), grid="expert")
    assert e.dim_names == EXPERT
    assert e.modes[2] is ParallelMode.EXPERT_DATA_SHARD


def test_expert_mesh_dims() -> None:
    layout = plan(16, tensor=2, pipeline=2, expert=2, expert_tensor=1)
    p = mesh_plan(layout, grid="expert")
    assert p.dim_names == EXPERT  # expert_tensor=1 is a dimension of size 1
    assert p.shape == (2, 1, 4, 2, 1)


def test_docs_expert_mesh_example_with_pp_before_dp() -> None:
    layout = plan(8, tensor=2, pipeline=2, expert=2, expert_tensor=1, order="tp-cp-ep-pp-dp")
    assert mesh_plan(layout).dim_names == ("dp_replicate", "dp_shard", "pp", "cp", "tp")
    assert mesh_plan(layout, grid="expert").dim_names == ("edp_replicate", "edp_shard", "pp", "ep", "etp")


def test_a_grid_with_gtp_remat_is_refused_naming_it() -> None:
    # The mesh has no gtp_remat dimension: with gtp_remat > 1 it would hold world / gtp_remat
    # ranks, and the ranks outside it would fail with an IndexError (or a DeviceMesh over part
    # of the world) instead of a clear refusal.
    layout = plan(8, tensor=2, gtp_remat=2)
    with pytest.raises(LayoutError, match=r"gtp_remat=2.*dense"):
        mesh_plan(layout)
    assert mesh_plan(layout, grid="expert").ranks.size == 8  # expert grid: no gtp_remat there
    layout = plan(8, expert=2, expert_gtp_remat=2)
    with pytest.raises(LayoutError, match=r"expert_gtp_remat=2.*expert"):
        mesh_plan(layout, grid="expert")
    assert mesh_plan(layout).ranks.size == 8
    with pytest.raises(LayoutError, match="gtp_remat=2"):
        build_device_mesh(plan(2, gtp_remat=2), 1, {}, "cpu")


def test_bad_grid_is_named() -> None:
    with pytest.raises(LayoutError, match="grid='sparse'"):
        mesh_plan(plan(4), grid="sparse")


@pytest.mark.parametrize(
    "order", ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "dp-tp-cp-ep-pp", "pp-cp-dp-ep-tp"]
)
def test_every_dimension_matches_the_layout(order: str) -> None:
    checked = 0
    for world in (1, 2, 8, 16, 24, 32, 48, 64):
        for tp, pp, cp, ep, etp in itertools.product((1, 2, 4), repeat=5):
            try:
                layout = plan(
                    world, tensor=tp, pipeline=pp, context=cp, expert=ep, expert_tensor=etp, order=order
                )
            except LayoutError:
                continue
            for grid in ("dense", "expert"):
                p = mesh_plan(layout, grid)
                assert sorted(p.ranks.ravel().tolist()) == list(range(world))
                every = [mode for dims in MESH_DIMS[grid].values() for _, mode, _ in dims]
                assert sorted(p.modes, key=str) == sorted(every, key=str)
                for dim, mode in enumerate(p.modes):
                    assert p.dim_groups(dim) == layout.groups(mode), (layout.describe(), grid, mode)
                # slowest first: strides along the dims of size > 1 decrease
                strides = [layout.strides(grid)[k] for k, n in zip(_keys(p, grid), p.shape) if n > 1]
                assert strides == sorted(strides, reverse=True)
            checked += 1
    assert checked > 50


def _keys(p: Any, grid: str) -> list[str]:
    by_name = {name: key for dims in MESH_DIMS[grid].values() for name, _, key in dims}
    return [by_name[name] for name in p.dim_names]


def _dim_modes(grid: str) -> dict[str, ParallelMode]:
    """Mesh dimension name -> its mode, flattened dimensions included."""
    out = {name: mode for dims in MESH_DIMS[grid].values() for name, mode, _ in dims}
    out.update({name: mode for name, (mode, _) in FLAT_DIMS[grid].items()})
    return out


def test_a_group_that_does_not_match_the_mesh_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 3 of W=8, tensor 2, pipeline 2: its tp slice is [2, 3]; pretend torch's group holds [3, 5].
    layout = plan(8, tensor=2, pipeline=2)
    modes = (
        ParallelMode.PIPELINE,
        ParallelMode.DATA_REPLICATE,
        ParallelMode.DATA_SHARD,
        ParallelMode.CONTEXT,
        ParallelMode.TENSOR,
    )
    groups = {mode: object() for mode in modes}
    members = {
        id(groups[ParallelMode.PIPELINE]): [3, 7],
        id(groups[ParallelMode.DATA_REPLICATE]): [3],
        id(groups[ParallelMode.DATA_SHARD]): [1, 3],
        id(groups[ParallelMode.CONTEXT]): [3],
        id(groups[ParallelMode.TENSOR]): [3, 5],
    }
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: members[id(g)])
    with pytest.raises(
        MeshError, match=r"tensor group of rank 3 holds ranks \[3, 5\].*'tp' through rank 3 is \[2, 3\]"
    ):
        build_device_mesh(layout, 3, groups, "cpu")


def test_a_missing_group_is_refused() -> None:
    layout = plan(8, tensor=2, pipeline=2)
    with pytest.raises(MeshError, match="'pp' \\(pipeline, size 2\\) has no process group on rank 0"):
        build_device_mesh(layout, 0, {}, "cpu")


# --------------------------------------------------------------------------- multi-process
def test_the_mesh_is_built_once_across_the_step_methods() -> None:
    # gpc.device_mesh is "built once": the step methods after launch (set_seed, which the pytest
    # plugin calls before every test on a kept gpc; set_device; detect_num_processes_on_current_node;
    # load_config) gave a new mesh each time since the redesign (skeptic-34).
    parallelctx.launch({"parallel": {"tensor": 1}})
    try:
        dense, expert = gpc.device_mesh, gpc.expert_device_mesh
        gpc.set_seed(5)
        gpc.set_device()
        gpc.detect_num_processes_on_current_node()
        gpc.load_config({"seed": 5})
        assert gpc.device_mesh is dense and gpc.expert_device_mesh is expert
        gpc.init_parallel_groups()  # new groups: a new mesh on them
        assert gpc.device_mesh is not dense
    finally:
        gpc.destroy()


def _probe(group: Any, world: int, rank: int) -> tuple[list[int], list[int]]:
    """Members of ``group`` and their group-rank order, by tests/probes.py's collectives."""
    probed = probe_group(group, world, rank)
    return probed["members"], probed["order"]


def _full(rank: int, rows: int, cols: int) -> torch.Tensor:
    """The tensor rank ``rank`` starts from: different on every rank, so the result shows whose
    data a collective delivered."""
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) + 1000.0 * rank


def _mesh_worker(out_dir: str, expert_mesh: bool) -> None:
    """Runs on every rank: build the meshes, probe every dimension, shard with DTensor."""
    from torch.distributed.distributed_c10d import _world
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = gpc.get_global_rank()
    world = gpc.get_world_size(ParallelMode.GLOBAL)
    groups_before = len(_world.pg_map)
    mesh = gpc.device_mesh
    meshes = {"dense": mesh}
    if expert_mesh:
        meshes["expert"] = gpc.expert_device_mesh
    names = {grid: [*m.mesh_dim_names, *FLAT_DIMS[grid]] for grid, m in meshes.items()}
    subs = {(grid, name): m[name] for grid, m in meshes.items() for name in names[grid]}
    hsdp = mesh["dp_replicate", "dp_shard"]
    groups_after = len(_world.pg_map)
    out: dict[str, Any] = {
        "rank": rank,
        "groups_made": groups_after - groups_before,
        "cached": gpc.device_mesh is mesh,
        "dim_names": {grid: list(m.mesh_dim_names) for grid, m in meshes.items()},
        "shape": {grid: list(m.shape) for grid, m in meshes.items()},
        "coordinate": {grid: m.get_coordinate() for grid, m in meshes.items()},
        "dims": {},
        "hsdp": {"names": list(hsdp.mesh_dim_names), "mesh": hsdp.mesh.tolist()},
    }
    modes = {grid: _dim_modes(grid) for grid in meshes}
    for (grid, name), sub in subs.items():
        group = sub.get_group()
        members, order = _probe(group, world, rank)
        out["dims"][f"{grid}.{name}"] = {
            "members": members,
            "order": order,
            "local_rank": sub.get_local_rank(),
            "is_gpc_group": group is gpc.get_group(modes[grid][name]),
            "sub_mesh": sub.mesh.tolist(),
        }
    missing = []
    for grid, m in meshes.items():
        for name in ("tp", "cp", "etp"):
            if name not in m.mesh_dim_names:
                try:
                    m[name]
                except KeyError:
                    missing.append(f"{grid}.{name}")
    out["missing_raise_keyerror"] = missing

    if "tp" in mesh.mesh_dim_names:
        # DTensor over the tensor dimension: scatter from the tp group's first rank, all-gather
        # back, and a sum that ends in an all-reduce over the same group.
        tp_size = mesh["tp"].size()
        dt = distribute_tensor(_full(rank, 4 * tp_size, 3), mesh["tp"], [Shard(0)])
        out["tp_shard"] = dt.to_local().tolist()
        out["tp_full"] = dt.full_tensor().tolist()
        out["tp_sum"] = float(dt.sum().full_tensor())
    # DTensor over the whole mesh: replicate over every dim but the last two, shard rows over
    # the second-to-last (if any) and columns over the last.
    names = mesh.mesh_dim_names
    placements = [Replicate()] * len(names)
    if len(names) >= 2:
        placements[-2] = Shard(0)
    placements[-1] = Shard(1)
    out["nd_placements"] = [str(p) for p in placements]
    rows, cols = 2 * mesh.shape[-2] if len(names) >= 2 else 2, 3 * mesh.shape[-1]
    nd = distribute_tensor(_full(rank, rows, cols), mesh, placements)
    out["nd_shard"] = nd.to_local().tolist()
    out["nd_full"] = nd.full_tensor().tolist()
    out["groups_made_after_dtensor"] = len(_world.pg_map) - groups_before
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def _run(tmp_path: Path, world: int, parallel: dict[str, Any], expert_mesh: bool) -> list[dict[str, Any]]:
    parallelctx.spawn(
        _mesh_worker,
        world,
        args=(str(tmp_path), expert_mesh),
        config=dict(parallel=parallel),
        backend="gloo",
        timeout=120,
        join_timeout=JOIN_TIMEOUT,
    )
    results = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in results] == list(range(world))
    return results


def _check_dims(layout: Any, results: list[dict[str, Any]], grids: tuple[str, ...]) -> None:
    for res in results:
        rank = res["rank"]
        assert res["groups_made"] == 0, "building or slicing the mesh created process groups"
        assert res["groups_made_after_dtensor"] == 0, "DTensor over the mesh created process groups"
        assert res["cached"]
        for grid in grids:
            p = mesh_plan(layout, grid)
            assert tuple(res["dim_names"][grid]) == p.dim_names
            assert tuple(res["shape"][grid]) == p.shape
            where = [int(i) for i in np.argwhere(p.ranks == rank)[0]]
            assert res["coordinate"][grid] == where
            for name, mode in _dim_modes(grid).items():
                probe = res["dims"][f"{grid}.{name}"]
                expected = layout.group_of(mode, rank)
                assert probe["members"] == expected, (rank, grid, name)
                assert probe["order"] == expected, (rank, grid, name)
                assert probe["sub_mesh"] == expected
                assert probe["local_rank"] == layout.local_rank(mode, rank)
                assert probe["is_gpc_group"], f"{grid}.{name} is not gpc's {mode.value} group"


def _check_dtensor(layout: Any, results: list[dict[str, Any]]) -> None:
    p = mesh_plan(layout)
    for res in results:
        rank = res["rank"]
        if "tp" in p.dim_names:
            tp_group = layout.group_of(ParallelMode.TENSOR, rank)
            src = _full(tp_group[0], 4 * len(tp_group), 3)
            local = layout.local_rank(ParallelMode.TENSOR, rank)
            assert res["tp_shard"] == src[4 * local : 4 * local + 4].tolist()
            assert res["tp_full"] == src.tolist()
            assert res["tp_sum"] == float(src.sum())
        # Every dim scatters/broadcasts from its group's first rank: the data comes from the
        # rank at mesh coordinate 0 on every dimension, global rank 0.
        coord = [int(i) for i in np.argwhere(p.ranks == rank)[0]]
        if len(p.shape) >= 2:
            rows, cols = 2 * p.shape[-2], 3 * p.shape[-1]
            r, c = coord[-2], coord[-1]
            expected = _full(0, rows, cols)[2 * r : 2 * r + 2, 3 * c : 3 * c + 3]
        else:
            rows, cols = 2, 3 * p.shape[-1]
            expected = _full(0, rows, cols)[:, 3 * coord[-1] : 3 * coord[-1] + 3]
        assert res["nd_shard"] == expected.tolist(), rank
        assert res["nd_full"] == _full(0, rows, cols).tolist()


EIGHT = dict(tensor=2, data=dict(replicate=2, shard=2), expert=dict(size=2, tensor=1))  # default order


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 8-rank gloo run shared by the tests below (each spawn costs 8 torch start-ups)."""
    return _run(tmp_path_factory.mktemp("mesh8"), 8, EIGHT, expert_mesh=True)


EIGHT_LAYOUT = plan(8, tensor=2, replicate=2, expert=2, expert_tensor=1)


def test_every_mesh_dimension_is_its_group_8_ranks(eight_ranks: list[dict[str, Any]]) -> None:
    # pp, cp (dense) and etp (expert) have size 1: dimensions on the one-rank group, probed like the
    # rest; flattened dimensions (dp, dp_cp, fsdp, edp, efsdp...) are probed too
    assert eight_ranks[0]["dim_names"] == {"dense": list(DENSE), "expert": list(EXPERT)}
    _check_dims(EIGHT_LAYOUT, eight_ranks, ("dense", "expert"))
    for res in eight_ranks:
        # the 2-d HSDP mesh FSDP2 takes: rows are replicas, columns the shard group
        rank = res["rank"]
        assert res["hsdp"]["names"] == ["dp_replicate", "dp_shard"]
        rows = res["hsdp"]["mesh"]
        assert [rows[0][0], rows[1][0]] == EIGHT_LAYOUT.group_of(ParallelMode.DATA_REPLICATE, rows[0][0])
        assert sorted(r for row in rows for r in row) == EIGHT_LAYOUT.group_of(ParallelMode.DATA, rank)
        assert any(row == EIGHT_LAYOUT.group_of(ParallelMode.DATA_SHARD, rank) for row in rows)
    assert all(r["missing_raise_keyerror"] == ["dense.etp", "expert.tp", "expert.cp"] for r in eight_ranks)


def test_dtensor_over_the_tp_mesh_8_ranks(eight_ranks: list[dict[str, Any]]) -> None:
    _check_dtensor(EIGHT_LAYOUT, eight_ranks)


def test_device_mesh_over_the_world_group_2_ranks(tmp_path: Path) -> None:
    # tensor spans the world: gpc's TENSOR group is the default group, and so is the mesh's.
    results = _run(tmp_path, 2, dict(tensor=2), expert_mesh=False)
    layout = plan(2, tensor=2)
    assert results[0]["dim_names"]["dense"] == list(DENSE)
    _check_dims(layout, results, ("dense",))
    _check_dtensor(layout, results)


def _single_worker(out_dir: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = gpc.device_mesh
    dt = distribute_tensor(_full(0, 4, 3), mesh["dp"], [Shard(0)])
    Path(out_dir, "single.json").write_text(
        json.dumps(
            {
                "names": list(mesh.mesh_dim_names),
                "shape": list(mesh.shape),
                "is_world": all(mesh[n].get_group() is dist.group.WORLD for n in mesh.mesh_dim_names),
                "local": dt.to_local().tolist(),
            }
        )
    )


def test_device_mesh_world_of_one(tmp_path: Path) -> None:
    parallelctx.spawn(_single_worker, 1, args=(str(tmp_path),), config={}, backend="gloo", join_timeout=60)
    res = json.loads(Path(tmp_path, "single.json").read_text())
    assert res == {
        "names": list(DENSE),
        "shape": [1, 1, 1, 1, 1],
        "is_world": True,
        "local": _full(0, 4, 3).tolist(),
    }


def test_device_mesh_before_launch_raises() -> None:
    from parallelctx import NotLaunchedError

    with pytest.raises(NotLaunchedError, match="device_mesh"):
        gpc.device_mesh
