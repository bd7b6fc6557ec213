"""The page in headless Chromium, driven by Playwright with Debian's chromium as its executable (nothing downloads a
browser): a server of the export folder (ortflow.device.serve's), and the page's result read from the page itself
(its hidden #result element, written when it is done or failed)."""

import contextlib
import json
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ortflow.device import serve
from tests.device.conftest import BROWSER, require
from tests.helpers.clusters import tools_required


@contextlib.contextmanager
def served(folder: Path, handler: type[serve.Handler] = serve.Handler) -> Iterator[str]:
    """`folder` served on a free loopback port; its base URL."""
    server = serve.make_server(folder, port=0, handler=handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium under Playwright (its Browser)."""
    executable = require(BROWSER, "the browser tests drive the page in headless Chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        message = "playwright is not installed (the test extras have it: pip install -e '.[test]')"
        if tools_required():
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


def url(base: str, **params: str | int | None) -> str:
    """The page's URL with `params` (None: a flag without value)."""
    parts = [k if v is None else f"{k}={urllib.parse.quote(str(v), safe='/.:')}" for k, v in params.items()]
    return f"{base}/web/index.html" + (f"?{'&'.join(parts)}" if parts else "")


def result(page: Any, timeout: float = 240) -> dict:
    """The page's result: the JSON it writes into #result when it is done or failed (waited for, then cleared, so
    that the next wait sees the next result)."""
    handle = page.wait_for_function(
        "() => { const r = document.getElementById('result'); const t = r.textContent; "
        "if (t) r.textContent = ''; return t || null; }",
        timeout=timeout * 1000,
    )
    return json.loads(handle.json_value())


def run(
    folder: Path, timeout: float = 240, handler: type[serve.Handler] = serve.Handler, **params: str | int | None
) -> dict:
    """Open folder/web/index.html, served by `handler`, with `params`; the page's result."""
    with served(folder, handler) as base, chromium() as browser:
        page = browser.new_page()
        page.goto(url(base, **params))
        return result(page, timeout)
