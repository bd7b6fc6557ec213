"""`--web`: a static folder that trains the set in a browser with onnxruntime-web's training build.

DIR/web/ gets the page (index.html, page.js) and its module (ortflow-device.js) from this package's web/ folder,
serve.py (MIME types, COOP/COEP headers, folder listings), and ort/: onnxruntime-web 1.19.2's training files,
vendored from npm at export time (`npm pack`, cached in ~/.cache/ortflow/onnxruntime-web-1.19.2/), or from a tarball
or unpacked package given with --ort-web. 1.19.2 is the last release with a training build. Nothing is loaded from
elsewhere: the folder works offline.
"""

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from ortflow.device import portable, serve
from ortflow.errors import OrtflowError

ASSETS = Path(__file__).resolve().parent / "web"
PAGE_FILES = ("index.html", "page.js", "ortflow-device.js")
FOLDER, ORT_FOLDER = "web", "ort"
CACHE_ENV = "ORTFLOW_ORT_WEB_CACHE"  # where the vendored files are kept (default ~/.cache/ortflow/...)


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "ortflow" / f"{portable.ORT_WEB_PACKAGE}-{portable.ORT_WEB_VERSION}"
    return Path(os.environ.get(CACHE_ENV) or default)


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in portable.ORT_WEB_FILES)


def _extract(tarball: Path, dest: Path) -> None:
    """The training build's files out of an npm tarball (package/dist/...)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as archive:
        for name in portable.ORT_WEB_FILES:
            try:
                member = archive.getmember(f"package/dist/{name}")
            except KeyError:
                raise OrtflowError(
                    f"--ort-web {tarball}: no package/dist/{name}; give onnxruntime-web 1.19.2's."
                ) from None
            source = archive.extractfile(member)
            assert source is not None
            (dest / name).write_bytes(source.read())


def npm_pack(dest: Path) -> None:
    """onnxruntime-web@1.19.2 from the npm registry by npm itself (its cache, its integrity check), unpacked."""
    npm = shutil.which("npm")
    spec = f"{portable.ORT_WEB_PACKAGE}@{portable.ORT_WEB_VERSION}"
    if npm is None:
        raise OrtflowError(
            f"--web vendors {spec}'s training build into the folder with npm, which is not installed here. Install "
            "Node.js's npm, or download the package's tarball (npm pack on another machine) and give it with --ort-web."
        )
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [npm, "pack", spec, "--pack-destination", tmp, "--silent"], capture_output=True, text=True, check=False
        )
        tarballs = list(Path(tmp).glob("*.tgz"))
        if done.returncode != 0 or not tarballs:
            reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no tarball"]
            raise OrtflowError(f"--web: npm pack {spec} failed ({reason[0]}); check the npm registry can be reached.")
        _extract(tarballs[0], dest)


def ort_web_files(source: Path | None) -> Path:
    """The folder holding portable.ORT_WEB_FILES: `source` (a .tgz, or a package or dist folder), else the cache,
    filled by npm when empty."""
    if source is not None:
        if source.is_file():
            target = Path(tempfile.mkdtemp(prefix="ortflow-ort-web-"))
            _extract(source, target)
            return target
        for folder in (source, source / "dist", source / "package" / "dist"):
            if _complete(folder):
                return folder
        raise OrtflowError(f"--ort-web {source}: holds no {', '.join(portable.ORT_WEB_FILES)}.")
    cache = cache_dir()
    if not _complete(cache):
        npm_pack(cache)
    return cache


def write(out: Path, source: Path | None = None) -> Path:
    """out/web/: the page, serve.py and onnxruntime-web's training files. Returns the folder."""
    web = out / FOLDER
    ort_files = ort_web_files(source)
    (web / ORT_FOLDER).mkdir(parents=True, exist_ok=True)
    for name in PAGE_FILES:
        shutil.copyfile(ASSETS / name, web / name)
    shutil.copyfile(serve.__file__, web / "serve.py")
    for name in portable.ORT_WEB_FILES:
        shutil.copyfile(ort_files / name, web / ORT_FOLDER / name)
    return web


def describe() -> dict[str, Any]:
    return {
        "folder": FOLDER,
        "onnxruntime_web": f"{portable.ORT_WEB_PACKAGE}@{portable.ORT_WEB_VERSION} (npm), its training build "
        f"vendored into {FOLDER}/{ORT_FOLDER}/",
        "serve": f"python {FOLDER}/serve.py  (then open http://127.0.0.1:8000/{FOLDER}/)",
        "page": f"{FOLDER}/index.html?set=..&steps=20",
    }


if __name__ == "__main__":  # `python -m ortflow.device.web`: fill the cache (CI's set-up, an offline machine's)
    print(ort_web_files(None))
