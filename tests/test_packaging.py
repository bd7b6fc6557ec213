"""The built wheel carries conf/ and the recipes, and an installed ortflow runs from any directory."""

import subprocess
import sys
import zipfile

import pytest

from ortflow.accel.compat import extensions
from tests.conftest import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("ortflow-*.whl")
    return path


@pytest.mark.slow
def test_wheel_contains_the_config_tree_and_recipes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    groups = ("accel/ortmodule", "model/transformer", "data/text", "data/diabetes", "loss/mse", "recipe/regression")
    for group in (*groups, "recipe/transformer", "recipe/digits", "hydra/job_logging/ortflow"):
        assert f"ortflow/conf/{group}.yaml" in names
    assert "ortflow/conf/config.yaml" in names
    assert "hydra_plugins/ortflow_optuna/sweeper.py" in names  # the Optuna sweeper, where Hydra looks for it


@pytest.mark.slow
def test_installed_package_composes_configs_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)

    def installed(*args: str) -> subprocess.CompletedProcess:  # Python with only the unpacked wheel on its path
        env = {"PYTHONPATH": str(site)}
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True)

    where = installed("-c", "import ortflow.paths as p; print(p.config_dir())")
    assert where.stdout.strip() == str(site / "ortflow" / "conf")
    result = installed("-m", "ortflow", "+recipe=digits", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    assert "build_mlp" in result.stdout
    optuna = installed("-m", "ortflow", "+recipe=digits", "+hparams_search=optuna", "--cfg", "hydra")
    assert optuna.returncode == 0, optuna.stderr
    assert "hydra_plugins.ortflow_optuna.sweeper.OptunaSweeper" in optuna.stdout


def test_ortmodule_extensions_are_built_and_not_rebuilt():
    # The set-up built them; asking again must find them and build nothing.
    assert extensions.is_built()
    assert extensions.ensure_built() is False
