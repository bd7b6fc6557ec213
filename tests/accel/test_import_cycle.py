"""No import cycle in ortflow.accel, importlib's included: each of its modules imported alone, in a fresh interpreter
that refuses a module handed out by importlib while it is still being imported (what import-linter cannot see: the
catalog imports the engines by name, from conf/accel)."""

import pkgutil
import subprocess
import sys

import pytest

import ortflow.accel

# Runs in the fresh interpreter: importlib.import_module refusing a half-imported module, then the module asked for.
CHECKED_IMPORT = """
import importlib, sys
original = importlib.import_module
def checked(name, package=None):
    module = original(name, package)
    if getattr(getattr(module, "__spec__", None), "_initializing", False):
        raise ImportError(f"import cycle: {name} was imported by name while it was still being imported")
    return module
importlib.import_module = checked
importlib.import_module(sys.argv[1])
"""

MODULES = sorted(f"ortflow.accel.{m.name}" for m in pkgutil.iter_modules(ortflow.accel.__path__))


@pytest.mark.parametrize("module", ["ortflow.accel", *MODULES])
def test_each_accel_module_imports_alone_without_a_cycle(module):
    done = subprocess.run([sys.executable, "-c", CHECKED_IMPORT, module], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
