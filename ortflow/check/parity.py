"""ortflow-check's verdict: an engine's first step and loss curve against eager's own noise.

Eager's own noise is measured, never assumed: eager is trained again from the same weights moved by one ulp each
(ortflow/model/one_ulp.py: one ulp of the precision it computes in, bf16's with bf16-mixed; NOISE_SEEDS runs), on the
same batches.
From those runs (`Envelope.measure`):

- per trainable parameter, how far its step-1 gradient moves (the relative L2 difference from eager's, the largest
  over the runs: its spread); per buffer (BatchNorm's running statistics after the first step's forward), the same;
- per step, how far the loss has moved (the relative difference, the largest over the runs and the steps so far: the
  band).

Each step-1 gradient difference is measured against the gradient's norm or, where that is smaller, SCALE_FLOOR of the
norm a tensor of its size has at the model's typical gradient entry (one_ulp.gradient_scales): a gradient that is
rounding noise by itself (a conv bias before a BatchNorm, zero in exact arithmetic) is judged against the scale of the
gradients it sits among, so that another summation order of nothing never "differs".

bf16-mixed rows are held to eager **fp32**'s step-1 gradients, with eager bf16's own distance from them (eager bf16 and
its one-ulp runs, the largest) as the spread and BF16_MARGIN (not MARGIN) around it: an engine's bf16 kernels round
as eager's do, elsewhere, and a 10% gradient error stands out of that band where it would drown in 10 x eager's bf16
noise.

An engine's row (`judge`) "differs" when any of these fails, else it is "within eager's own noise", or "cannot judge"
where the smallest step-1 gradient error the check can see is above JUDGEABLE (1% in fp32, 10% in bf16-mixed: the
bound a "within" proves; `blind_spot`). The smallest error seen is the tolerance the parameters the model determines
share; where it determines none (every parameter's spread above NOISY: eager's own runs scramble every gradient), the
least noisy parameter's own tolerance, which is then far above JUDGEABLE: no "within" from a check that saw nothing:

1. every trainable parameter has a step-1 gradient in both eager and the engine, or in neither;
2. each parameter's step-1 gradient (same weights, same batch, read after the backward and before clipping:
   capture.py) is within max(GRADIENT_FLOOR, MARGIN x the larger of its own spread and the model's sharpest) of
   eager's; the worst parameter, by difference over tolerance, is named;
3. each floating-point buffer after the first step likewise (BUFFER_FLOOR); integer buffers (num_batches_tracked)
   are equal;
4. the first update (the weights after step 1) is within update.ULPS ulps of torch's optimizer applied to the engine's
   own gradients (update.py): the optimizer, its clipping and its conventions, whatever the gradients;
5. the loss at every step is within max(LOSS_FLOOR, LOSS_MARGIN x the band at that step) of eager's.

A row that fails 2 differs, whatever the model and the batch: ortflow-check no longer judges such a row again from
the next batch (a batch-dependent bug, or an error just over the tolerance, would pass there). A ReLU input that an
engine's rounding puts on the other side of its kink does flip one batch's gradient of a parameter (torchvision's
LR-ASPP, one batch of 72: a BatchNorm output at -3.1e-7 in eager and +6.0e-8 in the artifacts engine moved one bias's
gradient by 2.1e-2); such a row now differs, and where only step-1 gradients differ the verdict says what else that
can be (`KINK_HINT`), so that a user can try another seed by hand. Telling a flipped kink from a bug
needs the ReLU inputs read from the engine's own graph, which the check does not do.

The model's sharpest spread: a ReLU input (a BatchNorm variance, a max-pool tie) within rounding of its kink takes
either side under one ulp of the weights, and the gradients it feeds jump. Three runs catch such a jump in some
parameters and not in others (torchvision MNASNet 0.5 at 32x32, batch 8: 3 of 20 one-ulp runs moved one bias's
gradient by 3.7e-2, the other 17 by 2e-4, and both ORT engines by 3.7e-2), so every parameter is held to the largest
spread any parameter the model determines showed. Parameters whose spread exceeds NOISY are eager's own rounding noise
(a bias before a BatchNorm, whose gradient is 0 in exact arithmetic: one ulp moves it by 100% and more): each keeps its
own, larger tolerance.

MARGIN: an engine's kernels round differently from eager's (another summation order, a fused kernel), which moves
results further than one ulp of the weights does; measured on the models of docs/models.md (3 seeds x 3 batches
each), a correct engine's step-1 gradients were at most 1.5 x eager's spread, and 10 covers that. LOSS_MARGIN: later
losses are chaotic, and three runs sample where eager's own curves may go, they do not bound it. A correct engine's
loss reached 11.5 x the band (the artifacts engine on MobileNetV3-small, step 5: one weight's step-1 gradient is
1.4e-8, cancellation noise that AdamW turns into a 0.7 lr step, then a squeeze-excitation ReLU flips at step 4,
where 20 one-ulp runs reached 2 x the band of three), so 30. The floors are fp32 rounding: a loss moves by 1e-7 of
itself with no cause at all, and an engine's by 1.4e-6 (a U-Net's fourth step) where eager's own runs happened to
agree to the last bit.

`Envelope.detectable` says what the check can see: a gradient (buffer) error above the tolerance the model's
determined parameters share, and which parameters are rounding noise. Rows are plain dicts keyed by engine (`mode`);
`judge` adds its findings to them.
"""

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ortflow.check import update
from ortflow.config import BF16, FP32, OptimConfig
from ortflow.errors import OrtflowError
from ortflow.model.one_ulp import gradient_scales, relative, scaled

