# Quick start: `make demo` runs the main job, `make test` the test suite. Both create or reuse
# .venv and install torch==2.13.0 (the CPU build) before the package, so no range pulls another torch.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.parallelctx-installed
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt

.PHONY: demo test test-slow test-bench test-faults test-launchers test-sweeps test-engines venv-engines test-installs venv-mcore019 test-megatron-next bench-megatron-next test-megatron-upstream lint bench bench-plugin venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,bench,lint,torchtitan]'
	# torchtitan without its dependencies (datasets, wandb, ...), which parallelctx.torchtitan does not need
	$(PIP) --no-deps torchtitan==0.3.0
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 8 -m parallelctx.cli.demo --config configs/demo_3d.py
	$(BIN)/python -m parallelctx dry-run --world-size 16384 --rank 12345 --quiet examples/dry_run/train.py

test: $(STAMP)
	$(BIN)/python -m pytest -m "not launchers and not faults and not sweeps and not engines and not installs and not bench and not slow" -q

# the multi-process checks of a quarter minute or more each (torchrun runs, nested pytest sessions)
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow -q

test-faults: $(STAMP)
	$(BIN)/python -m pytest -m faults -q

test-launchers: $(STAMP)
	$(BIN)/python -m pytest -m launchers -q

# every benchmark run once at a tiny size, so that none rots (timings decide nothing)
test-bench: $(STAMP)
	$(BIN)/python -m pytest -m bench -q

# dry-run sweeps of every rank of a few hundred ranks (docs/dry_run.md)
test-sweeps: $(STAMP)
	$(BIN)/python -m pytest -m sweeps -q
# DeepSpeed, Ray Train, Accelerate, Lightning Fabric (docs/engines.md): a venv of their own,
# torch pinned as above; DeepSpeed without its compiled ops (CPU accelerator, gloo).
ENGINES        := .venv-engines
ENGINES_STAMP  := $(ENGINES)/.parallelctx-installed
ENGINES_PIP    := $(ENGINES)/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt
ENGINES_TESTS  := tests/test_engine_deepspeed.py tests/test_engine_deepspeed_pipe.py tests/test_engine_ray.py tests/test_engine_adopters.py

venv-engines: $(ENGINES_STAMP)

$(ENGINES_STAMP): pyproject.toml requirements/constraints.txt
	test -x $(ENGINES)/bin/python || $(PYTHON) -m venv $(ENGINES)
	$(ENGINES_PIP) torch==2.13.0
	DS_BUILD_OPS=0 $(ENGINES_PIP) -e '.[engines-test]'
	touch $(ENGINES_STAMP)

test-engines: $(ENGINES_STAMP)
	$(ENGINES)/bin/python -m pytest -m engines -q $(ENGINES_TESTS)
# every install command the library prints, run verbatim in a fresh venv per extra (several minutes)
test-installs: $(STAMP)
	$(BIN)/python -m pytest -m installs -q

lint: $(STAMP)
	$(BIN)/ruff check parallelctx tests benchmarks examples
	$(BIN)/ruff format --check parallelctx tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run
	$(BIN)/python -m benchmarks.queries --write-results
	$(BIN)/python -m benchmarks.cli_startup --write-results
	$(BIN)/python -m benchmarks.dry_run --write-results

# pytest plugin (docs/testing.md): 40 trivial 8-rank tests on the pool vs fresh processes per
# test; appends a section to benchmarks/RESULTS.md (fresh processes take ~10-30 s per test here)
bench-plugin: $(STAMP)
	$(BIN)/python -m benchmarks.plugin_pool --append-results

# A second test venv with megatron-core 0.19.2 (the newest release; docs/migration.md). Its wheels
# are tagged for Python 3.12 only, but the package is pure Python and runs on 3.11: download the
# wheel for 3.12 and put it on the venv's path with a .pth file. megatron-core 0.19 imports triton.
MCORE_NEXT       := 0.19.2
VENV_NEXT        := .venv-mcore019
STAMP_NEXT       := $(VENV_NEXT)/.parallelctx-installed-$(MCORE_NEXT)
PIP_NEXT         := $(VENV_NEXT)/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt

venv-mcore019: $(STAMP_NEXT)

$(STAMP_NEXT): pyproject.toml requirements/constraints.txt
	test -x $(VENV_NEXT)/bin/python || $(PYTHON) -m venv $(VENV_NEXT)
	$(PIP_NEXT) torch==2.13.0
	$(PIP_NEXT) -e '.[test]' triton==3.9.0 'packaging>=24.2'
	$(VENV_NEXT)/bin/python -m pip uninstall -q -y megatron-core
	rm -rf $(VENV_NEXT)/mcore $(VENV_NEXT)/wheel && mkdir -p $(VENV_NEXT)/mcore $(VENV_NEXT)/wheel
	$(VENV_NEXT)/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --platform manylinux_2_28_x86_64 -d $(VENV_NEXT)/wheel megatron-core==$(MCORE_NEXT)
	cd $(VENV_NEXT)/mcore && $(CURDIR)/$(VENV_NEXT)/bin/python -m zipfile -e $(CURDIR)/$(VENV_NEXT)/wheel/megatron_core-$(MCORE_NEXT)-*.whl .
	$(VENV_NEXT)/bin/python -c "import site, pathlib; pathlib.Path(site.getsitepackages()[0], 'megatron_core_next.pth').write_text(str(pathlib.Path('$(VENV_NEXT)/mcore').resolve()) + '\\n')"
	$(VENV_NEXT)/bin/python -c "import megatron.core as m; assert m.__version__.split('+')[0] == '$(MCORE_NEXT)', m.__version__"
	touch $(STAMP_NEXT)

# gpc + process_groups() against megatron-core 0.19.2's own initialize_model_parallel, 16 ranks
bench-megatron-next: $(STAMP_NEXT)
	$(VENV_NEXT)/bin/python -m benchmarks.megatron_bridge --route process_groups --worlds 16 --repeats 5 --sim-world 16384 --gloo eager lazy

# Megatron-core's own tests/unit_tests/test_parallel_state.py (tag core_v0.16.1, core_v0.19.0),
# unchanged, on gpc + the bridge against Megatron's own init, 8 CPU ranks, under both releases.
# Fetches the file from GitHub (or MEGATRON_LM_TESTS=path); skipped, saying so, without either.
test-megatron-upstream: $(STAMP) $(STAMP_NEXT)
	PARALLELCTX_MEGATRON_UPSTREAM=1 $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/test_megatron_upstream.py
	PARALLELCTX_MEGATRON_UPSTREAM=1 $(VENV_NEXT)/bin/python -m pytest -q -s -p no:cacheprovider tests/test_megatron_upstream.py

# The Megatron bridge tests under megatron-core 0.19.2 (the 0.16.1 run is in `make test`).
test-megatron-next: $(STAMP_NEXT)
	$(VENV_NEXT)/bin/python -m pytest -q -p no:cacheprovider tests/test_megatron_bridge.py \
		tests/test_megatron_gtp.py tests/test_megatron_parallel_state.py tests/test_megatron_modules.py

clean:
	rm -rf $(VENV) $(ENGINES) $(VENV_NEXT) .pytest_cache build *.egg-info
