"""The package's import graph keeps the order docs/layout.md states ([tool.importlinter] in pyproject.toml): no
import back up a layer, none between independent siblings, no cycle inside a package. The contracts are checked on
the package as it is, and shown to fail on a copy with one import added against them; no engine imports the
registry (`ortflow.accel`) back."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the ortflow package under `root` (its pyproject.toml's contracts), without grimp's cache."""
    script = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", script, "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_keeps_its_layers_and_has_no_cycle():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and "4 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # a low layer importing a higher one (inside a function: deferred imports count too)
        ("ortflow/config.py", "def _up():\n    from ortflow.run import runner  # noqa\n", "ortflow's layers"),
        # independent siblings: data and accel do not import each other
        ("ortflow/data/digits.py", "from ortflow.accel import engine  # noqa\n", "ortflow's layers"),
        # the compatibility layer importing the graph work above it
        ("ortflow/accel/compat/versions.py", "from ortflow.accel.graph import rewrites  # noqa\n", "three rooms"),
        # a cycle between two modules of one package
        ("ortflow/step/batch.py", "from ortflow.step import with_loss  # noqa\n", "no import cycle"),
        # an engine importing the registry back (what it needs comes in its EngineContext)
        ("ortflow/accel/none.py", "def _back():\n    from ortflow import accel  # noqa\n", "registry"),
    ],
)
def test_an_import_against_the_order_breaks_a_contract(tmp_path, module, line, broken):
    for name in ("ortflow", "pyproject.toml"):
        source = ROOT / name
        copy = shutil.copytree if source.is_dir() else shutil.copy
        copy(source, tmp_path / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if source.is_dir() else {}))
    path = tmp_path / module
    path.write_text(path.read_text() + "\n\n" + line)
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    # the contract named breaks, and the report names the module the import was added to
    broken_part = result.stdout.split("Broken contracts")[-1]
    assert broken in broken_part, result.stdout
    assert Path(module).stem in broken_part, result.stdout