MARGIN = 10.0  # an engine's step 1 may move things by MARGIN x what one ulp of the weights moves them in eager
LOSS_MARGIN = 30.0  # its loss curve, at most LOSS_MARGIN x the band (Envelope.loss_margin_for)
# 20 one-ulp runs reached 2 x the band of three (MobileNetV3-small, step 5): the sampling's own share of the margin
LOSS_SAMPLING = 3.0
GRADIENT_FLOOR = 1e-5  # relative, per parameter: fp32 rounding of a gradient that one ulp of the weights never moves
BUFFER_FLOOR = 1e-5  # relative, per buffer
LOSS_FLOOR = 1e-5  # relative, per step
NOISY = 0.1  # a parameter (buffer) whose step-1 gradient (value) one ulp of the weights moves by more: rounding noise
# A row shows "within" only where the check sees a step-1 gradient error this small: 1% in fp32, 10% in bf16-mixed
# (whose rows are held to eager fp32's gradients, with eager bf16's own distance from them as the band: BF16_MARGIN).
JUDGEABLE = {FP32: 0.01, BF16: 0.1}
# A gradient is measured against its own norm or, where that is smaller, SCALE_FLOOR of the norm a tensor of its size
# has at the model's typical gradient entry (one_ulp.gradient_scales): noise-dominated gradients (biases before a
# BatchNorm, zero in exact arithmetic) are judged against the gradients they sit among.
SCALE_FLOOR = {FP32: 1e-3, BF16: 1e-2}
# bf16-mixed: an engine's bf16 kernels round as eager's bf16 kernels do, at other places: a correct engine's step-1
# gradients lie within BF16_MARGIN x eager bf16's own distance from eager fp32's (docs/models.md: the measured ratios).
BF16_MARGIN = 3.0
CANNOT_JUDGE = "cannot judge"  # the verdict where it cannot (blind_spot); --strict fails on it unless accepted


def _spreads(
    want: dict[str, np.ndarray], runs: list[dict[str, np.ndarray]], scales: dict[str, float] | None = None
) -> dict[str, float]:
    """How far each of `want`'s tensors moves in `runs` (the largest): relative to its norm, or to `scales`."""

    def moved(got: np.ndarray, name: str) -> float:
        return relative(got, want[name]) if scales is None else scaled(got, want[name], scales[name])

    return {name: max((moved(run[name], name) for run in runs if name in run), default=0.0) for name in want}


def _losses(got: list[float], want: list[float]) -> list[float]:
    return [abs(a - b) / abs(b) if b else abs(a) for a, b in zip(got, want, strict=False)]


