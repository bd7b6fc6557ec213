"""The page in headless Chromium: a server of the export folder (ortflow.device.serve's handler) that also takes the
page's POSTed result (its `report=` URL parameter), so a test waits for the page to finish in real time."""

import json
import queue
import subprocess
import threading
import urllib.parse
from pathlib import Path

from ortflow.device import serve
from tests.device.conftest import BROWSER, require

REPORT = "/report"


class _Reporting(serve.Handler):
    results: queue.Queue

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(204)
        self.end_headers()
        if self.path == REPORT:
            self.results.put(json.loads(body))


def run(folder: Path, profile: Path, timeout: float = 240, **params: str | int | None) -> dict:
    """Open folder/web/index.html with `params` (None: a flag without value) and `report`; the page's result."""
    results: queue.Queue = queue.Queue()
    server = serve.make_server(folder, port=0, handler=type("Handler", (_Reporting,), {"results": results}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    parts = [k if v is None else f"{k}={urllib.parse.quote(str(v), safe='/.')}" for k, v in params.items()]
    url = f"http://127.0.0.1:{port}/web/index.html?{'&'.join([*parts, f'report={REPORT}'])}"
    command = [
        require(BROWSER, "the browser tests drive the page in headless Chromium"),
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}", url,
    ]  # fmt: skip
    browser = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        return results.get(timeout=timeout)
    except queue.Empty:
        browser.kill()
        raise AssertionError(f"the page reported nothing in {timeout} s: {browser.communicate()[1][-1500:]}") from None
    finally:
        browser.kill()
        browser.wait()
        server.shutdown()
        server.server_close()
