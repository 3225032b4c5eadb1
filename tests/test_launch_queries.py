"""gpc's launch values, seeds and summary, answered by ``runtime/queries.py``'s ``LaunchQueries``
(a base class of ``ParallelContext``): each documented as the facade's own methods are, each
naming itself before launch and after destroy, and a module's context answering exactly what it
did before they moved (values recorded at the commit before the move)."""

from __future__ import annotations

import inspect
import pydoc
from typing import Any

import pytest
import torch

from parallelctx import NotLaunchedError, ParallelContext, gpc

# ---------------------------------------------------------------------------------------- queries

# What LaunchQueries took from ParallelContext: test_query_api lists the public methods with
# vars(ParallelContext), which no longer holds these, so its docstring and signature checks
# skipped them.
MOVED_METHODS = ("get_seed", "seed", "get_rng_state", "set_rng_state", "summary")
ADOPTED = (
    "config", "layout", "backend", "hostnames", "local_rank", "rng_streams", "num_processes_on_current_node",
    "num_nodes", "node_rank", "device_mesh", "expert_device_mesh",
)  # fmt: skip


def _public_methods_with_inherited() -> list[str]:
    """Every public method gpc has, wherever in ParallelContext's bases it is defined."""
    return sorted(
        name
        for name in dir(ParallelContext)
        if not name.startswith("_") and inspect.isfunction(inspect.getattr_static(ParallelContext, name))
    )


def _check_documented(ctx: Any, name: str) -> None:
    documented = getattr(ParallelContext, name)
    bound = getattr(ctx, name)
    doc = inspect.getdoc(bound)
    assert doc and doc == inspect.getdoc(documented), name
    assert len(doc.splitlines()[0]) > 15, (name, doc)
    params = list(inspect.signature(documented).parameters.values())[1:]  # without self
    assert inspect.signature(bound) == inspect.signature(documented).replace(parameters=params), name
    assert name in pydoc.render_doc(bound, renderer=pydoc.plaintext), name


def test_the_inherited_seed_and_summary_methods_keep_their_docstrings_and_signatures(
    world_of_one: Any,
) -> None:
    names = _public_methods_with_inherited()
    assert set(MOVED_METHODS) <= set(names), names
    for name in names:
        _check_documented(gpc, name)
    world_of_one(None)
    for name in names:
        _check_documented(gpc, name)
    assert str(inspect.signature(gpc.seed)) == "(mode: 'Stream') -> 'Iterator[None]'"
    assert "runs the body on ``mode``'s RNG stream" in pydoc.render_doc(gpc.seed, renderer=pydoc.plaintext)


COLOCATED = dict(
    seed=1234,
    parallel=dict(
        modules=dict(
            language=dict(ranks=8, tensor=2, pipeline=2), vision=dict(colocated_with="language", tensor=2)
        )
    ),
)
APART = dict(
    seed=77, parallel=dict(modules=dict(vision=dict(ranks=2), language=dict(ranks=6, tensor=2, pipeline=3)))
)

# Recorded at 66cb2f3 (ParallelContext answering these itself): per module, its summary, the seed
# of its tensor and replica streams, and the first two draws of its tensor stream after launch.
_SUMMARY = "backend=fake nodes=1 procs/node=8"
BEFORE: dict[tuple[str, int], dict[str, Any]] = {
    ("colocated", 6): {
        "gpc": "parallelctx: module language of language, vision: world=8 tp=2 cp=1 dp=2 pp=2 "
        f"order=tp-cp-ep-dp-pp {_SUMMARY} seed=1234 groups made on this rank=6",
        "language": [
            "parallelctx: module language of language, vision: world=8 tp=2 cp=1 dp=2 pp=2 "
            f"order=tp-cp-ep-dp-pp {_SUMMARY} seed=1234 groups made on this rank=6",
            16778452, 1073743061, [0.7300835251808167, 0.6808340549468994],
        ],
        "vision": [
            "parallelctx: module vision of language, vision: world=8 tp=2 cp=1 dp=4 pp=1 "
            f"order=tp-cp-ep-dp-pp {_SUMMARY} seed=1234 groups made on this rank=6",
            1107297490, 1426064597, [0.878743588924408, 0.14934170246124268],
        ],
    },
    ("apart", 1): {
        "gpc": "parallelctx: module vision of vision: world=2 tp=1 cp=1 dp=2 pp=1 "
        f"order=tp-cp-ep-dp-pp {_SUMMARY} seed=77 groups made on this rank=2",
        "vision": [
            "parallelctx: module vision of vision: world=2 tp=1 cp=1 dp=2 pp=1 "
            f"order=tp-cp-ep-dp-pp {_SUMMARY} seed=77 groups made on this rank=2",
            16777293, 1073741902, [0.48307156562805176, 0.5830721855163574],
        ],
    },
    ("apart", 4): {
        "gpc": "parallelctx: module language of language: world=6 tp=2 cp=1 dp=1 pp=3 offset=2 "
        f"order=tp-cp-ep-dp-pp {_SUMMARY} seed=77 groups made on this rank=5",
        "language": [
            "parallelctx: module language of language: world=6 tp=2 cp=1 dp=1 pp=3 offset=2 "
            f"order=tp-cp-ep-dp-pp {_SUMMARY} seed=77 groups made on this rank=5",
            1107296335, 1426063438, [0.9003444314002991, 0.43270671367645264],
        ],
    },
}  # fmt: skip


@pytest.mark.parametrize("job,rank", sorted(BEFORE))
def test_module_contexts_answer_the_seeds_draws_and_summary_they_did_before(job: str, rank: int) -> None:
    config = COLOCATED if job == "colocated" else APART
    gpc.launch(config, simulate=dict(world_size=8, rank=rank))
    try:
        now: dict[str, Any] = {"gpc": gpc.summary()}
        for name in gpc.modules:
            ctx = gpc.module(name)
            with ctx.seed("tensor"):
                draw = torch.rand(2).tolist()
            now[name] = [ctx.summary(), ctx.get_seed("tensor"), ctx.get_seed("replica"), draw]
        modules = {name: gpc.module(name) for name in gpc.modules}
    finally:
        gpc.destroy()
    assert now == BEFORE[(job, rank)]
    # after destroy a module's context raises, naming what was asked
    for ctx in modules.values():
        with pytest.raises(NotLaunchedError, match=r"gpc\.layout is not available yet"):
            ctx.summary()
        with pytest.raises(NotLaunchedError, match=r"gpc\.rng_streams is not available yet"):
            ctx.get_seed("tensor")


@pytest.mark.parametrize("name", ADOPTED)
def test_each_launch_value_names_itself_before_launch_and_after_destroy(name: str, world_of_one: Any) -> None:
    with pytest.raises(
        NotLaunchedError, match=rf"^gpc\.{name} is not available yet: call parallelctx\.launch"
    ):
        getattr(gpc, name)
    world_of_one(None)
    getattr(gpc, name)
    gpc.destroy()
    with pytest.raises(
        NotLaunchedError, match=rf"^gpc\.{name} is not available yet: call parallelctx\.launch"
    ):
        getattr(gpc, name)