@dataclass
class Envelope:
    """Eager's own noise in one precision: its losses, step-1 gradients and buffers, and how far one-ulp weights move
    each of them (the largest over `seeds` runs)."""

    losses: list[float]
    band: list[float]  # per step
    gradients: dict[str, np.ndarray] | None
    gradient_spread: dict[str, float]
    buffers: dict[str, np.ndarray]
    buffer_spread: dict[str, float]
    seeds: int
    margin: float = MARGIN
    loss_margin: float = LOSS_MARGIN
    floors: dict[str, float] = field(
        default_factory=lambda: {"gradient": GRADIENT_FLOOR, "buffer": BUFFER_FLOOR, "loss": LOSS_FLOOR}
    )
    judgeable: float = JUDGEABLE[FP32]  # blind_spot: the largest smallest-detectable error that allows a verdict
    gradient_scales: dict[str, float] | None = None  # what each gradient's difference is measured against
    # the parameters whose step-1 gradient is rounding noise: one ulp of the weights moves it by more than NOISY of
    # its own norm (default: those whose spread is over NOISY)
    noisy: set[str] | None = None

    def __post_init__(self) -> None:
        if self.gradient_scales is None and self.gradients is not None:
            self.gradient_scales = gradient_scales(self.gradients, SCALE_FLOOR[FP32])
        if self.noisy is None:
            self.noisy = {n for n, s in self.gradient_spread.items() if s > NOISY}

    @classmethod
    def measure(
        cls,
        eager: dict[str, Any],
        runs: list[dict[str, Any]],
        precision: str = FP32,
        fp32: dict[str, np.ndarray] | None = None,
    ) -> "Envelope":
        """From eager's row and its one-ulp runs' rows (`losses`, and `step_one`: a capture.StepOne), in
        `precision`. In bf16-mixed, with eager fp32's step-1 gradients `fp32`: those are the gradients rows are held
        to, and eager bf16's distance from them (its own and its one-ulp runs', the largest) is the spread."""
        first, others = eager["step_one"], [r["step_one"] for r in runs]
        gradients = first.gradients
        moved = [o.gradients for o in others if o.gradients is not None]
        if precision == BF16 and fp32 is not None and gradients is not None and set(fp32) == set(gradients):
            gradients, moved = fp32, [first.gradients]
        scales = gradient_scales(gradients, SCALE_FLOOR[precision]) if gradients else None
        spread = _spreads(gradients, moved, scales) if gradients else {}
        own = _spreads(gradients, moved) if gradients else {}  # against each gradient's own norm
        floating = {n: v for n, v in first.buffers.items() if not _integer(v)}
        # by step t, the furthest any run has gone from eager's curve at any step so far (one that came back
        # within the steps checked went as far: three runs sample where the curves may be at t, not bound it)
        band = list(
            np.maximum.accumulate(
                [max(d) for d in zip(*(_losses(r["losses"], eager["losses"]) for r in runs), strict=True)]
            )
        )
        return cls(
            losses=list(eager["losses"]),
            band=band,
            gradients=gradients,
            gradient_spread=spread,
            buffers=dict(first.buffers),
            buffer_spread=_spreads(floating, [o.buffers for o in others]),
            seeds=len(runs),
            margin=BF16_MARGIN if gradients is not first.gradients else MARGIN,
            judgeable=JUDGEABLE[precision],
            gradient_scales=scales,
            noisy={n for n, moved_by in own.items() if moved_by > NOISY},
        )

    @staticmethod
    def sharpest(spread: dict[str, float], noisy: set[str]) -> tuple[str | None, float]:
        """The parameter (buffer) whose value one ulp of the weights moved most, among those the model determines
        (not `noisy`), and that spread."""
        determined = {n: s for n, s in spread.items() if n not in noisy}
        name = max(determined, key=lambda n: determined[n], default=None)
        return name, determined.get(name, 0.0) if name is not None else 0.0

    def _noisy(self, what: str) -> set[str]:
        if what == "gradient":
            return self.noisy or set()
        return {n for n, s in self.buffer_spread.items() if s > NOISY}

    @cached_property
    def _sharpest(self) -> dict[str, float]:
        return {
            what: self.sharpest(spread, self._noisy(what))[1]
            for what, spread in (("gradient", self.gradient_spread), ("buffer", self.buffer_spread))
        }

    def gradient_difference(self, name: str, got: np.ndarray) -> float:
        """How far an engine's step-1 gradient of `name` is from the reference, as the spreads are measured."""
        assert self.gradients is not None and self.gradient_scales is not None
        return scaled(got, self.gradients[name], self.gradient_scales[name])

    def gradient_tolerance(self, name: str) -> float:
        """max(floor, MARGIN x the larger of the parameter's own spread and the model's sharpest); for a gradient
        that is rounding noise (`noisy`), at least the bound a "within" proves (`judgeable`), of the scale of the
        gradients beside it: another engine's summation order gives other noise, tens of times eager's own, and
        still nothing against its neighbours."""
        spread = max(self.gradient_spread.get(name, 0.0), self._sharpest["gradient"])
        tolerance = max(self.floors["gradient"], self.margin * spread)
        return max(tolerance, self.judgeable) if name in (self.noisy or set()) else tolerance

    def buffer_tolerance(self, name: str) -> float:
        spread = max(self.buffer_spread.get(name, 0.0), self._sharpest["buffer"])
        return max(self.floors["buffer"], self.margin * spread)

    def loss_allowed(self, margin: float | None = None) -> list[float]:
        """What each step's loss may differ by: `margin` (default LOSS_MARGIN) x the band, at least the floor."""
        margin = self.loss_margin if margin is None else margin
        return [max(self.floors["loss"], margin * band) for band in self.band]

    def loss_margin_for(self, row: dict[str, Any]) -> float:
        """The loss margin a row's own step 1 earns: its step-1 gradients moved R times as far from eager's as one ulp
        of the weights moves them (the largest ratio over the parameters the model determines), so its curve may
        move R times eager's band, and LOSS_SAMPLING times that (three runs sample the band, they do not bound it);
        at most LOSS_MARGIN, which is also the margin of a row without step-1 gradients."""
        found = row.get("gradient_ratio")
        if found is None:
            return self.loss_margin
        return min(self.loss_margin, LOSS_SAMPLING * max(1.0, found))

    def detectable(self) -> dict[str, Any]:
        """The smallest errors the check catches in any parameter's gradient (any buffer) the model determines: the
        tolerance they share, the one whose spread set it (None: the floor did), and those that are rounding noise
        (seen only beyond their own, larger tolerance)."""
        found: dict[str, Any] = {}
        for what, spread in (("gradient", self.gradient_spread), ("buffer", self.buffer_spread)):
            if not spread:
                continue
            noisy = self._noisy(what)
            name, sharpest = self.sharpest(spread, noisy)
            if name is None:  # nothing the model determines: the least noisy one bounds what is seen
                name = min(spread, key=lambda n: spread[n])
                sharpest = spread[name]
            error = max(self.floors[what], self.margin * sharpest)
            found[what] = {
                "error": error,
                "bounded_by": name if error > self.floors[what] else None,
                "spread": sharpest,
                "rounding_noise": sorted(noisy, key=lambda n: -spread[n]),
                "count": len(spread),
            }
        allowed = self.loss_allowed()
        if allowed:
            found["loss"] = {"step_1": allowed[0], "last_step": allowed[-1]}
        found["update"] = {"ulps": update.ULPS}
        return found

    def record(self) -> dict[str, Any]:
        """For the report (JSON): the band, what each step allows, what the check can see."""
        return {
            "seeds": self.seeds,
            "margin": self.margin,
            "loss_margin": self.loss_margin,
            "floors": dict(self.floors),
            "loss_band": self.band,
            "loss_allowed": self.loss_allowed(),
            "detectable": self.detectable(),
        }


