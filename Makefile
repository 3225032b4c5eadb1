# Quick start: `make demo` runs the main job, `make test` the test suite. Both create or reuse
# .venv and install torch==2.13.0 (the CPU build) before the package, so no range pulls another torch.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.parallelctx-installed
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt

.PHONY: demo test test-slow test-bench test-faults test-launchers test-sweeps test-engines venv-engines test-installs test-megatron-next bench-megatron-next test-megatron-upstream \
	test-megatron-upstream-016 lint bench bench-plugin venv clean

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

# Test venvs for megatron-core 0.17.1, 0.18.2 and 0.19.2 (docs/migration.md; `make test` runs
# 0.16.1 in .venv), one recipe for all. Their wheels are tagged for Python 3.12 only, but the
# package runs on 3.11 (its one compiled module, a dataset helper, is never loaded here): download
# the wheel for 3.12 and put it on the venv's path with a .pth file. 0.18 and 0.19 import triton.
MCORE_RELEASES    := 017 018 019
MCORE_VERSION_017 := 0.17.1
MCORE_VERSION_018 := 0.18.2
MCORE_VERSION_019 := 0.19.2
MCORE_EXTRAS_018  := triton==3.9.0
MCORE_EXTRAS_019  := triton==3.9.0
# the bridge suites (under 0.16.1 they run in `make test`)
MCORE_TESTS       := tests/test_megatron_bridge.py tests/test_megatron_gtp.py tests/test_megatron_parallel_state.py tests/test_megatron_modules.py
mcore_venv        = .venv-mcore$(1)
mcore_stamp       = .venv-mcore$(1)/.parallelctx-installed-$(MCORE_VERSION_$(1))
VENV_NEXT         := $(call mcore_venv,019)
STAMP_NEXT        := $(call mcore_stamp,019)

# Megatron-core's own tests/unit_tests/test_parallel_state.py for the release a venv holds, unchanged,
# on gpc + the bridge against Megatron's own init, 8 CPU ranks (tests/test_megatron_upstream.py).
# The file comes from MEGATRON_LM=path, a local Megatron-LM clone (bare or not) holding the release
# tags (git show core_v0.17.1:tests/unit_tests/test_parallel_state.py), else from
# MEGATRON_LM_TESTS_0_17=file / MEGATRON_LM_TESTS=file, .cache/megatron-lm/<tag>/ or GitHub;
# skipped, saying so, without any of them.
MEGATRON_LM ?=
upstream = MEGATRON_LM='$(MEGATRON_LM)' PARALLELCTX_MEGATRON_UPSTREAM=1 $(1)/bin/python -m pytest -q -s \
	-p no:cacheprovider tests/test_megatron_upstream.py

# $(1): one of MCORE_RELEASES. Makes venv-mcore$(1), test-megatron-$(1), test-megatron-upstream-$(1).
define MCORE_RULES
.PHONY: venv-mcore$(1) test-megatron-$(1) test-megatron-upstream-$(1)
venv-mcore$(1): $(call mcore_stamp,$(1))

$(call mcore_stamp,$(1)): pyproject.toml requirements/constraints.txt
	test -x $(call mcore_venv,$(1))/bin/python || $(PYTHON) -m venv $(call mcore_venv,$(1))
	$(call mcore_venv,$(1))/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt torch==2.13.0
	$(call mcore_venv,$(1))/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints.txt \
		-e '.[test]' $(MCORE_EXTRAS_$(1)) 'packaging>=24.2'
	$(call mcore_venv,$(1))/bin/python -m pip uninstall -q -y megatron-core
	rm -rf $(call mcore_venv,$(1))/mcore $(call mcore_venv,$(1))/wheel
	mkdir -p $(call mcore_venv,$(1))/mcore $(call mcore_venv,$(1))/wheel
	$(call mcore_venv,$(1))/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --platform manylinux_2_28_x86_64 -d $(call mcore_venv,$(1))/wheel \
		megatron-core==$(MCORE_VERSION_$(1))
	cd $(call mcore_venv,$(1))/mcore && $(CURDIR)/$(call mcore_venv,$(1))/bin/python -m zipfile \
		-e $(CURDIR)/$(call mcore_venv,$(1))/wheel/megatron_core-$(MCORE_VERSION_$(1))-*.whl .
	$(call mcore_venv,$(1))/bin/python -c "import site, pathlib; pathlib.Path(site.getsitepackages()[0], \
		'megatron_core_wheel.pth').write_text(str(pathlib.Path('$(call mcore_venv,$(1))/mcore').resolve()) + '\\n')"
	$(call mcore_venv,$(1))/bin/python -c "import megatron.core as m; \
		assert m.__version__.split('+')[0] == '$(MCORE_VERSION_$(1))', m.__version__"
	touch $(call mcore_stamp,$(1))

test-megatron-$(1): $(call mcore_stamp,$(1))
	$(call mcore_venv,$(1))/bin/python -m pytest -q -p no:cacheprovider $(MCORE_TESTS)

test-megatron-upstream-$(1): $(call mcore_stamp,$(1))
	$(call upstream,$(call mcore_venv,$(1)))
endef
$(foreach release,$(MCORE_RELEASES),$(eval $(call MCORE_RULES,$(release))))

# The bridge under megatron-core 0.19.2, the newest release (the name CI has always called)
test-megatron-next: test-megatron-019

# gpc + process_groups() against megatron-core 0.19.2's own initialize_model_parallel, 16 ranks
bench-megatron-next: $(STAMP_NEXT)
	$(VENV_NEXT)/bin/python -m benchmarks.megatron_bridge --route process_groups --worlds 16 --repeats 5 --sim-world 16384 --gloo eager lazy

test-megatron-upstream-016: $(STAMP)
	$(call upstream,$(VENV))

# Under each release in turn (a few minutes each; one at a time: Megatron's own init on CPU
# starts many gloo threads): make test-megatron-upstream MEGATRON_LM=~/src/Megatron-LM
test-megatron-upstream: $(STAMP) $(foreach release,$(MCORE_RELEASES),$(call mcore_stamp,$(release)))
	$(call upstream,$(VENV))
	$(call upstream,$(call mcore_venv,017))
	$(call upstream,$(call mcore_venv,018))
	$(call upstream,$(call mcore_venv,019))

clean:
	rm -rf $(VENV) $(ENGINES) $(foreach release,$(MCORE_RELEASES),$(call mcore_venv,$(release))) \
		.pytest_cache build *.egg-info
