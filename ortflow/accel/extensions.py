"""ORTModule's C++ extensions: built once per Python environment, never rebuilt when present.

`python -m ortflow.accel.extensions` builds them if missing (the README's set-up runs it); the ortmodule engine
calls `ensure_built()` too, so an ortflow installed some other way still works on first use.

ortflow copies ORT's sources out of the package, patches the copy for the installed torch (compat_cpp.py) and
builds that (ORT's own installer only for a torch that needs no patch, outside the supported range). The libraries
land where ORT's installer puts them, beside a record of the torch and patches they were built with: a torch
upgrade or downgrade, or a new patch, rebuilds them.
"""

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ortflow.accel import compat_cpp
from ortflow.errors import OrtflowError

log = logging.getLogger(__name__)

_INSTALL_MODULE = "onnxruntime.training.ortmodule.torch_cpp_extensions.install"


def extensions_dir() -> Path:
    """ORTModule's extension folder, found without importing ORTModule (whose import needs the torch patches)."""
    spec = importlib.util.find_spec("onnxruntime")
    folder = None
    if spec is not None and spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations))) / "training/ortmodule/torch_cpp_extensions"
    if folder is None or not (folder / "cpu").is_dir():
        raise OrtflowError(
            "accel=ortmodule needs onnxruntime-training (module onnxruntime.training.ortmodule), which is not "
            "installed in this environment. Install ortflow's stack (see README, Versions)."
        )
    return folder


RECORD = ".ortflow-build.json"  # {"torch": version built against, "patches": [compat_cpp patch names]}


def _libraries(directory: Path) -> list[Path]:
    return [path for pattern in ("*.so", "*.dll", "*.dylib") for path in directory.glob(pattern)]


def build_record(directory: Path | None = None) -> dict | None:
    """What ortflow recorded when it built the extensions in `directory` (None: not built by ortflow)."""
    try:
        return json.loads(((directory or extensions_dir()) / RECORD).read_text())
    except (OSError, ValueError):
        return None


def is_built(directory: Path | None = None) -> bool:
    """True when ORTModule's extension folder holds libraries built for the installed torch: ortflow's record
    names this torch and the source patches it needs, or (libraries from ORT's own installer, no record) this
    torch needs none. A torch upgrade or downgrade, or a new patch in ortflow, means a rebuild."""
    directory = directory or extensions_dir()
    if not _libraries(directory):
        return False
    record = build_record(directory)
    if record is None:
        return not compat_cpp.needed()
    return record == {"torch": torch.__version__, "patches": [patch.name for patch in compat_cpp.needed()]}


def _build_patched(directory: Path, env: dict[str, str]) -> tuple[int, list[str]]:
    """Build a patched copy of ORT's CPU extension sources; install the libraries into `directory`."""
    with tempfile.TemporaryDirectory(prefix="ortflow-extensions-") as work:
        cpu = Path(work) / "cpu"
        shutil.copytree(directory / "cpu", cpu, ignore=shutil.ignore_patterns("__pycache__"))
        patches = compat_cpp.apply(cpu)
        for setup in sorted(cpu.glob("*/setup.py")):
            result = subprocess.run([sys.executable, str(setup), "build"], cwd=work, env=env, check=False)
            if result.returncode != 0:
                return result.returncode, patches
        built = [path for path in (Path(work) / "build").glob("lib.*/*") if path.suffix in (".so", ".dll", ".dylib")]
        for old in _libraries(directory):
            if old.name not in {library.name for library in built}:
                old.unlink()
        for library in built:
            # A new file moved over the old one: a process that has the old library loaded keeps its copy.
            staged = directory / f".{library.name}.new"
            shutil.copyfile(library, staged)
            os.replace(staged, directory / library.name)
    return 0, patches


def ensure_built() -> bool:
    """Build the extensions unless present. Returns True if a build ran.

    A file lock serialises concurrent callers (parallel sweep jobs, several ranks): the first builds, the others
    wait and then find the libraries present. The build's own output streams to the terminal.

    Raises:
        OrtflowError: the build failed (its output, above, says why: usually a missing C++ compiler).
    """
    directory = extensions_dir()
    if is_built(directory):
        return False
    with open(directory / ".ortflow-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(directory):
            return False
        print(
            "ortflow: building ORTModule's C++ extensions once for this environment "
            f"(4-10 minutes on 2 cores, into {directory}) ...",
            file=sys.stderr,
            flush=True,
        )
        env = dict(os.environ)
        # The `ninja` wheel installs its binary beside this Python; the build needs it on PATH.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        start = time.monotonic()
        if compat_cpp.needed():
            returncode, patches = _build_patched(directory, env)
        else:
            returncode = subprocess.run([sys.executable, "-m", _INSTALL_MODULE], env=env, check=False).returncode
            patches = []
        if returncode == 0 and _libraries(directory):
            (directory / RECORD).write_text(json.dumps({"torch": torch.__version__, "patches": patches}))
        if returncode != 0 or not is_built(directory):
            raise OrtflowError(
                f"Building ORTModule's C++ extensions failed (exit code {returncode}); the compiler output "
                "is above. They need a C++ compiler (g++) and the Python headers. accel=none does not need them, "
                "nor does accel=artifacts unless the model has convolutions run by torch's kernels (accel.aten_conv, "
                "and transposed convolutions always)."
            )
        print(f"ortflow: extensions built in {time.monotonic() - start:.0f} s.", file=sys.stderr, flush=True)
        return True


if __name__ == "__main__":
    if not ensure_built():
        print(f"ortflow: ORTModule's C++ extensions are already built in {extensions_dir()}.", file=sys.stderr)