def _integer(value: np.ndarray) -> bool:
    return not np.issubdtype(np.asarray(value).dtype, np.floating)


def _gradient_finding(row: dict[str, Any], envelope: Envelope, got: dict[str, np.ndarray] | None) -> str | None:
    want = envelope.gradients
    if want is None or got is None:
        row["gradients"] = None
        return None
    only_eager, only_engine = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    differences = {name: envelope.gradient_difference(name, got[name]) for name in want if name in got}
    worst = max(differences, key=lambda n: differences[n] / envelope.gradient_tolerance(n), default=None)
    row["gradients"] = {
        "worst": worst,
        "difference": differences.get(worst) if worst else None,
        "tolerance": envelope.gradient_tolerance(worst) if worst else None,
        "over_tolerance": sorted(n for n, d in differences.items() if not d <= envelope.gradient_tolerance(n)),
        "only_eager": only_eager,
        "only_engine": only_engine,
    }
    row["grad_rel_diff"] = row["gradients"]["difference"]
    determined = [n for n in differences if n not in (envelope.noisy or set())]
    if determined:  # how many one-ulp perturbations the engine's step 1 amounts to (Envelope.loss_margin_for)
        least = envelope.floors["gradient"] / envelope.margin
        ratios = (differences[n] / max(envelope.gradient_spread.get(n, 0.0), least) for n in determined)
        row["gradient_ratio"] = max(ratios)
    if only_eager or only_engine:
        name, side = (
            (only_eager[0], "eager has one, the engine none")
            if only_eager
            else (only_engine[0], "the engine has one, eager none")
        )
        return f"no step-1 gradient for '{name}' in one of them ({side})"
    if worst is not None and not differences[worst] <= envelope.gradient_tolerance(worst):
        return (
            f"step-1 gradient of '{worst}' {differences[worst]:.1e} from eager's (tolerance "
            f"{envelope.gradient_tolerance(worst):.1e})"
        )
    return None


