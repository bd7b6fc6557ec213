"""The phases that exist to run the device and cluster tests cannot quietly shrink: there a missing tool fails a test
instead of skipping it, whatever the environment (`make test-device`, `make test-cluster`)."""

import pytest

from tests.conftest import REPO
from tests.device import conftest as device
from tests.helpers import clusters


def test_a_missing_tool_skips_in_the_fast_tier_and_fails_in_the_phases_that_need_it(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("ORTFLOW_TESTS_REQUIRE_TOOLS", raising=False)
    with pytest.raises(pytest.skip.Exception):
        device.require("no-such-browser", "the browser tests")
    with pytest.raises(pytest.skip.Exception):
        clusters.require(False, "no-such-cluster")
    monkeypatch.setenv("ORTFLOW_TESTS_REQUIRE_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception, match="no-such-browser is not installed"):
        device.require("no-such-browser", "the browser tests")
    with pytest.raises(pytest.fail.Exception, match="no-such-cluster"):
        clusters.require(False, "no-such-cluster")


def test_the_device_and_cluster_phases_require_their_tools():
    recipes = (REPO / "Makefile").read_text()
    for target in ("test-device:", "test-cluster:", "test-deepspeed:"):
        recipe = recipes.split(target, 1)[1].split("\n\n", 1)[0]
        assert "ORTFLOW_TESTS_REQUIRE_TOOLS=1" in recipe, target
