"""`ortflow ...`: Hydra composes the config; runner.train does the work; user errors exit with status 2."""

import os
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ortflow.config import register_configs
from ortflow.errors import OrtflowError
from ortflow.paths import config_dir

register_configs()


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def _main(cfg: DictConfig) -> float:
    from ortflow.runner import train

    try:
        metrics = train(cfg, Path(HydraConfig.get().runtime.output_dir))
    except OrtflowError as err:
        if os.environ.get("ORTFLOW_TRACEBACK"):
            traceback.print_exc()
        print(f"ortflow: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    return metrics["eval/loss"]


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
