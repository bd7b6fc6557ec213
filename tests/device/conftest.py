"""The device tests: exports checked without torch (`device` marker) and in headless Chromium (`browser` marker).

They run in their own phase (`make test-device`, ORTFLOW_DEVICE_TESTS=1): each trains small runs and exports them,
a minute or more in all, and the browser tests need Debian's chromium, driven by Playwright (the test extras), and
onnxruntime-web from npm (`make setup-device`).
Without ORTFLOW_DEVICE_TESTS they are deselected. A missing browser or npm skips a test with the reason, except
under CI=true and in `make test-device` (ORTFLOW_TESTS_REQUIRE_TOOLS=1), where it fails; the session's summary says
how many browser tests ran, and there none is a failure.
"""

import os
import shutil

import pytest

from tests.helpers.clusters import deselect_marked, tools_required

ENABLED = os.environ.get("ORTFLOW_DEVICE_TESTS") == "1"
BROWSER = "chromium"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not ENABLED:
        deselect_marked(config, items, "device")


def require(tool: str, why: str) -> str:
    """The tool's path; a missing one skips the test (fails it under CI=true)."""
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not installed ({why}); `make setup-device` installs it"
        if tools_required():
            pytest.fail(message)
        pytest.skip(message)
    return path


_browser_runs = {"passed": 0, "other": 0}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and "browser" in report.keywords:
        _browser_runs["passed" if report.passed else "other"] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not ENABLED:
        return
    terminalreporter.write_line(
        f"browser tests run: {_browser_runs['passed']} passed, {_browser_runs['other']} not passed"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if ENABLED and tools_required() and _browser_runs["passed"] == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
