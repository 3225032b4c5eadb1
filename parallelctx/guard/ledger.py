"""The dry run's call ledger: every collective and point-to-point call one simulated rank makes,
in order, with what its peers must agree on.

:class:`CallLedger` keeps, for the rank's report, the rank's calls in program order: the kind,
the group (by its members), what the members must agree on (``agree``: shapes and dtypes where
the kind requires them equal, the root in group ranks, the reduce op), how a person reads it
(``shown``: ``all_reduce(float32[4, 8])``), the peer of a point-to-point call, whether it was
asynchronous, and the call site. It stays small: runs of identical consecutive calls are folded
into one entry with a count, and only the first :data:`WINDOW` calls are kept in full; every
call, kept or not, is counted and hashed per stream (a group's collectives, or the calls to or
from one peer), so a difference after the window still shows. The cross-rank checks are
:mod:`parallelctx.cli.sequences`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "AGREED",
    "AGREED_TENSOR",
    "P2P_KINDS",
    "WINDOW",
    "CallLedger",
    "agreed_dims",
    "describe",
    "p2p_async",
    "tensor_text",
    "tensor_words",
]

WINDOW = 1000
"""Calls of one rank kept in full (folded runs count each call); later calls are only counted
and hashed per stream."""

P2P_KINDS = {"send": "send", "isend": "send", "send_object_list": "send",
             "recv": "recv", "irecv": "recv", "recv_object_list": "recv"}  # fmt: skip
"""The point-to-point calls and their direction."""

_ASYNC_P2P = {"isend", "irecv"}
AGREED: dict[str, str] = {
    "all_reduce": "all",
    "broadcast": "all",
    "reduce": "all",
    "all_gather_into_tensor": "all",
    "reduce_scatter_tensor": "all",
    "all_to_all_single": "rows",
    "all_to_all": "none",
    "gather": "all",
    "scatter": "all",
    "all_gather": "all",
    "reduce_scatter": "all",
}
"""How much of a collective's tensor every member must give alike (``tensor_words``'s ``dims``:
``all`` its dtype and shape, ``rows`` all but the first dimension, ``none`` its dtype only),
and which tensor (:data:`AGREED_TENSOR`): the one policy of the dry run's ledger and the hang
report. A rank may choose alone: ``all_to_all_single``'s split sizes (with splits given; the
first dimension), ``all_to_all``'s per-pair shapes, a ``gather``'s output list and a
``scatter``'s input list (the root's alone), an uneven ``all_gather``'s input and an uneven
``reduce_scatter``'s output (each rank's entry of the list every rank gives alike)."""

AGREED_TENSOR: dict[str, str] = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather_into_tensor": "input",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
    "all_to_all": "inputs",
    "gather": "input",
    "scatter": "output",
    "all_gather": "outputs",
    "reduce_scatter": "inputs",
}
"""Which of a collective's tensors :data:`AGREED` is about (``inputs``/``outputs``: a list)."""

_DIST_ARGUMENT = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor",
                  "all_gather_into_tensor": "input_tensor", "reduce_scatter_tensor": "input",
                  "all_to_all_single": "input", "all_to_all": "input_tensor_list", "gather": "tensor",
                  "scatter": "tensor", "all_gather": "tensor_list", "reduce_scatter": "input_list"}  # fmt: skip
"""The ``torch.distributed`` function's argument that holds :data:`AGREED_TENSOR`'s tensor."""


def agreed_dims(kind: str, split: bool) -> str | None:
    """:data:`AGREED`'s rule for ``kind`` (None: the whole call must agree); ``split``: an
    ``all_to_all_single`` given split sizes (without them every member's shape must agree)."""
    dims = AGREED.get(kind)
    return "all" if dims == "rows" and not split else dims


_ROOTED = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src",
           "gather_object": "dst", "scatter_object_list": "src", "broadcast_object_list": "src"}  # fmt: skip


def tensor_words(value: Any, dims: str = "all") -> str | None:
    """Word a tensor (anything with ``dtype`` and ``shape``) as ``float32[4, 8]``, a list of
    them as ``3 x float32[4]`` (all alike) or ``float32[2], float32[3]``; ``dims="rows"`` words
    the first dimension as ``*`` (``float32[*, 8]``), ``dims="none"`` every one
    (``float32[...]``).

    Returns:
        The words, or None for a value that holds no tensor. Never raises.
    """
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if dtype is not None and shape is not None:
        name = str(dtype).removeprefix("torch.")
        if dims == "none":
            return f"{name}[...]"
        sizes = [str(int(d)) for d in shape]
        if dims == "rows" and sizes:
            sizes[0] = "*"
        return f"{name}[{', '.join(sizes)}]"
    if isinstance(value, (list, tuple)) and value:
        inner = [t for t in (tensor_words(v, dims) for v in value) if t is not None]
        if inner:
            same = all(t == inner[0] for t in inner)
            return f"{len(inner)} x {inner[0]}" if same and len(inner) > 1 else ", ".join(inner)
    return None


def tensor_text(value: Any) -> str:
    """Return ``float32[4, 8]`` for a tensor (``3 x float32[4]`` for a list of them), ``?`` for
    anything else."""
    return tensor_words(value) or "?"


def _op(value: Any) -> str:
    if value is None:
        return "SUM"
    name = getattr(value, "name", None)
    return str(name if name is not None else value).rsplit(".", 1)[-1]


