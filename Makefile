# The two README commands. Each installs what it needs into .venv first (idempotent: stamps), then does its job:
#   make train                       # ortflow +recipe=transformer accel=ortmodule (installs ortflow[vision] only)
#   make train ARGS="+recipe=digits accel=artifacts"
#   make test                        # adds ortflow[test] (test tools, notebooks, optional libraries); lint + the suite
#                                    # without the end-to-end tier (-m 'not slow'); under 8 minutes on 2 cores
#   make test-slow                   # the end-to-end tier (@pytest.mark.slow): CI runs it after make test
#   make test-full                   # lint + both tiers in one pytest run
#   make test-range                  # the ORT engine tests on the other end of the torch range, in its own venv
#   make test-device                 # device exports checked without torch and in headless Chromium (tests/device)
PYTHON ?= python3
# torch: the default end of the supported range in .venv; the other end in .venv-torch<version> (make test-range).
TORCH ?= 2.14.1
RANGE_TORCH ?= 2.6.0
# torchvision is built for one torch release: torch 2.N -> torchvision 0.(N+15). Where that release is not
# published, the newest torchvision whose Requires-Dist accepts the torch: torch 2.15 -> 0.29.2 (torch>=2.14;
# torchvision 0.30 is not published).
TORCH_MINOR = $(word 2,$(subst ., ,$(TORCH)))
TORCHVISION_UNPUBLISHED = 15:0.29.2
TORCHVISION = $(or $(patsubst $(TORCH_MINOR):%,%,$(filter $(TORCH_MINOR):%,$(TORCHVISION_UNPUBLISHED))),0.$(shell echo $$(( $(TORCH_MINOR) + 15 ))).*)
VENV ?= .venv
# What test-range runs on the other end: every engine, parity, resume, custom-Function and distributed test (the
# reliability guards, disk and signals, do not depend on torch's version: `make test` and `make test-slow` run them).
RANGE_TESTS ?= tests/accel/compat/test_compat.py tests/accel/test_engines.py tests/accel/test_zoo.py tests/run/test_resume.py \
	tests/test_distributed.py tests/accel/graph/test_graph_fixes.py tests/run/test_features.py tests/accel/test_vision_engines.py tests/accel/graph/test_aten_layer_norm.py \
	tests/model/test_hf.py tests/run/test_lm_runs.py tests/model/test_batch_dependence.py tests/accel/test_precision.py tests/accel/test_engine_gaps.py \
	tests/accel/graph/test_ops_without_gradient.py tests/accel/graph/test_aten_gelu.py tests/accel/graph/test_bf16_weights.py \
	tests/accel/graph/test_aten_cross_entropy.py tests/accel/test_compile.py tests/accel/graph/test_graph_plan.py \
	tests/accel/test_hooks.py tests/check/test_parity.py tests/check/test_planted.py \
	tests/accel/graph/test_decomposition_precision.py tests/accel/graph/test_bf16_edges.py tests/accel/graph/test_aten_relu.py \
	tests/accel/test_stop_gradients.py tests/accel/graph/test_bf16_gelu_edges.py tests/accel/graph/test_bf16_gated_edges.py \
	tests/accel/test_artifacts_weights.py tests/accel/graph/test_aten_attention.py
BIN := $(VENV)/bin
TRAIN_STAMP := $(VENV)/.ortflow-train
TEST_STAMP := $(VENV)/.ortflow-test
ARGS ?= +recipe=transformer accel=ortmodule
PYTEST_ARGS ?=
# The slowest tests are listed at the end of every run, so the next slow test is seen.
DURATIONS ?= --durations=25
PINS = "torch==$(TORCH)" "torchvision==$(TORCHVISION)"
# The ninja wheel (used by the one-time extension build) installs into the venv.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup setup-test setup-range train test test-fast test-slow test-full test-range lint setup-device test-device

