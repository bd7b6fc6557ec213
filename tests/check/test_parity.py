"""ortflow-check's verdict (ortflow/check/parity.py): every parameter's step-1 gradient, the buffers after step 1 and
the loss curve against eager's own noise, measured from one-ulp weights; the check end to end on a small model.

The planted bugs the check must catch, inside what the ORT engines execute: test_planted.py."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from ortflow.check import parity
from ortflow.check.capture import StepOne
from ortflow.check.modes import check
from ortflow.errors import ConfigError
from ortflow.model import one_ulp
from tests.conftest import REPO

DIGITS = ["data=digits", "data.batch_size=32"]
MLP = ["model=custom", "model._target_=tests.helpers.zoo.mlp", *DIGITS]


def test_every_weight_moves_by_exactly_one_ulp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    one_ulp.perturbed(model, seed=0)
    for name, value in model.state_dict().items():
        old = before[name]
        assert not torch.equal(value, old), name
        up, down = torch.nextafter(old, torch.tensor(math.inf)), torch.nextafter(old, torch.tensor(-math.inf))
        assert torch.all((value == up) | (value == down)), name
        assert torch.any(value == up) and torch.any(value == down), name  # both directions drawn


def test_in_bf16_every_weight_moves_by_one_bf16_ulp():
    torch.manual_seed(0)
    model = nn.Linear(50, 40)
    before = model.weight.detach().clone()
    one_ulp.perturbed(model, seed=0, precision=torch.bfloat16)
    rounded = before.to(torch.bfloat16)
    ulp = (torch.nextafter(rounded, torch.tensor(math.inf, dtype=torch.bfloat16)) - rounded).float()
    moved = (model.weight.detach() - before).abs()
    # one bf16 ulp of each weight's magnitude (the next one up or down: equal but at powers of two)
    assert torch.all((moved > 0.49 * ulp) & (moved < 1.01 * ulp))


NAN = float("nan")


def _envelope(losses=(2.0, 1.9, 1.8), band=(1e-7, 1e-6, 1e-5), spread=None, buffers=None, buffer_spread=None):
    gradients = {"big.weight": np.ones((100, 100), np.float32), "small.bias": np.full(4, 0.005, np.float32)}
    return parity.Envelope(
        losses=list(losses),
        band=list(band),
        gradients=gradients,
        gradient_spread=spread or {"big.weight": 1e-7, "small.bias": 2e-7},
        buffers=buffers or {},
        buffer_spread=buffer_spread or {},
        seeds=3,
    )


def _row(envelope, gradients=None, buffers=None, losses=None):
    gradients = {k: v.copy() for k, v in envelope.gradients.items()} if gradients is None else gradients
    step_one = StepOne(gradients, buffers if buffers is not None else dict(envelope.buffers))
    return {"mode": "artifacts", "losses": list(losses or envelope.losses), "step_one": step_one}


def test_a_wrong_gradient_of_a_small_layer_is_caught_where_one_norm_over_all_parameters_hides_it():
    envelope = _envelope()
    row = _row(envelope)
    row["step_one"].gradients["small.bias"] *= 1.5  # 50% wrong: 5e-5 of the whole gradient's norm
    everything = lambda g: np.concatenate([v.ravel() for v in g.values()])  # noqa: E731
    assert parity.relative(everything(row["step_one"].gradients), everything(envelope.gradients)) < 1e-4
    verdict = parity.judge(row, envelope)
    assert verdict.startswith("differs: step-1 gradient of 'small.bias' 5.0e-01 from eager's (tolerance 1.0e-05)")
    assert row["gradients"]["over_tolerance"] == ["small.bias"]


def test_a_gradient_on_one_side_only_differs():
    envelope = _envelope()
    row = _row(envelope)
    del row["step_one"].gradients["small.bias"]
    assert parity.judge(row, envelope).startswith(
        "differs: no step-1 gradient for 'small.bias' in one of them (eager has one, the engine none)"
    )
    row = _row(envelope)
    row["step_one"].gradients["extra"] = np.zeros(3, np.float32)
    assert "'extra' in one of them (the engine has one, eager none)" in parity.judge(row, envelope)


def test_the_sharpest_gradient_of_the_model_sets_every_parameters_tolerance():
    """A ReLU input within rounding of 0 flips under one ulp of the weights in some runs and not in others: the
    gradients it feeds jump (torchvision MNASNet 0.5, one batch: 3 of 20 one-ulp runs moved one bias's gradient by
    3.7e-2, the others by 2e-4, both ORT engines by 3.7e-2). Three runs see such jumps in some parameters, not in
    all: every parameter is held to the model's sharpest."""
    envelope = _envelope(spread={"big.weight": 1e-2, "small.bias": 1e-7})  # big.weight jumped: 0.1 for both
    assert envelope.gradient_tolerance("small.bias") == envelope.gradient_tolerance("big.weight") == pytest.approx(0.1)
    row = _row(envelope)
    row["step_one"].gradients["small.bias"] *= 1.05
    assert parity.judge(row, envelope).startswith(parity.CANNOT_JUDGE)  # no difference seen, but blind below 10%
    row["step_one"].gradients["small.bias"] *= 1.2  # 26% wrong: over 0.1
    assert parity.judge(row, envelope).startswith("differs: step-1 gradient of 'small.bias' 2.6e-01")
    noisy = _envelope(spread={"big.weight": 1e-7, "small.bias": 1.6})  # rounding noise keeps its own tolerance
    assert noisy.gradient_tolerance("big.weight") == parity.GRADIENT_FLOOR
    assert noisy.gradient_tolerance("small.bias") == pytest.approx(16.0)