def describe(kind: str, given: Mapping[str, Any], group_rank: Any) -> tuple[str, str]:
    """Return ``(agree, shown)`` of one call: what every member of its group must pass alike,
    and how a person reads it. ``given`` holds the call's bound arguments; ``group_rank(global
    rank)`` turns a root given in global ranks into the group's rank.
    """
    parts: list[str] = [kind]
    main = given.get("tensor", given.get("input_tensor", given.get("input", given.get("output"))))
    if main is None:
        main = (given.get("input_tensor_list") or [None])[0]
    shown = tensor_text(main) if main is not None else ""
    split = bool(given.get("output_split_sizes") or given.get("input_split_sizes"))
    dims = agreed_dims(kind, split)
    if dims is not None:
        value = given.get(_DIST_ARGUMENT[kind])
        parts.append(tensor_words(value, dims) or "?")
    if kind == "all_gather":  # the rank's input is its own entry of the list
        shapes = [tensor_text(t) for t in given.get("tensor_list") or []]
        mine = group_rank(None)
        parts.append(
            "own slot" if mine is not None and mine < len(shapes) and shapes[mine] == shown else "other"
        )
    if kind in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
        op = _op(given.get("op"))
        parts.append(op)
        if op != "SUM":  # shown where it is not the default, so two ops never read alike
            shown = f"{shown}, op {op}" if shown else f"op {op}"
    root_key = _ROOTED.get(kind)
    if root_key is not None:
        local = given.get(f"group_{root_key}")
        if local is None and given.get(root_key) is not None:
            local = group_rank(int(given[root_key]))
        parts.append(f"root {local}")
        shown = f"{shown}, root {local}" if shown else f"root {local}"
    return " ".join(str(p) for p in parts), f"{kind}({shown})"


class CallLedger:
    """One rank's calls, in program order (see the module docstring)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.entries: list[dict[str, Any]] = []
        self.kept = 0
        self.counts: dict[str, int] = {}
        self._hashes: dict[str, Any] = {}
        self.groups: dict[str, list[int] | None] = {"world": None}
        self._keys: dict[int, tuple[Any, str]] = {}
        self._held: dict[str, Any] | None = None

    def group_key(self, group: Any, members_of: Callable[[Any], Sequence[int] | None]) -> str:
        """Return the report's name of ``group`` (``"world"`` for the default group, else
        ``"g<n>"`` with its members, ``members_of(group)``, in :attr:`groups`), naming it on
        first use; ``members_of`` returns None for the default group."""
        known = self._keys.get(id(group))
        if known is not None and known[0] is group:
            return known[1]
        members = members_of(group)
        if members is None:
            self._keys[id(group)] = (group, "world")
            return "world"
        key = f"g{len(self.groups)}"
        self.groups[key] = sorted(int(r) for r in members)
        self._keys[id(group)] = (group, key)  # the group kept alive: its id is not reused
        return key

    def hold(self, entry: dict[str, Any]) -> None:
        """Keep an asynchronous call (a functional collective) back until it is known whether
        its rank waits for it at once: :meth:`release` notes it, blocking when the rank's next
        step was its wait; any other call noted first notes it as asynchronous. Returns None."""
        self.release(blocking=False)
        self._held = entry

    def release(self, blocking: bool) -> None:
        """Note the call :meth:`hold` kept back, if any (``blocking``: its rank waited for it
        before anything else, so it blocks as a synchronous call would). Returns None."""
        entry, self._held = self._held, None
        if entry is not None:
            if blocking:
                entry.pop("async", None)
            self.note(entry)

    def note(self, entry: dict[str, Any]) -> None:
        """Record one call: ``entry`` holds ``kind``, ``group`` (a :meth:`group_key`),
        ``agree``, ``shown``, ``where``, ``async`` and, for a point-to-point call, ``peer`` (a
        global rank; None: any source) and ``tag``. A call held back (:meth:`hold`) is noted
        first, as asynchronous. Returns None."""
        if self._held is not None:
            self.release(blocking=False)
        direction = P2P_KINDS.get(entry["kind"])
        stream = entry["group"] if direction is None else f"{direction} {entry.get('peer')}"
        self.counts[stream] = self.counts.get(stream, 0) + 1
        digest = self._hashes.get(stream)
        if digest is None:
            digest = self._hashes[stream] = hashlib.blake2b(digest_size=8)
        digest.update(f"{entry['agree']}|{entry.get('tag')}|".encode())
        if self.kept >= self.window:
            return
        self.kept += 1
        last = self.entries[-1] if self.entries else None
        if last is not None and all(last.get(k) == v for k, v in entry.items()):
            last["n"] = last.get("n", 1) + 1
            return
        self.entries.append(entry)

    def to_json(self) -> dict[str, Any]:
        """Return the ledger as a JSON-ready dict: ``entries`` (each with ``n`` when it stands
        for several identical calls), ``groups`` {key: members, ``world``: None}, ``counts`` and
        ``digests`` per stream, ``kept`` and ``window``. A call held back is noted first."""
        self.release(blocking=False)
        return {
            "entries": [dict(e) for e in self.entries],
            "groups": dict(self.groups),
            "counts": dict(self.counts),
            "digests": {k: h.hexdigest() for k, h in self._hashes.items()},
            "kept": self.kept,
            "window": self.window,
        }


def p2p_async(kind: str) -> bool:
    """True for the point-to-point calls that return at once (``isend``, ``irecv``)."""
    return kind in _ASYNC_P2P
