"""ORTModule's C++ extensions: built once per machine, installed into each Python environment that needs them.

`python -m ortflow.accel.compat.extensions` builds them if missing (the README's set-up runs it); the ortmodule engine
calls `ensure_built()` too, so an ortflow installed some other way still works on first use.

ortflow copies ORT's sources out of the package, patches the copy for the installed torch (cpp_patches.py) and
builds that: each extension as one translation unit without debug info (extension_setup.py), the extensions side
by side on the machine's cores, the compiler's output in a log file. The libraries are kept in a per-machine cache
(`$ORTFLOW_CACHE_DIR`, else `$XDG_CACHE_HOME/ortflow`, else `~/.cache/ortflow`; then `extensions/<key>/`), keyed by
the torch, ORT and Python versions, the compiler and a hash of the patched sources, so a second clone or venv on
the same machine copies them instead of compiling. They are installed where ORT's installer puts them, beside a
record of the torch and patches they were built with: a torch upgrade or downgrade, or a new patch, rebuilds them.
"""

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from ortflow.accel.compat import cpp_patches
from ortflow.errors import OrtflowError
from ortflow.paths import ortflow_cache

log = logging.getLogger(__name__)

RECORD = ".ortflow-build.json"  # {"torch": version built against, "patches": [cpp_patches names], "key": ...}
LOG = "build.log"
# Bumped when the way ortflow builds the extensions changes (flags, unity sources): a new cache key.
BUILD_RECIPE = 2


def extensions_dir() -> Path:
    """ORTModule's extension folder, found without importing ORTModule (whose import needs the torch patches)."""
    spec = importlib.util.find_spec("onnxruntime")
    folder = None
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations))) / "training/ortmodule/torch_cpp_extensions"
    if folder is None or not (folder / "cpu").is_dir():
        raise OrtflowError(
            "accel=ortmodule needs onnxruntime-training (module onnxruntime.training.ortmodule), which is not "
            "installed in this environment. Install ortflow's stack (see docs/versions.md)."
        )
    return folder


def cache_root() -> Path:
    """The per-machine folder of built extensions (one subfolder per build key)."""
    return ortflow_cache() / "extensions"


def _libraries(directory: Path) -> list[Path]:
    return [path for pattern in ("*.so", "*.dll", "*.dylib") for path in directory.glob(pattern)]


def build_record(directory: Path | None = None) -> dict | None:
    """What ortflow recorded when it built the extensions in `directory` (None: not built by ortflow)."""
    try:
        return json.loads(((directory or extensions_dir()) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def _wanted() -> dict:
    return {"torch": torch.__version__, "patches": [patch.name for patch in cpp_patches.needed()]}


def is_built(directory: Path | None = None) -> bool:
    """True when ORTModule's extension folder holds libraries built for the installed torch: ortflow's record
    names this torch and the source patches it needs, or (libraries from ORT's own installer, no record) this
    torch needs none. A torch upgrade or downgrade, or a new patch in ortflow, means a rebuild."""
    directory = directory or extensions_dir()
    if not _libraries(directory):
        return False
    record = build_record(directory)
    if record is None:
        return not cpp_patches.needed()
    return {key: record.get(key) for key in ("torch", "patches")} == _wanted()


def compiler() -> str:
    """The first line of `$CXX --version` (torch's extension build uses $CXX, else c++)."""
    cxx = os.environ.get("CXX", "c++")
    try:
        result = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False, timeout=60)
    except OSError:
        return f"{cxx}: not found"
    return (result.stdout.splitlines() or [f"{cxx}: no version"])[0].strip()


def build_key(sources: Path) -> str:
    """The cache folder's name for extensions built from the patched `sources` (a cpu/ folder) on this machine."""
    digest = hashlib.sha256()
    for path in sorted(sources.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(sources)).encode() + b"\0" + path.read_bytes() + b"\0")
    identity = {
        "recipe": BUILD_RECIPE,
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "onnxruntime": _ort_version(),
        "python": sysconfig.get_config_var("EXT_SUFFIX") or sys.version,
        "compiler": compiler(),
        "sources": digest.hexdigest(),
    }
    short = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    return f"torch{torch.__version__.replace('+', '_')}-ort{identity['onnxruntime']}-{python}-{short}"