def test_where_eagers_own_runs_are_too_chaotic_the_verdict_is_cannot_judge_and_strict_fails_unless_accepted():
    """MNASNet 0.5 at 32x32, batch 8: one ulp moved a bias's gradient by 3.7e-2, so the check sees only errors over
    37%; both ORT engines ended 23% and 33% from eager's loss, "within eager's own noise". No difference seen is no
    evidence there: the verdict says so, with the reason and what would make it judgeable."""
    chaotic = _envelope(spread={"big.weight": 3.7e-2, "small.bias": 2e-4})
    verdict = parity.judge(_row(chaotic), chaotic)
    assert verdict.startswith("cannot judge: the smallest step-1 gradient error the check can see is 0.37")
    assert "'big.weight'" in verdict and "a larger batch or input" in verdict
    calm = _envelope(spread={"big.weight": 1e-4, "small.bias": 2e-4})  # sees 0.2%: judged
    assert parity.judge(_row(calm), calm) == "within eager's own noise"
    report = {"rows": [{"mode": "artifacts", "precision": "fp32", "trains": True, "verdict": verdict}]}
    report |= {"precisions": ["fp32"], "envelopes": {"fp32": {}}}
    assert parity.failures(report) == [f"accel=artifacts (fp32) {verdict}"]
    assert parity.failures(report, accept_unjudgeable=True) == []


def test_a_row_that_does_not_train_where_eager_does_fails_strict_naming_why():
    report = {"precisions": ["fp32"], "envelopes": {"fp32": {}}}
    rows = [
        {"mode": "ortmodule", "precision": "fp32", "trains": False, "reason": "ModelError: a hook it cannot run"},
        {"mode": "artifacts", "precision": "fp32", "trains": False, "executed_by": "onnxruntime", "losses": [2.0, NAN]},
        {"mode": "compile", "precision": "fp32", "trains": False, "executed_by": "pytorch", "losses": [2.0, 1.9]},
    ]
    assert parity.failures(report | {"rows": rows}) == [
        "accel=ortmodule (fp32) does not train: ModelError: a hook it cannot run",
        "accel=artifacts (fp32) does not train: a non-finite loss at step 2 (eager's is finite)",
        "accel=compile (fp32) does not train: its steps were not all executed as the engine promises (executed_by: "
        "pytorch)",
    ]
    # where eager did not train either, the row is not the engine's failure: the precision is
    assert parity.failures({"precisions": ["fp32"], "envelopes": {}, "rows": rows}) == [
        "eager did not train in fp32: nothing was compared"
    ]


