"""ortflow-bench's summary rows: one per setting and mode, medians over repeats, the ratio to eager (in the same
precision too) and the model FLOP utilisation."""

import statistics
from typing import Any


def summarize(
    runs: list[dict[str, Any]], peak_gflops: float, bf16_peak_gflops: float | None = None
) -> list[dict[str, Any]]:
    """One row per (setting, mode): medians over repeats and the ratio to eager in the same setting (and to eager in
    the same trainer.precision); MFU against the fp32 matmul peak, or the bf16 one for bf16-mixed rows."""
    rows = []
    for setting in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == setting]
        for mode in dict.fromkeys(r["mode"] for r in mine):
            ok = [r for r in mine if r["mode"] == mode and "error" not in r]
            peak = bf16_peak_gflops if precision_of(mode) == "bf16-mixed" and bf16_peak_gflops else peak_gflops
            row: dict[str, Any] = {"setting": setting, "mode": mode, "repeats": len(ok)}
            if not ok:
                row["error"] = next(r["error"] for r in mine if r["mode"] == mode)
                rows.append(row)
                continue
            sps = [r["samples_per_s"] for r in ok]
            median = statistics.median(sps)
            row |= {
                "executed_by": ok[0]["executed_by"],
                "samples_per_s": median,
                "samples_per_s_min": min(sps),
                "samples_per_s_max": max(sps),
                "steps": statistics.median(r.get("steps", 0) for r in ok),
                "passes": ok[0].get("passes"),
                "first_step_s": statistics.median(r["first_step_s"] for r in ok),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in ok),
                "trainable_params": ok[0].get("parameters", {}).get("trainable"),
                "runner_overhead": statistics.median(r["runner_overhead"] for r in ok),
                "loop_outside_engine": statistics.median(r["loop_outside_engine"] for r in ok),
                "mfu": ok[0]["flops_per_step"] * median / ok[0]["batch_size"] / (peak * 1e9),
            }
            rows.append(row)
        eager = next((r for r in rows if r["setting"] == setting and r["mode"] == "none" and "error" not in r), None)
        for r in rows:
            if r["setting"] == setting and eager and "error" not in r:
                r["vs_eager"] = r["samples_per_s"] / eager["samples_per_s"]
            precision = precision_of(r["mode"])
            same = f"none:trainer.precision={precision}"
            if r["setting"] == setting and precision and "error" not in r:
                twin = next(
                    (e for e in rows if e["setting"] == setting and e["mode"] == same and "error" not in e), None
                )
                if twin is not None:
                    r["vs_eager_same_precision"] = r["samples_per_s"] / twin["samples_per_s"]
    return rows


def precision_of(mode: str) -> str | None:
    """The trainer.precision a mode spec sets (`ortmodule:trainer.precision=bf16-mixed`), None when it sets none."""
    for override in mode.partition(":")[2].split(";"):
        key, _, value = override.partition("=")
        if key == "trainer.precision":
            return value
    return None
