# The two README commands. Each sets up .venv first when needed (idempotent), then does its job:
#   make train                       # ortflow +recipe=transformer accel=ortmodule
#   make train ARGS="+recipe=digits accel=artifacts"
#   make test                        # lint + the whole test suite
#   make test-fast                   # lint + the fast tier (-m 'not slow', ~2 minutes)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ortflow-installed
ARGS ?= +recipe=transformer accel=ortmodule
PYTEST_ARGS ?=
# The ninja wheel (used by the one-time extension build) installs into the venv.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: setup train test test-fast lint

# Install the pinned stack and ortflow (editable). Redone only when pyproject.toml changes.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ortflow needs Python >= 3.11 (set PYTHON=...)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

# ORTModule's C++ extensions: built once per environment (2-5 min), skipped when present.
setup: $(STAMP)
	$(BIN)/python -m ortflow.accel.extensions

train: setup
	$(BIN)/ortflow $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check ortflow tests hydra_plugins
	$(BIN)/ruff format --check ortflow tests hydra_plugins

# Tests run on every core (pytest-xdist): they are independent (own tmp dirs, free ports, in-process Hydra state
# per worker). PYTEST_ARGS="-n 0" runs them in one process.
test: setup lint
	$(BIN)/python -m pytest -n auto $(PYTEST_ARGS)

test-fast: setup lint
	$(BIN)/python -m pytest -n auto -m "not slow" $(PYTEST_ARGS)