def test_a_gradient_jump_on_one_batch_differs_whatever_the_next_batch_shows():
    """No second chance: a row whose step-1 gradient is over its tolerance differs, and nothing judges it again from
    another batch (a batch-dependent bug would pass there). Where only step-1 gradients differ (the losses within
    eager's band), the verdict says what else that can be, a ReLU input rounding put across its kink
    (torchvision's LR-ASPP: a BatchNorm output at -3.1e-7 in eager, +6.0e-8 in the artifacts engine)."""
    envelope = _envelope()
    alone = _row(envelope)
    alone["step_one"].gradients["small.bias"][0] *= 1.5  # one element's share jumps, on this batch only
    verdict = parity.judge(alone, envelope)
    assert verdict.startswith("differs: step-1 gradient of 'small.bias' 2.5e-01") and parity.KINK_HINT in verdict
    assert parity.failures({"precisions": ["fp32"], "envelopes": {}, "rows": [alone | {"verdict": verdict}]})
    with_losses = _row(envelope, losses=[2.0, 1.9, 1.8 * (1 + 1e-3)])  # the losses after it moved too
    with_losses["step_one"].gradients["small.bias"][0] *= 1.5
    verdict = parity.judge(with_losses, envelope)
    assert set(with_losses["findings"]) == {"gradient", "loss"} and parity.KINK_HINT not in verdict


def test_a_buffer_or_a_count_after_step_one_is_held_to_eagers():
    buffers = {"bn.running_mean": np.array([0.1, 0.2]), "bn.num_batches_tracked": np.array(1)}
    envelope = _envelope(buffers=buffers, buffer_spread={"bn.running_mean": 3e-8})
    assert parity.judge(_row(envelope), envelope) == "within eager's own noise"
    moved = _row(envelope, buffers={**buffers, "bn.running_mean": np.array([0.1, 0.2002])})
    assert parity.judge(moved, envelope).startswith("differs: 'bn.running_mean' after step 1 8.9e-04 from eager's")
    assert moved["buffers"]["over_tolerance"] == ["bn.running_mean"]
    counted = _row(envelope, buffers={**buffers, "bn.num_batches_tracked": np.array(2)})
    assert parity.judge(counted, envelope).startswith("differs: 'bn.num_batches_tracked' is 2 after step 1")


def test_the_loss_curve_is_held_to_eagers_band_times_a_margin_its_own_step_one_earns():
    """The loss allowance is measured, not fixed: a row whose step-1 gradients are eager's to the last bit may move
    LOSS_SAMPLING x the band (three runs sample it), one whose step 1 moved R times as far as one ulp of the weights
    does R times that, at most LOSS_MARGIN (also a row without step-1 gradients)."""
    envelope = _envelope(band=(1e-7, 1e-7, 1e-5))  # allowed: the floor 1e-5, 1e-5, then margin x 1e-5
    assert envelope.loss_allowed() == pytest.approx([parity.LOSS_FLOOR, parity.LOSS_FLOOR, parity.LOSS_MARGIN * 1e-5])
    losses = [2.0 * (1 + 9e-6), 1.9, 1.8 * (1 + 2.9e-5)]
    assert parity.judge(_row(envelope, losses=losses), envelope) == "within eager's own noise"  # 2.9 x the band
    outside = _row(envelope, losses=[2.0, 1.9, 1.8 * (1 + 9e-5)])  # step 3: 9 x the band, over 3 x
    assert parity.judge(outside, envelope) == (
        "differs: loss at step 3 9.0e-05 from eager's, outside its envelope 3.0e-05 (3 x eager's own 1.0e-05)"
    )
    assert outside["loss_step"] == 3 and outside["loss_margin"] == parity.LOSS_SAMPLING
    moved = _row(envelope, losses=[2.0, 1.9, 1.8 * (1 + 9e-5)])
    # 4e-6 off: 4 x its spread (2e-7, counted as at least GRADIENT_FLOOR / MARGIN = 1e-6); tolerance 1e-5: within
    moved["step_one"].gradients["small.bias"] *= 1 + 4e-6
    assert parity.judge(moved, envelope) == "within eager's own noise"
    assert moved["loss_margin"] == pytest.approx(4 * parity.LOSS_SAMPLING, rel=0.05)  # float32 rounding of 4e-6
    blind = {"mode": "artifacts", "losses": [2.0, 1.9, 1.8 * (1 + 2.9e-4)], "step_one": StepOne(None, {})}
    assert parity.judge(blind, envelope).startswith("within eager's own noise in its losses")
    assert blind["loss_margin"] == parity.LOSS_MARGIN


