"""Run Megatron-core's own ``tests/unit_tests/test_parallel_state.py`` on one rank, unchanged, with
its ``Utils`` (``tests.unit_tests.test_utilities``) pointed at gpc + ``parallelctx.megatron``
("bridge") or at Megatron's own ``initialize_model_parallel`` ("megatron", the control).

Used by tests/test_megatron_upstream.py, which starts one process per rank with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set, as torchrun would for Megatron's own CI.
Only the ``Utils`` methods their file calls are provided; the file itself is not modified.
"""

from __future__ import annotations

import json
import os
import sys
import types
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch.distributed as dist

TIMEOUT = timedelta(seconds=120)


def _drop_leaked_groups(keep: list[Any]) -> None:
    """Destroy every process group but the default one and ``keep``.

    Megatron's own test utilities only forget the groups they made (``destroy_model_parallel``
    sets its globals to None). On NCCL that is cheap; on CPU every leaked gloo group keeps its
    worker threads and sockets, and after a few dozen tests 8 ranks hold ~14,000 threads and
    the machine stalls. Destroying them between tests changes no test's groups, only how many
    dead ones pile up."""
    world = dist.distributed_c10d._world
    default = dist.distributed_c10d.GroupMember.WORLD
    for pg in list(world.pg_map):
        if pg is not default and not any(pg is k for k in keep):
            dist.destroy_process_group(pg)


def _registry() -> Any:
    return dist.distributed_c10d._world.pg_map


class _Base:
    """What both shims share: the rank, the world, the default group as Megatron's Utils makes it."""

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    inited = False

    @classmethod
    def initialize_distributed(cls) -> None:
        if not dist.is_initialized():
            addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{addr}:{port}",
                rank=cls.rank,
                world_size=cls.world_size,
                timeout=TIMEOUT,
            )
        cls.inited = True


class MegatronUtils(_Base):
    """Megatron's own init, as its test utilities do it (the control run)."""

    @classmethod
    def initialize_model_parallel(
        cls,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if dist.is_initialized():
            _drop_leaked_groups([])
        cls.initialize_distributed()
        ps.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            distributed_timeout_minutes=2,
            **kwargs,
        )

    @classmethod
    def destroy_model_parallel(cls) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if dist.is_initialized():
            _drop_leaked_groups([])
            dist.barrier()


class BridgeUtils(_Base):
    """gpc launched on the default group with the sizes asked, then ``parallelctx.megatron.install()``
    with the remaining options (the bridge run)."""

    spacers: ClassVar[list[Any]] = []

    @classmethod
    def _destroy(cls) -> None:
        from megatron.core import parallel_state as ps

        from parallelctx import gpc

        if not dist.is_initialized():
            ps.destroy_model_parallel()
            return
        held = len(dist.distributed_c10d._world.pg_names)
        launched = gpc._layout is not None
        if launched:
            import parallelctx.megatron as bridge

            # every group gpc's guard holds: gpc's own and those bridges made with gpc.group_maker()
            ours = [*gpc._groups.values(), *gpc._cpu_groups.values(), *(h.group for h in gpc._guard.held())]
            ours += list(bridge._state.created) if bridge._state is not None else []
            ours += [g for _, made in bridge._collections.values() for g in made.created]
            gpc.destroy()  # uninstalls too; the default group is the user's and stays
            # A group gpc or the bridge made and left alive is a bridge defect: destroying the
            # leaked groups below must not hide it (the test errors at teardown instead).
            alive = [g for g in ours if g is not None and g is not dist.group.WORLD and g in _registry()]
            assert not alive, f"gpc.destroy() left {len(alive)} of its groups alive"
        ps.destroy_model_parallel()  # what a direct call of Megatron's own init may have left
        _drop_leaked_groups(cls.spacers)  # as the control does
        if launched:
            # torch names locally synchronized groups by how many a process holds: kept groups
            # until it holds more than during this launch give the next launch fresh names
            while len(dist.distributed_c10d._world.pg_names) <= held:
                cls.spacers.append(dist.new_group([dist.get_rank()], use_local_synchronization=True))

    @classmethod
    def initialize_model_parallel(
        cls,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        import parallelctx.megatron as bridge
        from parallelctx import gpc

        cls._destroy()
        cls.initialize_distributed()
        parallel: dict[str, Any] = {
            "tensor": tensor_model_parallel_size,
            "pipeline": pipeline_model_parallel_size,
            "context": kwargs.pop("context_parallel_size", 1),
            "expert": {
                "size": kwargs.pop("expert_model_parallel_size", 1),
                "tensor": kwargs.pop("expert_tensor_parallel_size", None),
                "gtp_remat": kwargs.pop("expert_gtp_remat_size", 1),
            },
            "gtp_remat": kwargs.pop("gtp_remat_size", 1),
        }
        if "order" in kwargs:
            parallel["order"] = kwargs.pop("order")
        gpc.load_config({"parallel": parallel, "dist": {"timeout": TIMEOUT.total_seconds()}})
        gpc.init_global_dist(dist.get_rank(), dist.get_world_size())
        try:
            gpc.init_parallel_groups()
            gpc.detect_num_processes_on_current_node()
            gpc.set_device()
            gpc.set_seed()
            bridge.install(
                virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size, **kwargs
            )
        except BaseException:
            cls._destroy()
            raise

    @classmethod
    def destroy_model_parallel(cls) -> None:
        cls._destroy()
        if dist.is_initialized():
            dist.barrier()


class _Outcomes:
    """A pytest plugin that records each test's outcome (call phase, or a failed setup or
    teardown), and rewrites ``out`` after each one, so a run stopped by its time limit still
    tells how far each rank got."""

    def __init__(self, out: Path) -> None:
        self.found: dict[str, str] = {}
        self.out = out

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "teardown" and report.outcome == "failed":
            # a test whose call passed but whose teardown failed did not pass
            self.found[report.nodeid.split("::", 1)[1]] = "teardown failed"
            self.out.write_text(json.dumps(self.found))
        elif report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            outcome = report.outcome
            if hasattr(report, "wasxfail"):
                outcome = "xfailed" if report.skipped else "xpassed"
            self.found[report.nodeid.split("::", 1)[1]] = outcome
            self.out.write_text(json.dumps(self.found))


def run_rank(test_file: str, mode: str, out: str) -> int:
    """Run ``test_file`` on this rank with the ``mode`` shim; write ``{test id: outcome}`` to ``out``."""
    warnings.simplefilter("ignore")
    utils = types.ModuleType("tests.unit_tests.test_utilities")
    utils.Utils = BridgeUtils if mode == "bridge" else MegatronUtils  # type: ignore[attr-defined]
    for name in ("tests", "tests.unit_tests"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["tests.unit_tests.test_utilities"] = utils
    where = Path(test_file).parent
    (where / "pytest.ini").write_text("[pytest]\nmarkers =\n    internal\n    flaky\n    flaky_in_dev\n")
    plugin = _Outcomes(Path(out))
    code = pytest.main(
        [
            test_file,
            "-q",
            "-rfE",
            "--tb=short",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:parallelctx",
            "--rootdir",
            str(where),
        ],
        plugins=[plugin],
    )
    Path(out).write_text(json.dumps(plugin.found))
    if dist.is_initialized():
        dist.destroy_process_group()
    return int(code)


if __name__ == "__main__":
    raise SystemExit(run_rank(*sys.argv[1:4]))
