# Quick start: `make demo` runs the main job, `make test` the test suite. Both create or reuse
# .venv and install torch==2.13.0 (the CPU build) before the package, so no range pulls another torch.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.parallelctx-installed
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt

.PHONY: demo test test-faults test-launchers test-installs lint bench bench-plugin venv clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -m "not launchers and not faults and not installs" -q

test-faults: $(STAMP)
	$(BIN)/python -m pytest -m faults -q

test-launchers: $(STAMP)
	$(BIN)/python -m pytest -m launchers -q

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

# pytest plugin (docs/testing.md): 40 trivial 8-rank tests on the pool vs fresh processes per
# test; appends a section to benchmarks/RESULTS.md (fresh processes take ~10-30 s per test here)
bench-plugin: $(STAMP)
	$(BIN)/python -m benchmarks.plugin_pool --append-results

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
