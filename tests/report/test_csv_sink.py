"""logger.csv's metrics.csv: one step,name,value row per point; a resume drops the rows an interrupted attempt wrote
after its checkpoint, so that no step is in the file twice."""

import csv

from ortflow.report.csv_sink import CSVSink


def rows(path) -> list[tuple[int, str, float]]:
    with path.open(newline="") as file:
        return [(int(r["step"]), r["name"], float(r["value"])) for r in csv.DictReader(file)]


def test_a_resume_keeps_the_rows_up_to_its_step_and_appends_after_them(tmp_path):
    first = CSVSink(tmp_path)
    for step in range(1, 9):
        first.scalars(step, {"train/loss": 1.0 / step, "train/lr": 0.1})
    first.close()  # as a killed attempt would leave it (every row flushed)
    resumed = CSVSink(tmp_path, start_step=5)
    for step in range(6, 11):
        resumed.scalars(step, {"train/loss": 2.0 / step})
    resumed.close()
    got = rows(tmp_path / "metrics.csv")
    kept = [(s, n, v) for s in range(1, 6) for n, v in (("train/loss", 1.0 / s), ("train/lr", 0.1))]
    assert got == kept + [(s, "train/loss", 2.0 / s) for s in range(6, 11)]
    assert (tmp_path / "metrics.csv").read_text().count("step,name,value") == 1
