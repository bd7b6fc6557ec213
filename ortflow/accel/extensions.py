"""ORTModule's C++ extensions: built once per Python environment, never rebuilt when present.

`python -m ortflow.accel.extensions` builds them if missing (the README's set-up runs it); the ortmodule engine
calls `ensure_built()` too, so an ortflow installed some other way still works on first use.
"""

import fcntl
import importlib.util
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from ortflow.errors import OrtflowError

log = logging.getLogger(__name__)

_INSTALL_MODULE = "onnxruntime.training.ortmodule.torch_cpp_extensions.install"


def extensions_dir() -> Path:
    spec = importlib.util.find_spec("onnxruntime.training.ortmodule.torch_cpp_extensions")
    if spec is None or not spec.submodule_search_locations:
        raise OrtflowError(
            "accel=ortmodule needs onnxruntime-training (module onnxruntime.training.ortmodule), which is not "
            "installed in this environment. Install ortflow's pinned stack (see README)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def is_built(directory: Path | None = None) -> bool:
    """True when at least one compiled extension library sits in ORTModule's extension folder."""
    directory = directory or extensions_dir()
    return any(directory.glob("*.so")) or any(directory.glob("*.dll")) or any(directory.glob("*.dylib"))


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
            f"(2-5 minutes, into {directory}) ...",
            file=sys.stderr,
            flush=True,
        )
        env = dict(os.environ)
        # The `ninja` wheel installs its binary beside this Python; the build needs it on PATH.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", _INSTALL_MODULE], env=env, check=False)
        if result.returncode != 0 or not is_built(directory):
            raise OrtflowError(
                f"Building ORTModule's C++ extensions failed (exit code {result.returncode}); the compiler output "
                "is above. They need a C++ compiler (g++) and the Python headers. accel=none and "
                "accel=artifacts do not need them."
            )
        print(f"ortflow: extensions built in {time.monotonic() - start:.0f} s.", file=sys.stderr, flush=True)
        return True


if __name__ == "__main__":
    if not ensure_built():
        print(f"ortflow: ORTModule's C++ extensions are already built in {extensions_dir()}.", file=sys.stderr)