# What training needs: the pinned stack and ortflow (editable) with torchvision. Redone when pyproject.toml changes.
$(TRAIN_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 12) else "ortflow needs Python 3.11 or 3.12: onnxruntime-training 1.19.2 has no wheels for others (set PYTHON=python3.12, ...)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[vision]" $(PINS)
	touch $@

# The tests add their tools, the notebook runner and the optional libraries (transformers, datasets, ...).
$(TEST_STAMP): $(TRAIN_STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test]" $(PINS)
	touch $@

# ORTModule's C++ extensions: built once per machine (about a minute on 2 cores; kept in ~/.cache/ortflow/extensions),
# copied into each venv, skipped when present.
setup: $(TRAIN_STAMP)
	$(BIN)/python -m ortflow.accel.compat.extensions

setup-test: setup $(TEST_STAMP)

train: setup
	$(BIN)/ortflow $(ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check ortflow tests hydra_plugins
	$(BIN)/ruff format --check ortflow tests hydra_plugins
	$(BIN)/lint-imports

# Tests run on every core (pytest-xdist): they are independent (own tmp dirs, free ports, in-process Hydra state
# per worker). PYTEST_ARGS="-n 0" runs them in one process. The slow tests come first (tests/conftest.py) and each
# worker takes 2 tests at a time, so the slow ones spread over the workers (xdist's default first hands each worker
# a quarter of its share in one block: one worker then got every slow test and ran 2.5 min after the other ended).
XDIST = -n auto --maxschedchunk=2
# Two tiers, as lightning-hydra-template and torchtitan split theirs: `make test` (the README's test command) runs
# the suite without the end-to-end tier, the development loop (under 8 minutes on 2 cores); `make test-slow` runs
# the end-to-end tier (@pytest.mark.slow: trainings to accuracy, the third-party model zoo, DDP, sweeps, resumes
# after kill -9, the benchmark); CI runs both, one after the other. `make test-full` runs both in one pytest run.
test: setup-test lint
	$(BIN)/python -m pytest $(XDIST) -m "not slow" $(DURATIONS) $(PYTEST_ARGS)

# The name the fast tier had before it became `make test`.
test-fast: test

test-slow: setup-test
	$(BIN)/python -m pytest $(XDIST) -m slow $(DURATIONS) $(PYTEST_ARGS)

test-full: setup-test lint
	$(BIN)/python -m pytest $(XDIST) $(DURATIONS) $(PYTEST_ARGS)

# The other end of the torch range: its own venv (set up like .venv, extensions included), the engine tests.
setup-range:
	$(MAKE) VENV=.venv-torch$(RANGE_TORCH) TORCH=$(RANGE_TORCH) setup-test

test-range: lint setup-range
	PATH=$(abspath .venv-torch$(RANGE_TORCH))/bin:$$PATH .venv-torch$(RANGE_TORCH)/bin/python -m pytest $(XDIST) \
		$(DURATIONS) $(RANGE_TESTS) $(PYTEST_ARGS)

# The device tests' tools, each installed once: Debian's chromium (driven headless by the browser tests) and npm,
# then onnxruntime-web 1.19.2's training build fetched by npm into ~/.cache/ortflow/ (what `--web` vendors).
# The browser tests drive Debian's chromium with Playwright (the test extras' `playwright`): nothing downloads a browser.
setup-device: setup-test
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	@command -v npm >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm; }
	$(BIN)/python -m ortflow.device.web

# tests/device/ (deselected from the other targets): exports that train where torch is absent and in a browser. One
# process: its tests share trained runs (a module fixture), which xdist workers would each train again.
test-device: setup-device
	ORTFLOW_DEVICE_TESTS=1 ORTFLOW_TESTS_REQUIRE_TOOLS=1 $(BIN)/python -m pytest -n 0 $(DURATIONS) tests/device $(PYTEST_ARGS)