def _buffer_finding(row: dict[str, Any], envelope: Envelope, got: dict[str, np.ndarray]) -> str | None:
    for name, value in envelope.buffers.items():
        if name not in got:
            return f"buffer '{name}' missing after step 1"
        if name not in envelope.buffer_spread and not np.array_equal(got[name], value):  # a count
            return f"'{name}' is {got[name]} after step 1, eager's {value}"
    differences = {n: relative(got[n], v) for n, v in envelope.buffers.items() if n in envelope.buffer_spread}
    worst = max(differences, key=lambda n: differences[n] / envelope.buffer_tolerance(n), default=None)
    if worst is None:
        return None
    row["buffers"] = {
        "worst": worst,
        "difference": differences[worst],
        "tolerance": envelope.buffer_tolerance(worst),
        "over_tolerance": sorted(n for n, d in differences.items() if not d <= envelope.buffer_tolerance(n)),
    }
    if not differences[worst] <= envelope.buffer_tolerance(worst):
        return (
            f"'{worst}' after step 1 {differences[worst]:.1e} from eager's (tolerance "
            f"{envelope.buffer_tolerance(worst):.1e})"
        )
    return None


def loss_finding(
    losses: list[float], envelope: Envelope, centre: list[float] | None = None, margin: float | None = None
) -> tuple[int, float, str | None]:
    """The step whose loss is furthest outside the envelope (by difference over what it allows), its difference,
    and the finding when it is outside. `centre`: the curve the envelope is put around (default eager's); `margin`:
    the band's multiple allowed (default LOSS_MARGIN)."""
    centre = envelope.losses if centre is None else centre
    margin = envelope.loss_margin if margin is None else margin
    differences, allowed = _losses(losses, centre), envelope.loss_allowed(margin)
    step = max(range(len(differences)), key=lambda i: differences[i] / allowed[i])
    if differences[step] <= allowed[step]:
        return step + 1, differences[step], None
    return (
        step + 1,
        differences[step],
        (
            f"loss at step {step + 1} {differences[step]:.1e} from eager's, outside its envelope {allowed[step]:.1e} "
            f"({margin:.3g} x eager's own {envelope.band[step]:.1e})"
        ),
    )


def _update_finding(
    row: dict[str, Any], step_one: Any, optim: OptimConfig | None, grad_clip: float | None
) -> str | None:
    if optim is None or not step_one.gradients or not step_one.after:
        return None
    found = update.differences(step_one.before, step_one.after, step_one.gradients, optim, grad_clip)
    worst = max(found, key=lambda n: found[n], default=None)
    if worst is None:
        return None
    row["update"] = {"worst": worst, "ulps": found[worst], "tolerance": update.ULPS}
    if found[worst] <= update.ULPS:
        return None
    return (
        f"first update of '{worst}' {found[worst]:.0f} ulps from torch's optimizer applied to the engine's own "
        f"gradients (over {update.ULPS}: another optimizer)"
    )


