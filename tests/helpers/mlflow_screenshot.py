"""The screenshot in docs/tracking.md: a 4-trial Optuna sweep of the digits recipe sent to an MLflow tracking server
on loopback, its experiment page in MLflow's UI taken by headless Chromium.

    python -m tests.helpers.mlflow_screenshot docs/images/mlflow-sweep.png     # from the repository root
"""

import json
import os
import subprocess
import sys
import tempfile
import urllib.parse
from pathlib import Path

from tests.helpers.mlflow_server import MLflowServer, optuna_sweep

REPO = Path(__file__).resolve().parents[2]
SWEEP = [*optuna_sweep(), "logger.mlflow.experiment=digits-sweep"]


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        server = MLflowServer(tmp / "mlflow")
        try:
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            args = [*SWEEP, f"logger.mlflow.tracking_uri={server.uri}", f"hydra.sweep.dir={tmp / 'sweep'}"]
            subprocess.run([sys.executable, "-m", "ortflow", *args], cwd=tmp, env=env, check=True)
            client = server.client()
            experiment = client.get_experiment_by_name("digits-sweep").experiment_id
            runs = [r.info.run_id for r in client.search_runs([experiment], "tags.mlflow.parentRunId != ''")]
            # MLflow's page comparing the sweep's trials: their params, metrics and loss curves side by side.
            query = (
                urllib.parse.quote(json.dumps(runs), safe="")
                + "&experiments="
                + urllib.parse.quote(f'["{experiment}"]')
            )
            page = f"{server.uri}/#/compare-runs?runs={query}"
            subprocess.run(
                [
                    *("chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"),
                    *("--window-size=1600,1000", "--virtual-time-budget=20000", f"--screenshot={out.resolve()}"),
                    page,
                ],
                check=True,
                capture_output=True,
            )
        finally:
            server.stop()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
