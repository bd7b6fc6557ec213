"""Serve an exported set to a browser: `python web/serve.py` inside the export folder (a copy of this file), or
`python -m ortflow.device.serve DIR`. Standard library only.

onnxruntime-web needs the `.mjs` and `.wasm` MIME types, and its threads need cross-origin isolation (the COOP and
COEP headers; without them it trains on one thread, to the same losses). It serves the export folder's files and
nothing else: a path that leaves the folder (`..`, a link pointing out), a hidden file or folder (a name starting
with a dot) and a folder without index.html are 404. Only a folder inside the data folder (DIR/data/, where a
person puts what the page's `data=` URL parameter names) answers `?list`, with its files (relative paths, sorted,
hidden ones left out) as JSON: how the page reads a folder of images. Serves 127.0.0.1 unless told otherwise.
"""

import argparse
import functools
import http.server
import json
import os
import urllib.parse
from pathlib import Path
from typing import ClassVar

TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json"}
HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cache-Control": "no-store",
}


DATA = "data"  # the folder (inside the served one) whose folders `?list` lists


class Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map: ClassVar[dict[str, str]] = {**http.server.SimpleHTTPRequestHandler.extensions_map, **TYPES}

    def end_headers(self) -> None:
        for key, value in HEADERS.items():
            self.send_header(key, value)
        super().end_headers()

    def _served(self, url_path: str) -> Path | None:
        """The file or folder a URL path names, or None where it is not served: hidden, or outside the folder."""
        parts = urllib.parse.unquote(url_path).split("/")
        if any(part.startswith(".") for part in parts if part):
            return None
        root = Path(self.directory).resolve()
        path = Path(self.translate_path(url_path)).resolve()
        return path if path == root or path.is_relative_to(root) else None

    def do_HEAD(self) -> None:
        if self._served(urllib.parse.urlsplit(self.path).path) is None:
            return self.send_error(404)
        return super().do_HEAD()

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        folder = self._served(url.path)
        if folder is None:
            return self.send_error(404)
        if url.query != "list":
            return super().do_GET()
        root = Path(self.directory).resolve()
        data = root / DATA
        if not folder.is_dir() or not (folder == data or folder.is_relative_to(data)):
            return self.send_error(404, f"only the folders in {DATA}/ are listed")
        files = sorted(
            p.relative_to(folder).as_posix()
            for p in folder.rglob("*")
            if p.is_file()
            and p.resolve().is_relative_to(root)
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        )
        body = json.dumps(files).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return None

    def list_directory(self, path: str | os.PathLike[str]) -> None:  # a folder without index.html
        self.send_error(404)

    def log_message(self, format: str, *args: object) -> None:
        pass


def make_server(
    root: Path, host: str = "127.0.0.1", port: int = 8000, handler: type[Handler] = Handler
) -> http.server.ThreadingHTTPServer:
    """A server of `root` (port 0: any free port; its address is `server.server_address`)."""
    return http.server.ThreadingHTTPServer((host, port), functools.partial(handler, directory=str(root)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve().parent
    default = here.parent if (here.parent / "manifest.json").is_file() else Path.cwd()
    parser.add_argument("root", nargs="?", type=Path, default=default, help="the export folder (holding web/)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = make_server(args.root, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving {args.root} at http://{host}:{port}/web/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