def _distribution_present(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _ort_version() -> str:
    for name in ("onnxruntime-training-cpu", "onnxruntime-training"):
        if _distribution_present(name):
            return importlib.metadata.version(name)
    return "unknown"


def _compile(cpu: Path, work: Path, log_file: Path) -> list[Path]:
    """Build every extension under `cpu` at once (one process each: one translation unit each, so they share the
    cores), the compiler's output appended to `log_file`. Returns the libraries; raises OrtflowError on failure."""
    env = dict(os.environ)
    # The `ninja` wheel installs its binary beside this Python; the build needs it on PATH.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    builds = []
    with open(log_file, "a") as output:
        for setup in sorted(cpu.glob("*/setup.py")):
            folder = work / f"build-{setup.parent.name}"
            folder.mkdir()
            command = [sys.executable, "-m", "ortflow.accel.compat.extension_setup", str(setup), "build"]
            output.write(f"$ {' '.join(command)}  (in {folder})\n")
            output.flush()
            process = subprocess.Popen(command, cwd=folder, env=env, stdout=output, stderr=subprocess.STDOUT)
            builds.append((setup.parent.name, folder, process))
        failed = [name for name, _, process in builds if process.wait() != 0]
    if failed:
        tail = "".join(log_file.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise OrtflowError(
            f"Building ORTModule's C++ extension(s) {', '.join(failed)} failed; the compiler's output is in "
            f"{log_file} (its end is below). They need a C++ compiler (g++) and the Python headers. accel=none does "
            "not need them, nor does accel=artifacts unless the model has convolutions run by torch's kernels "
            f"(accel.aten_conv, and transposed convolutions always).\n{tail}"
        )
    return [
        library
        for _, folder, _ in builds
        for library in (folder / "build").glob("lib.*/*")
        if library.suffix in (".so", ".dll", ".dylib")
    ]


def _install(cached: Path, directory: Path) -> None:
    """Copy the cached libraries into ORTModule's folder, replacing what is there, then write the record."""
    libraries = _libraries(cached)
    for old in _libraries(directory):
        if old.name not in {library.name for library in libraries}:
            old.unlink()
    for library in libraries:
        # A new file moved over the old one: a process that has the old library loaded keeps its copy.
        staged = directory / f".{library.name}.new"
        shutil.copyfile(library, staged)
        os.replace(staged, directory / library.name)
    shutil.copyfile(cached / RECORD, directory / RECORD)


def _build_into_cache(cpu: Path, patches: list[str], cached: Path) -> float:
    """Compile into the cache folder `cached` (under its lock, so two venvs building at once compile once)."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OrtflowError(
            f"cannot create the cache folder for ORTModule's C++ extensions, {cached.parent} ({error}); set "
            "ORTFLOW_CACHE_DIR to a writable folder."
        ) from error
    with open(cached.parent / f".{cached.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (cached / RECORD).is_file() and _libraries(cached):
            return 0.0
        staging = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
        log_file = staging / LOG
        print(
            f"ortflow: building ORTModule's C++ extensions once for this machine (about 1-2 minutes on 2 cores; "
            f"compiler output: {cached / LOG}) ...",
            file=sys.stderr,
            flush=True,
        )
        start = time.monotonic()
        try:
            with tempfile.TemporaryDirectory(prefix="ortflow-extensions-") as work:
                for library in _compile(cpu, Path(work), log_file):
                    shutil.copyfile(library, staging / library.name)
            seconds = time.monotonic() - start
            record = {**_wanted(), "patches": patches, "key": cached.name, "build_seconds": round(seconds, 1)}
            (staging / RECORD).write_text(json.dumps(record))
            shutil.rmtree(cached, ignore_errors=True)
            os.replace(staging, cached)
        except BaseException:
            failed_log = cached.parent / f"{cached.name}.failed.log"
            if log_file.is_file():
                shutil.copyfile(log_file, failed_log)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return seconds


def ensure_built() -> bool:
    """Install the extensions unless present, from the machine's cache or by building them. Returns True if they
    were installed (built or copied).

    File locks serialise concurrent callers (parallel sweep jobs, several ranks, two venvs): the first builds, the
    others wait and then find the libraries present. The build prints one line before and one after; the
    compiler's output goes to a log file in the cache folder.

    Raises:
        OrtflowError: the build failed (the message names the log and quotes its end: usually a missing compiler).
    """
    directory = extensions_dir()
    if is_built(directory):
        return False
    with open(directory / ".ortflow-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(directory):
            return False
        with tempfile.TemporaryDirectory(prefix="ortflow-sources-") as work:
            cpu = Path(work) / "cpu"
            shutil.copytree(directory / "cpu", cpu, ignore=shutil.ignore_patterns("__pycache__"))
            patches = cpp_patches.apply(cpu)
            cached = cache_root() / build_key(cpu)
            seconds = 0.0
            if not ((cached / RECORD).is_file() and _libraries(cached)):
                seconds = _build_into_cache(cpu, patches, cached)
        if seconds:
            print(f"ortflow: extensions built in {seconds:.0f} s (kept in {cached}).", file=sys.stderr, flush=True)
        else:
            print(f"ortflow: ORTModule's C++ extensions copied from this machine's cache, {cached}.", file=sys.stderr)
        _install(cached, directory)
        if not is_built(directory):
            raise OrtflowError(f"ORTModule's C++ extensions from {cached} did not install into {directory}.")
        return True


if __name__ == "__main__":
    if not ensure_built():
        print(f"ortflow: ORTModule's C++ extensions are already built in {extensions_dir()}.", file=sys.stderr)
