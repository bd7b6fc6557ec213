"""The graphs both ORT engines train with `accel.target=fast`, node for node against those recorded in
`golden/graphs.json` (on torch 2.14.1, where they were recorded): a change to the graph work that changes a graph
shows here, naming the graph and how its op counts moved. When a change is meant to change a graph, record the new
ones with `ORTFLOW_RECORD_GOLDEN=1 pytest tests/accel/graph/test_golden_graphs.py` and say why in the commit."""

import json
import os
from pathlib import Path

import pytest

from tests.helpers import graphs

GOLDEN = Path(__file__).parent / "golden" / "graphs.json"
RECORD = bool(os.environ.get("ORTFLOW_RECORD_GOLDEN"))
pytestmark = pytest.mark.skipif(not graphs.torch_ready(), reason="the golden graphs were recorded on torch 2.14.1")


@pytest.mark.parametrize(("recipe", "mode", "precision"), graphs.CASES, ids=["-".join(c) for c in graphs.CASES])
def test_fast_target_graphs_match_the_recorded_ones(recipe, mode, precision):
    recorded = json.loads(GOLDEN.read_text())
    got = graphs.engine_graphs(recipe, mode, precision)
    for name, model in got.items():
        key = f"{recipe}/{precision}/{mode}/{name}"
        lines = graphs.signature(model)
        now = {"sha256": graphs.digest(lines), "ops": graphs.op_counts(model)}
        if RECORD:
            recorded["graphs"][key] = now
            GOLDEN.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
            continue
        want = recorded["graphs"][key]
        moved = {
            op: (want["ops"].get(op, 0), now["ops"].get(op, 0))
            for op in sorted(set(want["ops"]) | set(now["ops"]))
            if want["ops"].get(op, 0) != now["ops"].get(op, 0)
        }
        assert now["sha256"] == want["sha256"], f"{key} changed; op counts (recorded, now): {moved or 'the same'}"
