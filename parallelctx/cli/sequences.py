"""Cross-rank checks of the calls a dry-run sweep recorded; torch-free.

Input: the swept ranks' reports (their ``calls``: :class:`parallelctx.guard.ledger.CallLedger`).
Three checks, each naming the group (its mode and members, where the ranks are), the call's
position and its call site:

* :func:`check_group_sequences`: the members of a group made different collectives on it (the
  first difference only: a call more or fewer, another kind, another shape or dtype where the
  kind needs them equal, another root or reduce op);
* :func:`check_point_to_point`: a send without its receive (or with another shape, dtype or
  tag) and a receive without its send, per pair of swept ranks;
* :func:`check_wait_cycles`: the ranks' calls played as the real job would progress (a
  collective completes when every member has reached it, a blocking send when its receive is
  reached); ranks left waiting on each other in a cycle are named, with where each waits.
  Asynchronous calls do not block but are posted where made (a blocking send completes on a
  receive its peer posted earlier with ``irecv``). An order that only serialises is no finding.

Only swept ranks are compared; a member that was not swept is taken to make every call.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["check_calls", "check_group_sequences", "check_point_to_point", "check_wait_cycles"]

Reports = Mapping[int, Mapping[str, Any]]
_AXES = (("pipeline", "pipeline stage"), ("tensor", "tensor rank"), ("context", "context rank"),
         ("data", "data rank"), ("expert", "expert rank"))  # fmt: skip
_P2P = {"send": "send", "isend": "send", "send_object_list": "send",
        "recv": "recv", "irecv": "recv", "recv_object_list": "recv"}  # fmt: skip


class _Call(NamedTuple):
    """One call of one rank, unfolded: its entry and its position among the rank's calls on the
    same stream (a group's collectives, or its sends to / receives from one peer)."""

    entry: Mapping[str, Any]
    stream: tuple[Any, ...]
    position: int

    @property
    def kind(self) -> str:
        return str(self.entry["kind"])

    @property
    def blocking(self) -> bool:
        return not self.entry.get("async", False)


Calls = dict[int, list[_Call]]
"""Each swept rank's kept calls, unfolded (:func:`_calls`)."""


def _short(ranks: list[int], limit: int = 12) -> str:
    if len(ranks) <= limit:
        return "[" + ", ".join(map(str, ranks)) + "]"
    return "[" + ", ".join(map(str, ranks[: limit - 2])) + f", ... {ranks[-1]}] ({len(ranks)} ranks)"


def _unfold(rank: int, ledger: Mapping[str, Any], world: int) -> list[_Call]:
    """The rank's kept calls in order, each with its stream and position on it."""
    groups = ledger.get("groups", {})
    keys: dict[str, tuple[int, ...]] = {}  # a group's key -> its members, made once per group
    seen: Counter[tuple[Any, ...]] = Counter()
    out: list[_Call] = []
    for entry in ledger.get("entries", []):
        members_key = keys.get(entry["group"])
        if members_key is None:
            members = groups.get(entry["group"])
            members_key = keys[entry["group"]] = (
                tuple(members) if members is not None else tuple(range(world))
            )
        direction = _P2P.get(entry["kind"])
        if direction is None:
            stream: tuple[Any, ...] = ("group", members_key)
        elif direction == "send":
            stream = ("p2p", rank, entry.get("peer"))
        else:
            stream = ("p2p", entry.get("peer"), rank)
        for _ in range(int(entry.get("n", 1))):
            out.append(_Call(entry, stream, seen[stream]))
            seen[stream] += 1
    return out


def _calls(reports: Reports) -> Calls:
    out = {}
    for rank, rep in reports.items():
        ledger = rep.get("calls")
        if ledger:
            out[rank] = _unfold(rank, ledger, int(rep.get("world_size", 0)))
    return out


def _name_group(members: tuple[int, ...], reports: Reports, world: int) -> str:
    """``data group [5, 13, 21, 29] (pipeline stage 2)``: the mode a swept member holds the
    group as, its members, and the coordinates its swept members share."""
    if len(members) == world:
        return f"world group {_short(list(members))}"
    swept = [r for r in members if r in reports]
    mode, whose = "group", ""
    for rank in swept:
        # the groups gpc answers for, then (parallel.modules) each module's, named with the module
        tables = [("", reports[rank].get("groups", {}))]
        tables += [(f"{m} ", e.get("groups", {})) for m, e in (reports[rank].get("modules") or {}).items()]
        for module, table in tables:
            found = next((name for name, ranks in table.items() if tuple(ranks) == members), None)
            if found is not None:
                mode, whose = f"{module}{found} group", module
                break
        if mode != "group":
            break
    where: list[str] = []
    for axis, words in _AXES if not whose else ():  # another module's group: the coordinates
        if mode.startswith(axis):  # the reports hold at the top are the primary module's
            continue
        values = {reports[r].get("coords", {}).get(axis) for r in swept}
        sizes = {len(reports[r].get("groups", {}).get(axis, [])) for r in swept}
        if len(values) == 1 and None not in values and max(sizes, default=0) > 1:
            where.append(f"{words} {values.pop()}")
    return f"{mode} {_short(list(members))}" + (f" ({', '.join(where)})" if where else "")


def _site(call: _Call) -> str:
    return str(call.entry.get("where", "?"))


def check_group_sequences(reports: Reports, calls: Calls | None = None) -> list[str]:
    """The members of each group made the same collectives on it, in the same order; returns a
    message per group whose swept members differ (the first difference). ``calls``: the
    reports' calls unfolded once for several checks (:func:`check_calls`)."""
    calls = _calls(reports) if calls is None else calls
    world = max((int(rep.get("world_size", 0)) for rep in reports.values()), default=0)
    by_group: dict[tuple[int, ...], dict[int, list[_Call]]] = {}
    for rank, own in calls.items():
        for call in own:
            if call.stream[0] == "group":
                by_group.setdefault(call.stream[1], {}).setdefault(rank, []).append(call)
    out: list[str] = []
    for members, seqs in sorted(by_group.items()):
        swept = [r for r in members if r in calls]
        if len(swept) < 2:
            continue
        keys = {r: tuple(c.entry["agree"] for c in seqs.get(r, [])) for r in swept}
        ranked = Counter(keys.values()).most_common(2)
        common = ranked[0][0]
        odd = [r for r in swept if keys[r] != common]
        if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:  # no majority: name every variant
            out.append(_variants(members, swept, keys, seqs, reports, world))
        elif odd:
            ref = min(r for r in swept if keys[r] == common)
            out.append(_first_difference(members, swept, keys, seqs, ref, odd, reports, world))
        else:
            out.extend(_beyond_window(members, swept, reports, world))
    return out


def _first_difference(
    members: tuple[int, ...],
    swept: list[int],
    keys: dict[int, tuple[str, ...]],
    seqs: dict[int, list[_Call]],
    ref: int,
    odd: list[int],
    reports: Reports,
    world: int,
) -> str:
    common = keys[ref]
    first = min(_position(keys[r], common, seqs.get(r, []), seqs[ref]) for r in odd)
    agreeing = [r for r in swept if keys[r] == common]
    head = f"{_name_group(members, reports, world)}: call {first + 1}"
    if first < len(common):
        call = seqs[ref][first]
        head += f" is {call.entry['shown']} on ranks {_short(agreeing)} ({_site(call)})"
    else:
        head += f" is not made on ranks {_short(agreeing)} (they made {len(common)} call{'s' if len(common) != 1 else ''} on it)"
    parts = []
    for r in odd:
        own = keys[r]
        if _position(own, common, seqs.get(r, []), seqs[ref]) != first:
            continue
        if first >= len(own):
            parts.append(f"rank {r} made no call {first + 1} here (it made {len(own)})")
            continue
        call = seqs[r][first]
        if own[first + 1 : first + 4] == common[first : first + 3]:
            again = first > 0 and own[first] == own[first - 1]
            parts.append(
                f"rank {r} made {call.entry['shown']} {'twice' if again else 'in addition'} here ({_site(call)})"
            )
        elif first < len(common) and own[first : first + 3] == common[first + 1 : first + 4]:
            parts.append(
                f"rank {r} skipped it (its call {first + 1} is the others' call {first + 2}, {call.entry['shown']})"
            )
        else:
            parts.append(f"rank {r} made {call.entry['shown']} here ({_site(call)})")
    return head + "; " + "; ".join(parts) + ": the members must make the same calls in the same order"


def _position(own: tuple[str, ...], common: tuple[str, ...], calls: list[_Call], ref: list[_Call]) -> int:
    """Where ``own`` first differs from ``common``; when one is the start of the other, the
    first call whose site differs (an extra call of the same kind is found where it was made)."""
    shorter = min(len(own), len(common))
    first = next((i for i, (a, b) in enumerate(zip(own, common)) if a != b), shorter)
    if first == shorter:
        first = next((i for i in range(shorter) if _site(calls[i]) != _site(ref[i])), shorter)
    return first


def _variants(
    members: tuple[int, ...],
    swept: list[int],
    keys: dict[int, tuple[str, ...]],
    seqs: dict[int, list[_Call]],
    reports: Reports,
    world: int,
) -> str:
    """The first call at which the members differ, each variant with its ranks (no majority)."""
    longest = max(len(k) for k in keys.values())
    first = next(
        i for i in range(longest + 1) if len({k[i] if i < len(k) else None for k in keys.values()}) > 1
    )
    variants: dict[tuple[str | None, str], list[int]] = {}  # (agree, shown): ranks
    for r in swept:
        key: tuple[str | None, str]
        if first < len(keys[r]):
            call = seqs[r][first]
            key = (keys[r][first], f"{call.entry['shown']} ({_site(call)})")
        else:
            key = (None, f"no call (they made {len(keys[r])})")
        variants.setdefault(key, []).append(r)
    alike = Counter(shown for _, shown in variants)
    parts = "; ".join(
        f"ranks {_short(rs)} made {shown}" + (f" [{agree}]" if alike[shown] > 1 else "")
        for (agree, shown), rs in variants.items()
    )
    return (
        f"{_name_group(members, reports, world)}: call {first + 1} differs: {parts}: the members "
        "must make the same calls in the same order"
    )


def _beyond_window(members: tuple[int, ...], swept: list[int], reports: Reports, world: int) -> list[str]:
    """Calls past the kept window: compare each swept member's count and hash of the group."""
    found = {}
    for r in swept:
        ledger = reports[r].get("calls") or {}
        key = next((k for k, m in ledger.get("groups", {}).items()
                    if (tuple(m) if m is not None else tuple(range(world))) == members), None)  # fmt: skip
        if key is None:
            continue
        found[r] = (ledger.get("counts", {}).get(key, 0), ledger.get("digests", {}).get(key))
    if len(set(found.values())) <= 1:
        return []
    counts = ", ".join(f"rank {r}: {c}" for r, (c, _) in sorted(found.items())[:8])
    return [
        f"{_name_group(members, reports, world)}: the members' calls differ after the calls every "
        f"report keeps in full (calls made: {counts}); run fewer steps in the dry run to see where"
    ]


def check_point_to_point(reports: Reports, calls: Calls | None = None) -> list[str]:
    """Every send between two swept ranks has its receive, with the same shape, dtype and tag,
    and every receive its send (a receive from any source takes any send left over); returns a
    message per pair that does not match. ``calls`` as for :func:`check_group_sequences`."""
    calls = _calls(reports) if calls is None else calls
    sends: dict[tuple[int, int], list[_Call]] = {}
    recvs: dict[tuple[int, int], list[_Call]] = {}
    spare: dict[int, int] = {}
    for own in calls.values():
        for call in own:
            if call.stream[0] != "p2p":
                continue
            _, src, dst = call.stream
            if _P2P[call.kind] == "send":
                sends.setdefault((src, dst), []).append(call)
            elif src is None:
                spare[dst] = spare.get(dst, 0) + 1
            else:
                recvs.setdefault((src, dst), []).append(call)
    out: list[str] = []
    for pair in sorted(set(sends) | set(recvs), key=lambda p: (p[0], p[1])):
        src, dst = pair
        if src not in calls or dst not in calls:
            continue
        sent, got = sends.get(pair, []), recvs.get(pair, [])
        for i, (s, r) in enumerate(zip(sent, got)):
            if (s.entry["agree"], s.entry.get("tag")) != (r.entry["agree"], r.entry.get("tag")):
                out.append(
                    f"rank {src} -> rank {dst}: send {i + 1} is {s.entry['shown']} tag {s.entry.get('tag')} "
                    f"({_site(s)}) but its receive is {r.entry['shown']} tag {r.entry.get('tag')} ({_site(r)})"
                )
                break
        if len(sent) > len(got):
            extra = len(sent) - len(got)
            taken = min(extra, spare.get(dst, 0))
            spare[dst] = spare.get(dst, 0) - taken
            if extra > taken:
                s = sent[len(got)]
                out.append(
                    f"rank {src} sends {len(sent)} times to rank {dst}{_shared(src, dst, reports)} "
                    f"({_coords(src, reports)} -> {_coords(dst, reports)}), rank {dst} receives from it {len(got) + taken} times: send "
                    f"{len(got) + taken + 1}, {s.entry['shown']} ({_site(s)}), has no receive"
                )
        elif len(got) > len(sent):
            r = got[len(sent)]
            out.append(
                f"rank {dst} receives {len(got)} times from rank {src}{_shared(dst, src, reports)} "
                f"({_coords(dst, reports)} <- {_coords(src, reports)}), rank {src} sends to it {len(sent)} times: receive "
                f"{len(sent) + 1}, {r.entry['shown']} ({_site(r)}), has no send"
            )
    named = {(src, dst) for src, dst in sorted(set(sends) | set(recvs)) if any(
        m.startswith((f"rank {src} ", f"rank {dst} ")) for m in out)}  # fmt: skip
    return out + _p2p_beyond_window(reports, named)


def _p2p_beyond_window(reports: Reports, named: set[tuple[int, int]]) -> list[str]:
    """Pairs of swept ranks, one of whose reports kept only part of its calls, whose counts (or
    hashes) of sends and receives differ: the ledger counts and hashes every call per peer."""
    ledgers = {r: rep.get("calls") or {} for r, rep in reports.items() if rep.get("calls")}
    out = []
    for src, ledger in sorted(ledgers.items()):
        counts = ledger.get("counts", {})
        peers = {int(k.split()[1]) for k in counts if k.split()[0] == "send" and k.split()[1] != "None"}
        peers |= {r for r, lg in ledgers.items() if f"recv {src}" in lg.get("counts", {})}
        for dst in sorted(peers):
            if dst not in ledgers or dst == src or (src, dst) in named or (dst, src) in named:
                continue
            other = ledgers[dst]
            if ledger.get("kept", 0) < ledger.get("window", 1) and other.get("kept", 0) < other.get(
                "window", 1
            ):
                continue  # both kept every call: check_point_to_point compared them in full
            sent = counts.get(f"send {dst}", 0)
            got = other.get("counts", {}).get(f"recv {src}", 0)
            spare = other.get("counts", {}).get("recv None", 0)
            same_hash = ledger.get("digests", {}).get(f"send {dst}") == other.get("digests", {}).get(
                f"recv {src}"
            )
            if got > sent or sent > got + spare or (sent == got and not spare and not same_hash):
                out.append(
                    f"rank {src} -> rank {dst}: after the calls every report keeps in full, rank {src} sends "
                    f"{sent} times to rank {dst} and rank {dst} receives {got} times from it"
                    + (f" ({spare} from any rank)" if spare else "")
                    + ("" if sent != got else " with other shapes, dtypes or tags")
                    + "; run fewer steps in the dry run to see where"
                )
    return out


def _shared(src: int, dst: int, reports: Reports) -> str:
    """`` on their pipeline group [...]``: the group of ``src`` that holds ``dst`` (the pipeline
    group first), or nothing."""
    groups = reports[src].get("groups", {})
    for mode in ("pipeline", *sorted(groups)):
        members = groups.get(mode)
        if members and dst in members:
            return f" on their {mode} group {_short(list(members))}"
    return ""


def _coords(rank: int, reports: Reports) -> str:
    coords = reports[rank].get("coords", {})
    shown = [f"{words} {coords[axis]}" for axis, words in _AXES
             if axis in coords and len(reports[rank].get("groups", {}).get(axis, [])) > 1]  # fmt: skip
    return ", ".join(shown) if shown else f"rank {rank}"


def check_wait_cycles(reports: Reports, calls: Calls | None = None) -> list[str]:
    """Play the swept ranks' calls as the real job would progress and name every set of ranks
    left waiting on each other in a cycle (each rank, the call it waits in, its group and call
    site, and the rank it waits for); an order that only serialises is no finding.

    An asynchronous call (``isend``, ``irecv``, ``batch_isend_irecv``'s operations, a collective
    with ``async_op=True``) does not block its rank, but it is posted where the rank made it: a
    blocking send completes once its receive is posted (blocking or not), a blocking receive
    once its send is, a blocking collective once every swept member has posted it. Messages
    between two ranks match in order; the ``wait()`` on an asynchronous call is not recorded.
    ``calls`` as for :func:`check_group_sequences`."""
    calls = _calls(reports) if calls is None else calls
    if not calls:
        return []
    world = max(int(rep.get("world_size", 0)) for rep in reports.values())
    need: dict[Any, int] = {}
    for own in calls.values():
        for c in own:
            if c.stream[0] == "group" and c.stream[1] not in need:
                need[c.stream[1]] = sum(1 for m in c.stream[1] if m in calls)
    ptr = dict.fromkeys(calls, 0)
    posted = dict.fromkeys(calls, -1)  # the index of each rank's last posted call
    ordinal: dict[tuple[int, int], int] = {}  # (rank, index): a point-to-point call's place on its pair
    arrived: dict[tuple[Any, int], set[int]] = {}
    sent: Counter[tuple[int, int]] = Counter()  # (src, dst): sends posted
    taken: Counter[tuple[int, int]] = Counter()  # (src, dst): receives posted (any source: once matched)
    anywhere: Counter[int] = Counter()  # dst: asynchronous receives from any source not yet matched
    work = deque(sorted(calls))

    def post(rank: int, index: int, call: _Call) -> None:
        if call.stream[0] == "group":
            key = (call.stream[1], call.position)
            here = arrived.setdefault(key, set())
            here.add(rank)
            if len(here) == need[call.stream[1]]:
                work.extend(m for m in here if m != rank)
            return
        _, src, dst = call.stream
        if _P2P[call.kind] == "send":
            ordinal[(rank, index)] = sent[(src, dst)]
            sent[(src, dst)] += 1
            work.append(dst)
        elif src is None:
            if not call.blocking:
                anywhere[rank] += 1
            work.extend(r for r in calls if r != rank)
        else:
            ordinal[(rank, index)] = taken[(src, dst)]
            taken[(src, dst)] += 1
            work.append(src)

    def done(rank: int, index: int, call: _Call) -> bool:
        if call.stream[0] == "group":
            return len(arrived[(call.stream[1], call.position)]) >= need[call.stream[1]]
        _, src, dst = call.stream
        if _P2P[call.kind] == "send":
            if dst not in calls or taken[(src, dst)] > ordinal[(rank, index)]:
                return True
            if anywhere[dst]:
                anywhere[dst] -= 1
                taken[(src, dst)] += 1
                return True
            return False
        if src is not None:
            return src not in calls or sent[(src, dst)] > ordinal[(rank, index)]
        waiting = next((r for r in sorted(calls) if sent[(r, rank)] > taken[(r, rank)]), None)
        if waiting is None:
            return False
        taken[(waiting, rank)] += 1
        return True

    while work:
        rank = work.popleft()
        own = calls[rank]
        while ptr[rank] < len(own):
            index = ptr[rank]
            call = own[index]
            if posted[rank] < index:
                posted[rank] = index
                post(rank, index, call)
            if call.blocking and not done(rank, index, call):
                break
            ptr[rank] += 1

    def current(rank: int) -> _Call | None:
        own = calls[rank]
        return own[ptr[rank]] if ptr[rank] < len(own) else None

    return _cycles(calls, current, arrived, reports, world)


def _cycles(
    calls: dict[int, list[_Call]],
    current: Any,
    arrived: Mapping[tuple[Any, int], set[int]],
    reports: Reports,
    world: int,
) -> list[str]:
    waits: dict[int, list[int]] = {}
    for rank in calls:
        call = current(rank)
        if call is None:
            continue
        if call.stream[0] == "group":
            here = arrived.get((call.stream[1], call.position), set())
            waits[rank] = [m for m in call.stream[1] if m in calls and m != rank and m not in here]
        else:
            _, src, dst = call.stream
            peer = dst if _P2P[call.kind] == "send" else src
            waits[rank] = [peer] if peer is not None and peer in calls else []
    out: list[str] = []
    for cycle in _cycles_of(waits):
        steps = []
        for i, r in enumerate(cycle):
            call = current(r)
            target = cycle[(i + 1) % len(cycle)]
            on = f" on {_name_group(call.stream[1], reports, world)}" if call.stream[0] == "group" else ""
            steps.append(f"rank {r} waits in {call.entry['shown']}{on} ({_site(call)}) for rank {target}")
        out.append(
            f"wait cycle of ranks {_short(sorted(cycle))}: " + "; ".join(steps) + ": none of them can "
            "go on (make the calls on these groups and peers in the same order on every rank)"
        )
    return out


def _cycles_of(waits: dict[int, list[int]]) -> list[list[int]]:
    """One cycle of each set of ranks that wait on each other (a strongly connected part of the
    wait graph with more than one rank), walked from its lowest rank."""
    edges = {r: [m for m in targets if m in waits] for r, targets in waits.items()}
    order: list[int] = []
    seen: set[int] = set()
    for start in sorted(edges):  # Kosaraju: finishing order on the graph ...
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(edges[start]))]
        while stack:
            node, it = stack[-1]
            nxt = next((m for m in it if m not in seen), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(edges[nxt])))
    back: dict[int, list[int]] = {r: [] for r in edges}
    for r, targets in edges.items():
        for m in targets:
            back[m].append(r)
    part: dict[int, int] = {}
    for root in reversed(order):  # ... then the parts on the reversed graph
        if root in part:
            continue
        part[root] = root
        todo = [root]
        while todo:
            node = todo.pop()
            for m in back[node]:
                if m not in part:
                    part[m] = root
                    todo.append(m)
    members: dict[int, list[int]] = {}
    for r, root in part.items():
        members.setdefault(root, []).append(r)
    cycles = []
    for ranks in sorted((sorted(v) for v in members.values() if len(v) > 1), key=lambda v: v[0]):
        inside = set(ranks)
        path: list[int] = []
        index: dict[int, int] = {}
        node = ranks[0]
        while node not in index:
            index[node] = len(path)
            path.append(node)
            node = next(m for m in edges[node] if m in inside)
        cycles.append(path[index[node] :])
    return cycles


def check_calls(reports: Reports) -> list[str]:
    """Run the three checks of the calls; returns every message (empty: they passed, or no
    report recorded its calls)."""
    calls = _calls(reports)
    return [
        *check_group_sequences(reports, calls),
        *check_point_to_point(reports, calls),
        *check_wait_cycles(reports, calls),
    ]
