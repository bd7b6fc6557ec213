"""The tests against real clusters they start (`cluster` marker: a Ray head and a second node, a one-node SLURM).

They run in their own phase (`make test-cluster`, ORTFLOW_CLUSTER_TESTS=1), one at a time, as each starts its
cluster; without ORTFLOW_CLUSTER_TESTS they are deselected, whatever `-m` a command gives.
"""

import os

import pytest

from tests.helpers.clusters import deselect_marked

ENABLED = os.environ.get("ORTFLOW_CLUSTER_TESTS") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not ENABLED:
        deselect_marked(config, items, "cluster")
