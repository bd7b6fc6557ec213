"""Where the config tree is: inside the package in a wheel, at the repository top in a checkout."""

import os
import re
from collections.abc import Sequence
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def compose_config(overrides: list[str]):
    """The config the command line `ortflow OVERRIDES` would compose, without running (benchmarks, ortflow-check)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides)


def config_dir() -> Path:
    """The directory holding config.yaml (and recipe/, the recipes)."""
    for candidate in (_PACKAGE / "conf", _PACKAGE.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"ortflow's config tree was not found in {_PACKAGE / 'conf'} or {_PACKAGE.parent / 'conf'}")


def search_dirs(args: Sequence[str]) -> list[Path]:
    """The config directories command-line arguments add to Hydra's search path (`--config-dir DIR`,
    `hydra.searchpath=[file://DIR,...]`), in order; ortflow's own tree (config_dir) is not among them."""
    dirs = []
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            dirs.append(Path(args[i + 1]))
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.partition("=")[2]))
        elif arg.startswith("hydra.searchpath="):
            dirs += [Path(m) for m in re.findall(r"file://([^,\]\s'\"]+)", arg)]
    return dirs


def ortflow_cache() -> Path:
    """ortflow's per-machine cache (the built extensions, inductor's kernels): `$ORTFLOW_CACHE_DIR`, else
    `$XDG_CACHE_HOME/ortflow`, else `~/.cache/ortflow`."""
    if base := os.environ.get("ORTFLOW_CACHE_DIR"):
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ortflow"