def test_the_smallest_detectable_error_leaves_out_rounding_noise_parameters_and_names_the_bound():
    envelope = _envelope(spread={"big.weight": 3e-5, "small.bias": 1.6})  # small.bias: a bias before a BatchNorm
    found = envelope.detectable()
    assert found["gradient"] == {
        "error": pytest.approx(3e-4),
        "bounded_by": "big.weight",
        "spread": 3e-5,
        "rounding_noise": ["small.bias"],
        "count": 2,
    }
    row = _row(envelope)
    row["step_one"].gradients["big.weight"] *= 1 + 2 * found["gradient"]["error"]  # twice the stated error
    assert parity.judge(row, envelope).startswith("differs: step-1 gradient of 'big.weight'")


def test_the_first_update_is_held_to_torchs_optimizer_on_the_engines_own_gradients():
    from omegaconf import OmegaConf

    from ortflow.check import update
    from ortflow.config import OptimConfig

    adamw = OmegaConf.structured(OptimConfig(lr=1e-3, weight_decay=0.01))
    sgd = OmegaConf.structured(OptimConfig(name="sgd", lr=0.1, weight_decay=0.0))
    envelope = _envelope()
    row = _row(envelope)
    step_one = row["step_one"]
    g = np.random.default_rng(0)
    step_one.before = {n: 0.05 * g.normal(size=v.shape).astype(np.float32) for n, v in envelope.gradients.items()}
    for optim in (adamw, sgd):
        step_one.after = update.replayed(step_one.before, step_one.gradients, optim, 0.5)  # what torch does
        assert parity.judge(row, envelope, optim, 0.5) == "within eager's own noise" and row["update"]["ulps"] == 0
    wrong = {
        "a learning rate 10% off": (
            adamw,
            update.replayed(step_one.before, step_one.gradients, OmegaConf.merge(adamw, {"lr": 1.1e-3}), 0.5),
        ),
        "the clip ignored": (sgd, update.replayed(step_one.before, step_one.gradients, sgd, None)),
    }
    for what, (optim, after) in wrong.items():
        step_one.after = after
        assert parity.judge(row, envelope, optim, 0.5).startswith("differs: first update of '"), (what, row["update"])


def test_the_band_is_how_far_eagers_runs_went_by_each_step():
    eager = {"losses": [2.0, 2.0, 2.0], "step_one": StepOne({}, {})}
    runs = [{"losses": [2.0, 2.0 * (1 + 3e-6), 2.0], "step_one": StepOne({}, {})}]
    assert parity.Envelope.measure(eager, runs).band == pytest.approx([0.0, 3e-6, 3e-6])


def test_an_engine_without_gradients_is_judged_on_its_losses_and_says_so():
    envelope = _envelope()
    row = _row(envelope)
    row["step_one"] = StepOne(None, {})
    assert parity.judge(row, envelope) == (
        "within eager's own noise in its losses (the engine offers no step-1 gradients to compare)"
    )