# ---------------------------------------------------------------- beyond one machine: clusters and the newest torch
# The tests against real clusters they start themselves (tests/cluster/: a Ray head and a second node, a one-node
# SLURM), in their own phase: one test at a time, as each starts its cluster. `make setup-cluster` (root, Debian)
# installs what they need besides .venv's ray and submitit: slurm-wlm and munge, and iproute2 for the Ray cluster's
# loopback-only network namespace.
CLUSTER_TESTS ?= tests/cluster
.PHONY: setup-cluster test-cluster setup-newest test-newest
setup-cluster:
	@command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v ip >/dev/null || { \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge iproute2; }

test-cluster: setup-test
	ORTFLOW_CLUSTER_TESTS=1 ORTFLOW_TESTS_REQUIRE_TOOLS=1 $(BIN)/python -m pytest -n 0 $(DURATIONS) $(CLUSTER_TESTS) $(PYTEST_ARGS)

# distributed=deepspeed's tests (tests/deepspeed/) in a venv of their own: ORTModule imports DeepSpeed whenever it is
# installed (about a second at every ORTModule start), so the other venvs go without ortflow[deepspeed]. Set up as
# .venv is, plus the extra, plus DeepSpeed's just-in-time communication op built once into ortflow's cache (so that
# two ranks never build it at their first step).
DEEPSPEED_VENV := .venv-deepspeed
DEEPSPEED_STAMP := $(DEEPSPEED_VENV)/.ortflow-deepspeed
.PHONY: setup-deepspeed test-deepspeed
$(DEEPSPEED_STAMP): pyproject.toml
	$(MAKE) VENV=$(DEEPSPEED_VENV) setup-test
	$(DEEPSPEED_VENV)/bin/python -m pip install --quiet -e ".[deepspeed]" $(PINS)
	touch $@

setup-deepspeed: $(DEEPSPEED_STAMP)
	$(DEEPSPEED_VENV)/bin/python -m ortflow.step.deepspeed

test-deepspeed: setup-deepspeed
	ORTFLOW_DEEPSPEED_TESTS=1 ORTFLOW_TESTS_REQUIRE_TOOLS=1 $(DEEPSPEED_VENV)/bin/python -m pytest -n 0 $(DURATIONS) \
		tests/deepspeed $(PYTEST_ARGS)

# The newest torch in the supported range, a third leg beside the default and RANGE_TORCH: the same RANGE_TESTS in
# .venv-torch$(NEWEST_TORCH). The development machines' pip caps torch at 2.14.1 with a constraints file
# (/etc/xdg/pip); an empty one (PIP_CONSTRAINT=/dev/null) lifts the cap for this venv's installs only.
NEWEST_TORCH ?= 2.15.0
setup-newest:
	PIP_CONSTRAINT=/dev/null $(MAKE) setup-range RANGE_TORCH=$(NEWEST_TORCH)

# On the newest torch: the engines, the graphs and DDP (what moves between torch releases: the exporter, autograd,
# torch.distributed), without the resume and LM-run tests the oldest end and `make test` already run.
NEWEST_TESTS ?= $(filter-out tests/run/test_resume.py tests/run/test_lm_runs.py tests/model/test_batch_dependence.py,$(RANGE_TESTS))
# DDP around a compiled model and accel=auto's probe under DDP (a minute and a half of this leg's four minutes on a
# 2-core Zen 5): `make test-slow` runs them on the default torch; here torch.compile's and auto's own tests run.
NEWEST_DESELECT ?= --deselect "tests/test_distributed.py::test_two_ranks_with_batch_b_match_one_process_with_batch_2b[compile]" \
	--deselect tests/test_distributed.py::test_under_ddp_rank_0_probes_for_accel_auto_and_every_rank_trains_with_its_choice_in_bf16
test-newest: setup-newest
	PIP_CONSTRAINT=/dev/null $(MAKE) test-range RANGE_TORCH=$(NEWEST_TORCH) RANGE_TESTS="$(NEWEST_TESTS)" \
		PYTEST_ARGS='$(NEWEST_DESELECT) $(PYTEST_ARGS)'

