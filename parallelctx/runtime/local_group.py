"""The ``"local"`` backend: one member's handle of a group of a local world
(:mod:`parallelctx.runtime.local`), made by torch's ``init_process_group`` and ``new_group`` in
a rank's thread. Each call checks what one rank can check alone (dense tensors, output sizes),
names what every member must give alike (the op, the root, shapes, dtypes) and goes to the
world, which computes it from every member's tensors once all came. Inputs are read before any
output is written, so outputs that alias inputs get what a real backend gives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .local import LocalWorld, RankThread, Recv, all_of

__all__ = ["BACKEND", "LocalGroup", "register_backend"]

BACKEND = "local"
"""The name of the in-process backend."""

# torch's stubs type ProcessGroup's methods by their C++ overloads; the Python overrides below are
# what torch.distributed's Python functions and its C++ trampoline call.
_ProcessGroup: Any = dist.ProcessGroup

_OPS: dict[Any, str] = {
    dist.ReduceOp.SUM: "SUM",
    dist.ReduceOp.AVG: "AVG",
    dist.ReduceOp.PRODUCT: "PRODUCT",
    dist.ReduceOp.MIN: "MIN",
    dist.ReduceOp.MAX: "MAX",
}


def _op(opts: Any) -> Any:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM) if opts is not None else dist.ReduceOp.SUM
    op = getattr(op, "op", op)  # a ReduceOp holds its RedOpType
    if op not in _OPS:
        raise NotImplementedError(
            f"the local backend has no reduce op {op}; use SUM, AVG, PRODUCT, MIN or MAX"
        )
    return op


def _root(opts: Any) -> int:
    return int(getattr(opts, "rootRank", 0)) if opts is not None else 0


def _reduce(tensors: Sequence[torch.Tensor], op: Any) -> torch.Tensor:
    """Reduce in group-rank order: a sum adds left to right (two ranks: ``a + b``, as gloo)."""
    if op == dist.ReduceOp.SUM or op == dist.ReduceOp.AVG:
        out = tensors[0].clone()
        for t in tensors[1:]:
            out.add_(t)
        return out / len(tensors) if op == dist.ReduceOp.AVG else out
    stacked = torch.stack(list(tensors))
    if op == dist.ReduceOp.PRODUCT:
        return stacked.prod(dim=0)
    return stacked.amin(dim=0) if op == dist.ReduceOp.MIN else stacked.amax(dim=0)


def _sig(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _shape(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        dtype, shape = _sig(t)
        return f"{dtype}{list(shape)}"
    return type(t).__name__


def _dense(kind: str, tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            raise ValueError(
                f"{kind} got a non-contiguous tensor {_shape(t)} (strides {t.stride()}): gloo reads and "
                "writes the wrong memory for such a view and NCCL refuses it; pass .contiguous() and "
                "copy the result back"
            )


def _same_as(kind: str, what: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.shape != like.shape or t.dtype != like.dtype:
        raise ValueError(f"{kind}: {what} is {_shape(t)} where {_shape(like)} is needed")


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"the local backend has no {what}; run this code on real ranks (@pytest.mark.parallel "
        "without local=True, or parallelctx.spawn)"
    )


class LocalGroup(_ProcessGroup):
    """One member's handle of a group of the local backend."""

    def __init__(self, world: LocalWorld, rank: int, members: tuple[int, ...], name: str) -> None:
        super().__init__(members.index(rank), len(members))
        self._world, self._rank_global, self._members, self._name = world, rank, members, name
        self._channel = world.channel(name, members, self._label)

    @property
    def group_name(self) -> str:
        """The name torch registered the group under (DeviceMesh and functional collectives read
        it; torch's own groups take it from their C++ backend, which this group has none of)."""
        return self._name

    def getBackendName(self) -> str:
        return BACKEND

    def shutdown(self) -> None:
        """Nothing to close: returns None."""

    def _label(self) -> str:
        desc = self.group_desc
        return f"{'world' if desc in ('', 'default_pg', 'undefined') else desc} group {list(self._members)}"

    def _call(
        self,
        kind: str,
        agree: Any,
        shown: Sequence[Any],
        mine: Any,
        work: Callable[[list[Any]], str | None],
        result: Any = None,
    ) -> Any:
        call = (kind, agree, f"{kind} of {', '.join(_shape(t) for t in shown) or 'nothing'}")
        return self._world.collective(self._channel, self._rank_global, call, mine, work, result)

    def _row(self, kind: str, what: str, row: Sequence[torch.Tensor], like: torch.Tensor) -> None:
        """Check one tensor per member in ``row``, each shaped and typed as ``like``."""
        if len(row) != self.size():
            raise ValueError(f"{kind}: {len(row)} {what}s for a group of {self.size()}")
        for t in row:
            _same_as(kind, f"an {what}", t, like)

    # ------------------------------------------------------------------ reductions
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _op(opts)
        _dense("all_reduce", tensors)

        def work(data: list[list[torch.Tensor]]) -> None:
            for i in range(len(data[0])):
                out = _reduce([d[i] for d in data], op)
                for d in data:
                    d[i].detach().copy_(out)

        return self._call(
            f"all_reduce[{_OPS[op]}]", [_sig(t) for t in tensors], tensors, tensors, work, tensors
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op, root = _op(opts), _root(opts)
        _dense("reduce", tensors)

        def work(data: list[list[torch.Tensor]]) -> None:
            for i in range(len(data[0])):
                data[root][i].detach().copy_(_reduce([d[i] for d in data], op))

        kind = f"reduce[{_OPS[op]}, root {root}]"
        return self._call(kind, [_sig(t) for t in tensors], tensors, tensors, work, tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = _root(opts)
        _dense("broadcast", tensors)

        def work(data: list[list[torch.Tensor]]) -> None:
            sent = [t.clone() for t in data[root]]
            for d in data:
                for t, s in zip(d, sent):
                    t.detach().copy_(s)

        return self._call(
            f"broadcast[root {root}]", [_sig(t) for t in tensors], tensors, tensors, work, tensors
        )

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        op = _op(opts)
        _dense("reduce_scatter", [*outputs, *(t for row in inputs for t in row)])
        for out, row in zip(outputs, inputs):
            self._row("reduce_scatter", "input", row, out)

        def work(data: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]) -> None:
            results = [
                [_reduce([d[1][i][me] for d in data], op) for i in range(len(outs))]
                for me, (outs, _) in enumerate(data)
            ]
            for (outs, _), got in zip(data, results):
                for out, value in zip(outs, got):
                    out.detach().copy_(value)

        kind = f"reduce_scatter[{_OPS[op]}]"
        return self._call(kind, [_sig(t) for t in outputs], outputs, (outputs, inputs), work, outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op, n = _op(opts), self.size()
        _dense("reduce_scatter_tensor", [output, input])
        if input.numel() != output.numel() * n or input.dtype != output.dtype:
            raise ValueError(
                f"reduce_scatter_tensor: the input {_shape(input)} must hold {n} outputs {_shape(output)}"
            )

        def work(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            parts = [d[1].reshape(n, -1).clone() for d in data]
            for me, (out, _) in enumerate(data):
                out.detach().copy_(_reduce([p[me] for p in parts], op).view_as(out))

        kind = f"reduce_scatter_tensor[{_OPS[op]}]"
        return self._call(kind, _sig(output), [input], (output, input), work, [output])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return all_of(
            [self._reduce_scatter_base(out, inp, opts) for out, inp in zip(outputs, inputs)], outputs
        )

    # ------------------------------------------------------------------ gathers
    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        _dense("all_gather", [*inputs, *(t for row in outputs for t in row)])
        for row, inp in zip(outputs, inputs):
            self._row("all_gather", "output", row, inp)

        def work(data: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]) -> None:
            sent = [[t.clone() for t in d[1]] for d in data]
            for outs, _ in data:
                for i, row in enumerate(outs):
                    for src, t in enumerate(row):
                        t.detach().copy_(sent[src][i])

        return self._call("all_gather", [_sig(t) for t in inputs], inputs, (outputs, inputs), work, outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        n = self.size()
        _dense("all_gather_into_tensor", [output, input])
        if output.numel() != input.numel() * n or input.dtype != output.dtype:
            raise ValueError(
                f"all_gather_into_tensor: the output {_shape(output)} must hold {n} inputs {_shape(input)}"
            )

        def work(data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            whole = torch.cat([d[1].reshape(-1) for d in data])
            for out, _ in data:
                out.detach().copy_(whole.view_as(out))

        return self._call("all_gather_into_tensor", _sig(input), [input], (output, input), work, [output])

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return all_of([self._allgather_base(out, inp, opts) for out, inp in zip(outputs, inputs)], outputs)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return all_of([self.allgather([out], [inp], opts) for out, inp in zip(outputs, inputs)], outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        root = _root(opts)
        _dense("gather", [*inputs, *(t for row in outputs for t in row)])
        if self.rank() == root:
            self._row("gather", "output", outputs[0] if outputs else [], inputs[0])

        def work(data: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]) -> None:
            for src, t in enumerate(data[root][0][0]):
                t.detach().copy_(data[src][1][0].clone())

        return self._call(f"gather[root {root}]", _sig(inputs[0]), inputs, (outputs, inputs), work, outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = _root(opts)
        _dense("scatter", [*outputs, *(t for row in inputs for t in row)])
        if self.rank() == root:
            self._row("scatter", "input", inputs[0] if inputs else [], outputs[0])

        def work(data: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]]) -> None:
            sent = [t.clone() for t in data[root][1][0]]
            for me, (outs, _) in enumerate(data):
                outs[0].detach().copy_(sent[me])

        return self._call(
            f"scatter[root {root}]", _sig(outputs[0]), outputs, (outputs, inputs), work, outputs
        )

    # ------------------------------------------------------------------ all to all
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        opts: Any = None,
    ) -> Any:
        n = self.size()
        _dense("all_to_all_single", [output, input])

        def sizes(t: torch.Tensor, given: list[int]) -> list[int]:
            return list(given) if given else [t.shape[0] // n] * n

        for t, given, which in ((input, in_splits, "input"), (output, out_splits, "output")):
            if sum(sizes(t, given)) != t.shape[0] or len(sizes(t, given)) != n:
                raise ValueError(
                    f"all_to_all_single: the {which} {_shape(t)} does not split as {sizes(t, given)}"
                )

        def work(data: list[tuple[torch.Tensor, torch.Tensor, list[int], list[int]]]) -> str | None:
            sent = [list(torch.split(d[1].clone(), sizes(d[1], d[3]))) for d in data]
            for me, (out, _, osz, _) in enumerate(data):
                for src, part in enumerate(torch.split(out, sizes(out, osz))):
                    if part.shape != sent[src][me].shape:
                        return (
                            f"all_to_all_single: rank {self._members[me]} expects {list(part.shape)} from rank "
                            f"{self._members[src]}, which sends {list(sent[src][me].shape)}"
                        )
            for me, (out, _, osz, _) in enumerate(data):
                for src, part in enumerate(torch.split(out, sizes(out, osz))):
                    part.detach().copy_(sent[src][me])
            return None

        agree = (str(input.dtype), tuple(input.shape[1:]))
        return self._call(
            "all_to_all_single", agree, [input], (output, input, out_splits, in_splits), work, [output]
        )

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        _dense("all_to_all", [*outputs, *inputs])
        if len(outputs) != self.size() or len(inputs) != self.size():
            raise ValueError(
                f"all_to_all: {len(inputs)} inputs and {len(outputs)} outputs for a group of {self.size()}"
            )

        def work(data: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> str | None:
            sent = [[t.clone() for t in d[1]] for d in data]
            for me, (outs, _) in enumerate(data):
                for src, out in enumerate(outs):
                    if out.shape != sent[src][me].shape:
                        return (
                            f"all_to_all: rank {self._members[me]} expects {_shape(out)} from rank "
                            f"{self._members[src]}, which sends {_shape(sent[src][me])}"
                        )
            for me, (outs, _) in enumerate(data):
                for src, out in enumerate(outs):
                    out.detach().copy_(sent[src][me])
            return None

        return self._call("all_to_all", str(inputs[0].dtype), inputs, (outputs, inputs), work, outputs)

    # torch.distributed's Python functions call these names; its C++ ops the ones above
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._allgather_base(output, input, opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._reduce_scatter_base(output, input, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        return self.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        opts: Any = None,
    ) -> Any:
        return self.alltoall_base(output, input, out_splits, in_splits, opts)

    def barrier(self, opts: Any = None) -> Any:
        return self._call("barrier", None, [], None, lambda data: None)

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        _dense("send", tensors)
        return self._world.send(self._channel, self._rank_global, self._members[dst], tag, tensors[0])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        _dense("recv", tensors)
        slot = Recv(tensors[0], self._rank_global, self._members[src], src, tag)
        return self._world.recv(self._channel, slot)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise _unsupported("recv from any source (recv with src=None)")

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported("monitored_barrier (use barrier: a rank that never comes is named anyway)")


def _create(options: Any, backend_options: Any = None) -> LocalGroup:
    thread = threading.current_thread()
    if not isinstance(thread, RankThread):
        raise RuntimeError(
            "the 'local' backend serves only the ranks of parallelctx.run_local (and "
            "@pytest.mark.parallel(local=True)); this thread is not one"
        )
    members = tuple(int(r) for r in options.global_ranks_in_group) or tuple(range(thread.world.world_size))
    return LocalGroup(thread.world, thread.rank, members, str(options.group_id))


def register_backend() -> None:
    """Register the ``"local"`` backend with torch once per process; returns None."""
    if BACKEND.upper() not in dist.Backend.__dict__:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