def test_check_gives_each_engine_a_verdict_and_states_what_it_can_see(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    report = check(MLP, 3, ["none", "ortmodule", "artifacts"])
    envelope = report["envelopes"]["fp32"]
    assert envelope["seeds"] == len(one_ulp.NOISE_SEEDS) and len(envelope["loss_band"]) == 3
    detectable = envelope["detectable"]["gradient"]
    assert parity.GRADIENT_FLOOR <= detectable["error"] < 1e-4 and detectable["rounding_noise"] == []
    # a parameter's tolerance over the floor names it; at the floor, none does
    assert (detectable["bounded_by"] is None) == (detectable["error"] == parity.GRADIENT_FLOOR)
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["none"]["precision"] == "fp32"
    for mode in ("ortmodule", "artifacts"):
        assert rows[mode]["verdict"] == "within eager's own noise", rows[mode]
        assert rows[mode]["gradients"]["only_eager"] == rows[mode]["gradients"]["only_engine"] == []
        assert rows[mode]["gradients"]["difference"] <= rows[mode]["gradients"]["tolerance"]


def test_gradients_are_compared_before_clipping_in_every_engine(monkeypatch):
    """With a clip far below the gradient norm, eager's and ORTModule's gradients (read after the backward) and the
    artifacts engine's (read before its optimizer graph clips) are the same unclipped gradients."""
    monkeypatch.syspath_prepend(str(REPO))
    from ortflow.check.modes import fresh_model, try_mode

    clipped = [*MLP, "trainer.grad_clip=0.001"]
    rows = {m: try_mode(m, clipped, 2, fresh_model) for m in ("none", "ortmodule", "artifacts")}
    unclipped = try_mode("none", MLP, 2, fresh_model)["step_one"].gradients
    norm = math.sqrt(sum(float(np.square(g.astype(np.float64)).sum()) for g in unclipped.values()))
    assert norm > 100 * 0.001  # the clip scales the gradients by 1e-2 or less
    for mode, row in rows.items():
        got = row["step_one"].gradients
        assert got.keys() == unclipped.keys(), mode
        assert all(parity.relative(got[n], unclipped[n]) < 1e-5 for n in got), mode


def test_an_overridden_precision_is_the_one_checked_in(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    report = check(["+recipe=digits", "data.batch_size=32", "trainer.precision=bf16-mixed"], 3, ["none", "artifacts"])
    assert report["precisions"] == ["bf16-mixed"] and set(report["envelopes"]) == {"bf16-mixed"}
    rows = {r["mode"]: r for r in report["rows"]}
    assert {r["precision"] for r in rows.values()} == {"bf16-mixed"}
    assert rows["artifacts"]["graph_fixes"]["matmuls_run_by_torch_bf16"] >= 1  # the engine ran in bf16
    assert rows["artifacts"]["verdict"] == "within eager's own noise", rows["artifacts"]


@pytest.mark.parametrize(
    ("overrides", "precisions", "says"),
    [
        (["trainer.precision=bf16-mixed"], ("fp32",), "trainer.precision=bf16-mixed is overridden, and --precision"),
        (["trainer.precision=auto"], None, "trainer.precision=auto: ortflow-check compares"),
        (["distributed=ddp"], None, "distributed=ddp: ortflow-check compares the engines in one process"),
    ],
)
def test_a_setting_the_check_cannot_honour_is_refused(overrides, precisions, says, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(ConfigError, match=says):
        check([*MLP, *overrides], 2, ["none"], precisions)


def test_stochastic_depth_is_switched_off_with_dropout():
    ops = pytest.importorskip("torchvision.ops")
    from ortflow.check.modes import without_dropout

    model = without_dropout(nn.Sequential(ops.StochasticDepth(0.2, "row"), nn.Dropout(0.1)))
    assert model[0].p == 0.0 and model[1].p == 0.0


def _measured(eager: dict, runs: list[dict], precision: str = "fp32", fp32: dict | None = None) -> parity.Envelope:
    """An envelope measured from step-1 gradients: eager's, its one-ulp runs' (and eager fp32's for bf16-mixed)."""
    row = lambda g: {"losses": [2.0, 1.9], "step_one": StepOne(g, {})}  # noqa: E731
    return parity.Envelope.measure(row(eager), [row(g) for g in runs], precision, fp32)


def test_a_gradient_that_is_rounding_noise_is_judged_against_the_gradients_beside_it():
    """A conv bias before a BatchNorm: its gradient is 0 in exact arithmetic, 1e-9 of rounding noise in eager, and
    one ulp of the weights moves it by 100% of itself. Another engine's summation order gives other noise (20 times
    as far from eager's, against that noise's own size): measured against the conv weight's gradient beside it, both
    are nothing, and the row is within, where the check used to say it "differs"."""
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(8, 9)).astype(np.float32)
    noise = lambda: rng.normal(scale=1e-9, size=8).astype(np.float32)  # noqa: E731
    eager = {"conv.weight": weight, "conv.bias": noise()}
    runs = [{"conv.weight": weight * (1 + 1e-7), "conv.bias": noise()} for _ in range(3)]
    envelope = _measured(eager, runs)
    assert parity.relative(runs[0]["conv.bias"], eager["conv.bias"]) > parity.NOISY  # noise, by its own size
    assert envelope.noisy == {"conv.bias"}
    engine = {"conv.weight": weight.copy(), "conv.bias": eager["conv.bias"] + 20 * noise()}
    assert parity.relative(engine["conv.bias"], eager["conv.bias"]) > parity.MARGIN * max(
        parity.relative(r["conv.bias"], eager["conv.bias"]) for r in runs
    )  # the old measure: over its tolerance
    row = {"mode": "compile", "losses": [2.0, 1.9], "step_one": StepOne(engine, {})}
    assert parity.judge(row, envelope) == "within eager's own noise", row["gradients"]
    wrong = {"conv.weight": weight * 1.02, "conv.bias": engine["conv.bias"]}  # the weight 2% off: still seen
    row = {"mode": "compile", "losses": [2.0, 1.9], "step_one": StepOne(wrong, {})}
    assert parity.judge(row, envelope).startswith("differs: step-1 gradient of 'conv.weight'")


def test_where_one_ulp_scrambles_every_gradient_the_verdict_is_cannot_judge_not_within():
    """Every parameter's gradient moved by more than NOISY under one ulp (a chaotic model): the check determines
    nothing, so nothing it shows is evidence. It used to find no "sharpest" parameter, report no bound, and call
    such a row "within eager's own noise"."""
    rng = np.random.default_rng(1)
    scrambled = lambda: {"a.weight": rng.normal(size=(4, 4)), "b.bias": rng.normal(size=4)}  # noqa: E731
    envelope = _measured(scrambled(), [scrambled() for _ in range(3)])
    assert envelope.noisy == {"a.weight", "b.bias"}
    row = {"mode": "artifacts", "losses": [2.0, 1.9], "step_one": StepOne(dict(envelope.gradients), {})}
    verdict = parity.judge(row, envelope)
    assert verdict.startswith("cannot judge: the smallest step-1 gradient error the check can see is"), verdict
    assert envelope.detectable()["gradient"]["error"] > parity.JUDGEABLE["fp32"]


def test_bf16_rows_are_held_to_eager_fp32_with_eager_bf16s_distance_as_the_band():
    """bf16-mixed: eager bf16's step-1 gradients are 0.5% from eager fp32's; an engine at the same distance (its
    own bf16 rounding) is within, one whose gradient of a layer is 10% off differs. Held to eager bf16 with 10 x one
    bf16 ulp's spread instead, a 10% error went unseen (JUDGEABLE in bf16 was 100%)."""
    rng = np.random.default_rng(2)
    fp32 = {"a.weight": rng.normal(size=(16, 16)), "a.bias": rng.normal(size=16)}
    rounded = lambda: {n: g * (1 + rng.normal(scale=0.005, size=g.shape)) for n, g in fp32.items()}  # noqa: E731
    envelope = _measured(rounded(), [rounded() for _ in range(3)], "bf16-mixed", fp32)
    assert envelope.gradients is fp32 and envelope.margin == parity.BF16_MARGIN
    assert envelope.detectable()["gradient"]["error"] <= parity.JUDGEABLE["bf16-mixed"]
    engine = rounded()
    row = {"mode": "ortmodule", "losses": [2.0, 1.9], "step_one": StepOne(engine, {})}
    assert parity.judge(row, envelope) == "within eager's own noise", row["gradients"]
    engine["a.bias"] = engine["a.bias"] * 1.1
    row = {"mode": "ortmodule", "losses": [2.0, 1.9], "step_one": StepOne(engine, {})}
    assert parity.judge(row, envelope).startswith("differs: step-1 gradient of 'a.bias'")
