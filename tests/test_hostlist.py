"""Slurm host list and task count parsing (parallelctx.hostlist), against Slurm's own expansions."""

from __future__ import annotations

import pytest

from parallelctx.hostlist import HostlistError, expand_hostlist, expand_tasks_per_node, first_host


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n1", ["n1"]),
        ("localhost", ["localhost"]),
        ("n[1-2]", ["n1", "n2"]),  # what srun -N2 gave on the test cluster
        ("node[001-004,010]", ["node001", "node002", "node003", "node004", "node010"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),  # padding from the lower bound
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("node[007]", ["node007"]),
        ("n[1-2],gpu-a[1-2]", ["n1", "n2", "gpu-a1", "gpu-a2"]),
        ("a,b,c", ["a", "b", "c"]),
        ("a[1,3],b", ["a1", "a3", "b"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("gpu-a[1-2]b[0-1]", ["gpu-a1b0", "gpu-a1b1", "gpu-a2b0", "gpu-a2b1"]),
        ("x[1-2]y[5]z", ["x1y5z", "x2y5z"]),
        ("[1-2]node", ["1node", "2node"]),
        ("node-1.cluster.org,node-2.cluster.org", ["node-1.cluster.org", "node-2.cluster.org"]),
        ("c[9-10],c[1,5-6]", ["c9", "c10", "c1", "c5", "c6"]),
        ("  n[1-2]  ", ["n1", "n2"]),
        ("a,,b", ["a", "b"]),  # Slurm skips empty entries
        ("a,", ["a"]),
        ("n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
        ("n[1,1]", ["n1", "n1"]),
        ("node[1-010]", [f"node{i}" for i in range(1, 11)]),  # width of the lower bound
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),  # beyond Slurm 22.05, which rejects it
    ],
)
def test_expand(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


def test_large_list_first_host_is_cheap() -> None:
    # 10**5 x 10**5 names would never fit in memory; the first is found without expanding them
    assert first_host("a[00001-99999]b[00001-99999]") == "a00001b00001"
    assert len(expand_hostlist("n[0001-5000]")) == 5000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("(null)", "empty"),
        ("n[1-2", "never closed"),
        ("n1-2]", r"without '\["),
        ("n[[1-2]]", "nested"),
        ("n[]", "empty brackets"),
        ("n[a-b]", "'a-b'"),
        ("n[3-1]", "backwards"),
        ("n[1-]", "'1-'"),
        (",", "names no host"),
        (" , ", "names no host"),
        ("n[1-2],m[1", "never closed"),
    ],
)
def test_malformed(text: str, message: str) -> None:
    with pytest.raises(HostlistError, match=message) as info:
        expand_hostlist(text)
    assert isinstance(info.value, ValueError)
    with pytest.raises(HostlistError):
        first_host(text)


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("4", [4]),
        ("2(x2)", [2, 2]),  # srun -N2 --ntasks-per-node=2
        ("3,1", [3, 1]),  # srun -N2 -n4 without --ntasks-per-node
        ("2(x3),1", [2, 2, 2, 1]),
        ("1,2(x2),3", [1, 2, 2, 3]),
    ],
)
def test_tasks_per_node(text: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(2)", "x", "2(x)", "2,,1"])
def test_tasks_per_node_malformed(text: str) -> None:
    with pytest.raises(HostlistError, match="neither"):
        expand_tasks_per_node(text)
