# Quick start: `make demo` runs the main job, `make test` the test suite. Both create or reuse
# .venv and install torch==2.13.0 (the CPU build) before the package, so no range pulls another torch.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.parallelctx-installed
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt

.PHONY: demo test test-faults test-launchers test-sweeps test-engines venv-engines test-installs lint bench bench-plugin venv clean

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
	$(BIN)/python -m pytest -m "not launchers and not faults and not sweeps and not engines and not installs" -q

test-faults: $(STAMP)
	$(BIN)/python -m pytest -m faults -q

test-launchers: $(STAMP)
	$(BIN)/python -m pytest -m launchers -q

# dry-run sweeps of every rank of a few hundred ranks (docs/dry_run.md)
test-sweeps: $(STAMP)
	$(BIN)/python -m pytest -m sweeps -q
# DeepSpeed, Ray Train, Accelerate, Lightning Fabric (docs/engines.md): a venv of their own,
# torch pinned as above; DeepSpeed without its compiled ops (CPU accelerator, gloo).
ENGINES        := .venv-engines
ENGINES_STAMP  := $(ENGINES)/.parallelctx-installed
ENGINES_PIP    := $(ENGINES)/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt
ENGINES_TESTS  := tests/test_engine_deepspeed.py tests/test_engine_ray.py tests/test_engine_accelerate.py tests/test_engine_lightning.py

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

clean:
	rm -rf $(VENV) $(ENGINES) .pytest_cache build *.egg-info
