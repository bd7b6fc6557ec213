"""accel=auto's decision from its measurements (ortflow/accel/auto.py): what a candidate measured (`Probe`), the
runoff's paired statistics (the sign test's interval of the median ratio), the choice (fastest, else the simplest of
those called equal, weighed against the run's length) and the table it prints."""

import dataclasses
import math

from rich.table import Table

from ortflow.accel import catalog
from ortflow.config import BF16, FP32
from ortflow.errors import OrtflowError


@dataclasses.dataclass
class Probe:
    """One candidate's measurement."""

    engine: str
    precision: str
    step_ms: float | None = None  # median of the timed steps
    first_step_s: float | None = None  # build + the untimed first step
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.engine} {self.precision}"


CONFIDENCE = 0.9  # the runoff's confidence in which of two candidates is faster


EQUAL_WITHIN = 1.03  # a ratio interval inside [1/1.03, 1.03]: the two are equal (3%), the simpler one trains


MIN_PAIRS = 5  # the fewest pairs whose sign-test interval can exclude 1 at 90% (both ends the extremes)


def median_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The distribution-free confidence interval of a median (the sign test's): order statistics k and n + 1 - k of
    the n values, k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2."""
    ordered = sorted(values)
    n = len(ordered)
    tail, k, below = (1 - confidence) / 2, 0, 0.0
    while k < n // 2 and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:  # too few values for this confidence: no bound
        return 0.0, math.inf
    return ordered[k - 1], ordered[n - k]


@dataclasses.dataclass
class Runoff:
    """The paired timing of the two fastest candidates of the first pass."""

    faster: str  # the first pass's fastest (label)
    other: str  # the runner-up
    pairs: int = 0
    ratio: float | None = None  # median of other's / faster's step time over the pairs
    low: float | None = None  # its confidence interval (CONFIDENCE)
    high: float | None = None
    verdict: str = "equal"  # "separated" (one is faster at CONFIDENCE) or "equal" (within 3%, or not separated)
    seconds: float = 0.0
    error: str | None = None


def _simplicity(probe: Probe) -> tuple[int, int]:
    return list(catalog.engines()).index(probe.engine), [FP32, BF16].index(probe.precision)


def measured(probes: list[Probe]) -> list[Probe]:
    """The probes that ran, fastest first."""
    return sorted((p for p in probes if p.step_ms is not None), key=lambda p: p.step_ms)


def choose(probes: list[Probe], run: Runoff | None = None, steps: int | None = None) -> Probe:
    """The fastest probe that ran; where a runoff called the two fastest equal, the simpler of them. With the run's
    length (`steps`), one-time costs are weighed too (`weigh`).

    Raises:
        OrtflowError: no candidate ran.
    """
    ran = measured(probes)
    if not ran:
        reasons = "; ".join(f"{p.label}: {p.error}" for p in probes)
        raise OrtflowError(f"accel=auto: no candidate engine could train this model ({reasons}).")
    if run is None or run.error or len(ran) < 2:
        return weigh(ran[0], ran, steps)
    first, second = ran[0], ran[1]
    if run.verdict == "separated":
        return weigh(first if run.ratio is not None and run.ratio > 1.0 else second, ran, steps)
    return weigh(min((first, second), key=_simplicity), ran, steps)


def run_seconds(probe: Probe, steps: int) -> float:
    """A probe's estimate of a run of `steps` steps: its start-up (build, export or compilation, the first step)
    and the rest at its measured step time."""
    return (probe.first_step_s or 0.0) + max(steps - 1, 0) * (probe.step_ms or 0.0) / 1000


def weigh(fastest: Probe, ran: list[Probe], steps: int | None) -> Probe:
    """`fastest` (by step time), unless a candidate that starts quicker ends a run of `steps` steps sooner: a short
    run does not pick an engine whose start-up (ORT's export, torch.compile's compilation) costs more than its faster
    steps save."""
    if steps is None:
        return fastest
    quicker = [p for p in ran if (p.first_step_s or 0.0) < (fastest.first_step_s or 0.0)]
    best = min(quicker, key=lambda p: run_seconds(p, steps), default=fastest)
    return best if run_seconds(best, steps) < run_seconds(fastest, steps) else fastest


def table(probes: list[Probe], chosen: Probe, cached: bool, by: str = "accel=auto", run: Runoff | None = None) -> Table:
    fastest = chosen.step_ms
    title = f"{by}: " + ("the probe of this model and batch cached on this machine" if cached else "probe")
    t = Table(title=title, title_justify="left")
    for col in ("engine", "precision", "ms/step", "x fastest", "first step", ""):
        t.add_column(col, justify="left" if col in ("engine", "precision", "") else "right")
    for p in probes:
        if p.step_ms is None:
            t.add_row(p.engine, p.precision, "failed", "", "", (p.error or "")[:80])
            continue
        mark = "chosen" if p is chosen else ""
        first = f"{p.first_step_s:.1f} s" if p.first_step_s is not None else "-"
        t.add_row(p.engine, p.precision, f"{p.step_ms:.1f}", f"{fastest / p.step_ms:.2f}", first, mark)
    if run is not None:
        t.caption = runoff_line(run)
    return t


def runoff_line(run: Runoff) -> str:
    if run.error:
        return f"runoff of {run.faster} and {run.other}: failed ({run.error}); the first pass decided"
    interval = f"[{run.low:.3f}, {run.high:.3f}]" if run.low is not None else "(too few pairs)"
    said = "one is faster" if run.verdict == "separated" else "equal: the simpler one trains"
    return (
        f"runoff of {run.faster} and {run.other}: {run.pairs} paired steps in {run.seconds:.0f} s, step-time ratio "
        f"{run.ratio:.3f}, {CONFIDENCE:.0%} interval {interval}: {said}"
    )
