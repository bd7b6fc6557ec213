"""logger.csv: every log point to <run dir>/metrics.csv, one `step,name,value` row per scalar (a spreadsheet or
pandas reads it; a column per metric would change the file's shape each time a new metric appears)."""

import csv
import io
from pathlib import Path

from ortflow.files import write_bytes_atomic

FILE = "metrics.csv"
HEADER = ("step", "name", "value")


class CSVSink:
    """Appends the scalars RunLogger logs. A resumed run (`start_step` > 0) first drops the rows an interrupted
    attempt wrote after that step (they are superseded, as TensorBoard's purge_step drops them), so no step is
    in the file twice."""

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        path = run_dir / FILE
        if start_step and path.exists():
            with path.open(newline="") as old:
                kept = [row for row in csv.reader(old) if row and row[0] != "step" and int(row[0]) <= start_step]
            text = io.StringIO()
            csv.writer(text).writerows([HEADER, *kept])
            write_bytes_atomic(path, text.getvalue().encode())
        fresh = not path.exists() or path.stat().st_size == 0
        self.file = path.open("a", newline="")
        self.rows = csv.writer(self.file)
        if fresh:
            self.rows.writerow(HEADER)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.rows.writerows((step, name, repr(float(value))) for name, value in values.items())
        self.file.flush()

    def text(self, tag: str, text: str) -> None:
        """Texts (the config, the engine) are not rows: run.json and .hydra/ hold them."""

    def final(self, metrics: dict[str, float]) -> None:
        """The final metrics are run.json's; the rows hold the points as they were logged."""

    def close(self) -> None:
        self.file.close()
