"""Serve an exported set to a browser: `python web/serve.py` inside the export folder (a copy of this file), or
`python -m ortflow.device.serve DIR`. Standard library only.

onnxruntime-web needs the `.mjs` and `.wasm` MIME types, and its threads need cross-origin isolation (the COOP and
COEP headers; without them it trains on one thread, to the same losses). A folder asked for with `?list` answers
with its files (relative paths, sorted) as JSON: how the page reads a folder of images named by its `data=` URL
parameter. Serves 127.0.0.1 unless told otherwise.
"""

import argparse
import functools
import http.server
import json
import urllib.parse
from pathlib import Path
from typing import ClassVar

TYPES = {".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json"}
HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cache-Control": "no-store",
}


class Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map: ClassVar[dict[str, str]] = {**http.server.SimpleHTTPRequestHandler.extensions_map, **TYPES}

    def end_headers(self) -> None:
        for key, value in HEADERS.items():
            self.send_header(key, value)
        super().end_headers()

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        folder = Path(self.translate_path(url.path))
        if url.query != "list" or not folder.is_dir():
            return super().do_GET()
        files = sorted(
            p.relative_to(folder).as_posix()
            for p in folder.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        )
        body = json.dumps(files).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return None

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
