"""The DeepSpeed tests (`deepspeed` marker): 2-rank runs under distributed=deepspeed, in their own phase (`make
test-deepspeed`, ORTFLOW_DEEPSPEED_TESTS=1) and venv (.venv-deepspeed, with ortflow[deepspeed]): ORTModule imports
DeepSpeed whenever it is installed, so the other phases' venvs do without it. Without ORTFLOW_DEEPSPEED_TESTS they
are deselected; there, a venv without DeepSpeed fails them under CI=true and in `make test-deepspeed`
(ORTFLOW_TESTS_REQUIRE_TOOLS=1) and skips them elsewhere.
"""

import os

import pytest

from tests.helpers.clusters import deselect_marked

ENABLED = os.environ.get("ORTFLOW_DEEPSPEED_TESTS") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not ENABLED:
        deselect_marked(config, items, "deepspeed")