def judge(
    row: dict[str, Any], envelope: Envelope, optim: OptimConfig | None = None, grad_clip: float | None = None
) -> str:
    """The row's verdict against eager's envelope; its findings go into the row (`gradients`, `buffers`, `update`,
    `loss_step`, `max_rel_loss_diff`). With `optim` (and the run's `grad_clip`), the first update is held to torch's
    optimizer replayed on the engine's own gradients (update.py)."""
    step_one = row.get("step_one")
    findings: dict[str, str | None] = {}
    if step_one is not None:
        findings["gradient"] = _gradient_finding(row, envelope, step_one.gradients)
        findings["buffer"] = _buffer_finding(row, envelope, step_one.buffers)
        findings["update"] = _update_finding(row, step_one, optim, grad_clip)
    losses = row.get("losses")
    if losses is not None and len(losses) == len(envelope.losses):
        row["loss_margin"] = envelope.loss_margin_for(row)
        row["loss_step"], row["loss_step_diff"], findings["loss"] = loss_finding(
            losses, envelope, margin=row["loss_margin"]
        )
        row["max_rel_loss_diff"] = max(_losses(losses, envelope.losses))
    row["findings"] = {what: f for what, f in findings.items() if f is not None}
    if row["findings"]:
        verdict = "differs: " + "; ".join(row["findings"].values())
        if set(row["findings"]) == {"gradient"}:  # the losses after it within the band: say what else it can be
            verdict += f" ({KINK_HINT})"
        return verdict
    if (blind := blind_spot(envelope)) is not None:
        return f"{CANNOT_JUDGE}: {blind}"
    if step_one is not None and step_one.gradients is None:
        return "within eager's own noise in its losses (the engine offers no step-1 gradients to compare)"
    return "within eager's own noise"


def blind_spot(envelope: Envelope) -> str | None:
    """Why the check cannot call a row that shows no difference "within": the smallest step-1 gradient error it
    could see in the parameters the model determines is above JUDGEABLE (eager's own runs are too chaotic for a
    verdict); None when it can see that far."""
    found = envelope.detectable().get("gradient")
    if not found or found["error"] is None or found["error"] <= envelope.judgeable:
        return None
    return (
        f"the smallest step-1 gradient error the check can see is {found['error']:.2g} (one ulp of the weights moves "
        f"'{found['bounded_by']}''s gradient by {found['spread']:.2g}), above {envelope.judgeable:.0%}: a row that "
        "shows no difference proves nothing here; a larger batch or input (more samples behind each gradient) makes "
        "it judgeable"
    )


KINK_HINT = (
    "step-1 gradients alone, losses within eager's band: a ReLU input that the engine's rounding put across its kink "
    "on this batch does this too; the check cannot tell the two apart: run it again with another seed (seed=1: other "
    "weights, another batch)"
)


class ParityFailed(OrtflowError):
    """`check(..., strict=True)`: a row differs from eager beyond its own noise, or nothing could be compared. The
    report is `.report`."""

    def __init__(self, failed: list[str], report: dict[str, Any]) -> None:
        super().__init__(
            "ortflow-check --strict: " + "; ".join(failed) + ". The table and the JSON report say by how much and "
            "where (docs/models.md: ortflow-check)."
        )
        self.report = report


def failures(report: dict[str, Any], accept_unjudgeable: bool = False) -> list[str]:
    """What makes a strict check fail: each row that differs; each row that did not train where eager did (it
    crashed, was refused, ran partly in PyTorch or reached a non-finite loss: an engine that cannot train the model is
    no pass); each row the check cannot judge (eager's own runs too chaotic), unless `accept_unjudgeable`; and each
    precision in which eager did not train (so nothing was compared)."""
    failed = []
    for r in report["rows"]:
        name = f"accel={r['mode']} ({r.get('precision', '?')})"
        verdict = r.get("verdict", "")
        if verdict.startswith("differs") or (verdict.startswith(CANNOT_JUDGE) and not accept_unjudgeable):
            failed.append(f"{name} {verdict}")
        elif not r.get("trains", True) and r.get("precision") in report["envelopes"]:
            failed.append(f"{name} does not train: {not_training_reason(r)}")
    failed += [
        f"eager did not train in {p}: nothing was compared"
        for p in report["precisions"]
        if p not in report["envelopes"]
    ]
    return failed


def not_training_reason(row: dict[str, Any]) -> str:
    """Why a row that ran to its end (or did not) does not count as training the model."""
    if "reason" in row:
        return row["reason"]
    bad = [i for i, loss in enumerate(row.get("losses", []), start=1) if not math.isfinite(loss)]
    if bad:
        return f"a non-finite loss at step {bad[0]} (eager's is finite)"
    return f"its steps were not all executed as the engine promises (executed_by: {row.get('executed_by')})"
