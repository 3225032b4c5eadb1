"""Slurm host list and task count parsing (parallelctx.hostlist), against Slurm's own expansions."""

from __future__ import annotations

import pytest

from parallelctx.hostlist import (
    HostlistError,
    count_hostlist,
    expand_hostlist,
    expand_tasks_per_node,
    first_host,
    tasks_on_node,
)


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


# --------------------------------------------------------------------------- bounded in time and memory
def test_huge_node_list_first_host_and_count_without_expanding() -> None:
    # SLURM_JOB_NODELIST='n[1-100000000]' used to be expanded in full (MemoryError after 7 s)
    huge = "n[1-100000000]"
    assert first_host(huge) == "n1"
    assert count_hostlist(huge) == 100_000_000
    assert count_hostlist("n[1-2],gpu-a[1-2]b[0-1],x") == 7
    assert count_hostlist("n[1,1]") == 2
    with pytest.raises(
        HostlistError, match=r"names 100000000 hosts, more than the 1048576 parallelctx expands"
    ):
        expand_hostlist(huge)
    assert expand_hostlist("n[1-4]", max_hosts=4) == ["n1", "n2", "n3", "n4"]
    with pytest.raises(HostlistError, match="names 5 hosts, more than the 4"):
        expand_hostlist("n[1-5]", max_hosts=4)


def test_first_host_of_a_huge_range_is_instant() -> None:
    import time

    start = time.perf_counter()
    assert first_host("n[1-999999999999999999]") == "n1"
    assert first_host("a[1-999999999]b[5-999999999]c") == "a1b5c"
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text", ["n[1-" + "9" * 5000 + "]", "n[" + "1" * 19 + "]"])
def test_overlong_numbers_are_refused(text: str) -> None:
    with pytest.raises(HostlistError, match="has a number of more than 18 digits") as info:
        expand_hostlist(text)
    assert len(str(info.value)) < 300  # the message shortens the list


def test_tasks_on_node_without_expanding() -> None:
    assert [tasks_on_node("2(x3),1", n) for n in range(5)] == [2, 2, 2, 1, None]
    assert tasks_on_node("4(x100000000000)", 99_999_999_999) == 4
    with pytest.raises(HostlistError, match=r"covers 100000000 nodes, more than the 1048576"):
        expand_tasks_per_node("1(x100000000)")
    with pytest.raises(HostlistError, match="neither"):
        tasks_on_node("2(x)", 0)
    with pytest.raises(HostlistError, match="more than 18 digits"):
        tasks_on_node("1(x" + "9" * 30 + ")", 0)
