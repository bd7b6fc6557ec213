"""Batch statistics: the model contract recognises BatchNorm as a known dependence on the batch (and still refuses a
model that mixes samples otherwise), and the short-batch policy keeps padded rows away from such models, in every
accel mode, saying in run.json what it left out."""

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ortflow
from ortflow.data import Data
from ortflow.data.short_batches import FullBatches
from ortflow.errors import DataError, ModelError
from ortflow.model.contract import check_model
from ortflow.model.resnet import build_resnet
from ortflow.step.loss import CrossEntropy
from tests.helpers.user_model import NaNAtStep


def _check(model: nn.Module, x: torch.Tensor, classes: int = 10):
    return check_model(model, x, torch.randint(0, classes, (x.size(0),)), CrossEntropy(), "test")


# ------------------------------------------------------------------------------------------ the contract's facts
def test_a_resnet_depends_on_its_batch_in_training_through_each_batchnorm_and_not_in_eval():
    model = build_resnet(10, width=4)
    facts = _check(model, torch.randn(4, 3, 16, 16))
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert facts.in_training and not facts.in_eval
    assert list(facts.training) == norms and facts.record()["layers"] == len(norms)


def test_batchnorm_without_running_statistics_depends_on_the_batch_in_eval_too():
    model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6, track_running_stats=False), nn.Linear(6, 3))
    facts = _check(model, torch.randn(5, 8), classes=3)
    assert facts.in_training and facts.in_eval and facts.eval == ("1",)


@pytest.mark.parametrize(
    ("norm", "in_training"),
    [
        (nn.InstanceNorm1d(6, track_running_stats=True), True),  # its running statistics average over the batch
        (nn.InstanceNorm1d(6), False),
        (nn.GroupNorm(2, 6), False),
        (nn.LayerNorm([6, 4]), False),
    ],
)
def test_per_sample_norms_are_independent_and_instance_norm_statistics_are_not(norm, in_training):
    model = nn.Sequential(nn.Conv1d(2, 6, 1), norm, nn.Flatten(), nn.Linear(24, 3))
    facts = _check(model, torch.randn(5, 2, 4), classes=3)
    assert facts.in_training == in_training and not facts.in_eval


def test_the_probes_leave_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 3)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _check(model, torch.randn(5, 8), classes=3)
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    unbuffered = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6, track_running_stats=False), nn.Linear(6, 3))
    _check(unbuffered, torch.randn(5, 8), classes=3)
    assert unbuffered[1].running_mean is None and unbuffered[1].running_var is None  # fixed statistics undone


def test_the_check_runs_no_training_forward():
    """A training forward has effects no probe can undo in a user's model (here a call counter that decides which
    step's loss turns NaN): training-mode dependence is read from the layers' types."""
    model = NaNAtStep(256, 8, nan_steps=[1])
    tokens = torch.randint(0, 256, (4, 6))
    check_model(model, tokens, tokens, CrossEntropy(), "counter")
    assert model.calls == 0 and model.training


class SequenceFirstWithBatchNorm(nn.Module):
    """Attention over dim 0 (sequence-first) fed (B, T) tokens, then BatchNorm without running statistics."""

    def __init__(self, mix: bool = True) -> None:
        super().__init__()
        self.mix = mix
        self.embedding = nn.Embedding(256, 16)
        self.attention = nn.MultiheadAttention(16, 2)  # batch_first=False: dim 0 is the sequence
        self.norm = nn.BatchNorm1d(16, track_running_stats=False)
        self.head = nn.Linear(16, 256)

    def forward(self, tokens):
        x = self.embedding(tokens)  # (B, T, 16)
        if self.mix:
            x = self.attention(x, x, x, need_weights=False)[0]  # attends across the batch
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x)  # (B, T, 256)


def test_a_model_that_mixes_samples_is_still_refused_with_the_sequence_first_hint_beside_batchnorm():
    tokens = torch.randint(0, 256, (4, 6))
    facts = check_model(SequenceFirstWithBatchNorm(mix=False), tokens, tokens, CrossEntropy(), "bn")
    assert facts.in_eval
    with pytest.raises(ModelError, match=r"mixes samples across the batch dimension.*data\.batch_first=false"):
        check_model(SequenceFirstWithBatchNorm(), tokens, tokens, CrossEntropy(), "mixing")


# ---------------------------------------------------------------------------------------------- FullBatches
def _loader(sizes: list[int]) -> DataLoader:
    n = sum(sizes)
    dataset = TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.zeros(n, dtype=torch.long))
    return DataLoader(dataset, batch_size=sizes[0], shuffle=False)


def test_full_batches_skips_and_counts_short_batches_only_when_asked():
    skipping, keeping = (
        FullBatches(_loader([8, 8, 4]), 8, True, "training"),
        FullBatches(_loader([8, 8, 4]), 8, False, "x"),
    )
    assert [len(y) for _, y in skipping] == [8, 8] and (skipping.short, skipping.short_samples) == (1, 4)
    assert [len(y) for _, y in keeping] == [8, 8, 4] and keeping.short == 1
    assert skipping.batch_size == 8 and len(skipping.dataset) == 20  # the loader's own attributes


def test_a_loader_with_only_short_batches_is_a_data_error_for_a_batch_dependent_model():
    with pytest.raises(DataError, match=r"no batch of the training batch size 8"):
        list(FullBatches(_loader([5]), 8, True, "validation"))


# ------------------------------------------------------------------------------ the policy in whole runs
TRAIN, VAL, BATCH, STEPS, EVERY = 36, 20, 8, 12, 4  # 4 full training batches + 4 samples; val: 8, 8 and 4


def short_batch_digits(full_only: bool = False) -> Data:
    """Digits with a short last batch in both loaders (a user's loaders without drop_last), or, with full_only, the
    same batches without the short ones (the reference)."""
    digits = load_digits()
    x = torch.tensor(digits.data[: TRAIN + VAL] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[: TRAIN + VAL], dtype=torch.long)
    val_end = TRAIN + (VAL // BATCH) * BATCH if full_only else TRAIN + VAL
    generator = torch.Generator().manual_seed(0)
    train = DataLoader(
        TensorDataset(x[:TRAIN], y[:TRAIN]), BATCH, shuffle=True, drop_last=full_only, generator=generator
    )
    val = DataLoader(TensorDataset(x[TRAIN:val_end], y[TRAIN:val_end]), BATCH, shuffle=False)
    return Data(train, val, {"source": "digits with short batches"})


def bn_mlp(track_running_stats: bool = True) -> nn.Module:
    # No bias before BatchNorm (as is usual): its gradient is zero up to rounding, which AdamW turns into lr-sized
    # steps of random sign, so that bias and the running mean tracking it would differ between engines by noise.
    return nn.Sequential(
        nn.Linear(64, 16, bias=False),
        nn.BatchNorm1d(16, track_running_stats=track_running_stats),
        nn.ReLU(),
        nn.Linear(16, 10),
    )


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


def _run(tmp_path, name: str, model: str, *extra: str, accel: str = "none", full_only: bool = False):
    overrides = [
        "model=custom",
        f"model._target_=tests.model.test_batch_dependence.{model}",
        "data=custom",
        "data._target_=tests.model.test_batch_dependence.short_batch_digits",
        f"+data.full_only={str(full_only).lower()}",
        f"accel={accel}",
        f"trainer.max_steps={STEPS}",
        f"trainer.eval_every={EVERY}",
        "trainer.log_every=1",
        "trainer.checkpoint.every=0",
        "logger.progress=false",
        "logger.tensorboard=false",
        *extra,
    ]
    return ortflow.train(overrides, run_dir=tmp_path / name)


EPOCH_ENDS = (STEPS - 1) // (TRAIN // BATCH)  # short training batches met: one at each epoch's end passed
EVALS = STEPS // EVERY


def test_short_batches_are_left_out_for_batchnorm_without_running_stats_exactly_as_if_never_there(tmp_path):
    model = ["+model.track_running_stats=false"]
    got = _run(tmp_path, "short", "bn_mlp", *model)
    reference = _run(tmp_path, "full", "bn_mlp", *model, full_only=True)
    for key in ("train/loss", "eval/loss", "eval/accuracy"):
        assert got.metrics[key] == reference.metrics[key], key
    record = got.record["data"]["short_batches"]
    assert record["model_depends_on_batch"]["in_eval"] is True
    assert record["train"] == {"policy": "skipped", "short_batches": EPOCH_ENDS, "samples": EPOCH_ENDS * 4}
    assert record["eval"] == {"policy": "dropped", "short_batches": EVALS, "samples": EVALS * 4}


def test_short_eval_batches_are_kept_for_batchnorm_with_running_stats(tmp_path):
    record = _run(tmp_path, "run", "bn_mlp").record["data"]["short_batches"]
    assert record["train"]["policy"] == "skipped" and record["train"]["short_batches"] == EPOCH_ENDS
    assert record["eval"] == {"policy": "kept", "short_batches": EVALS, "samples": EVALS * 4}


def test_a_batch_independent_model_trains_and_evaluates_on_short_batches(tmp_path):
    result = _run(tmp_path, "run", "mlp")
    record = result.record["data"]["short_batches"]
    assert record["model_depends_on_batch"] == {
        "in_training": False,
        "in_eval": False,
        "layers": 0,
        "first_layers": [],
    }
    assert record["train"] == {"policy": "kept", "short_batches": EPOCH_ENDS, "samples": EPOCH_ENDS * 4}
    assert record["eval"]["policy"] == "kept"


def _ort_matches_eager(tmp_path, accel: str, *model: str) -> None:
    eager = _run(tmp_path, "eager", "bn_mlp", *model)
    ort = _run(tmp_path, accel, "bn_mlp", *model, accel=accel)
    engine = ort.record["engine"]
    assert engine["executed_by"] == "onnxruntime" and engine["ort_train_steps"] == STEPS
    assert engine.get("torch_fallback_train_steps", 0) == 0
    in_eval = ort.record["data"]["short_batches"]["model_depends_on_batch"]["in_eval"]
    assert engine["ort_eval_batches"] == EVALS * (VAL // BATCH + (0 if in_eval else 1))  # no short one if in_eval
    for key in ("train/loss", "eval/loss", "eval/accuracy"):
        assert ort.metrics[key] == pytest.approx(eager.metrics[key], rel=1e-4), key
    assert ort.record["data"]["short_batches"] == eager.record["data"]["short_batches"]


@pytest.mark.slow
@pytest.mark.parametrize("accel", ["ortmodule", "artifacts"])
def test_ort_engines_never_get_a_padded_batch_for_batchnorm_without_running_stats(tmp_path, accel):
    """A padded eval batch would mix zeros into the batch statistics (the engines refuse to pad one); the ORT
    counters show the short eval batches never reached ORT, and the results are eager's."""
    _ort_matches_eager(tmp_path, accel, "+model.track_running_stats=false")


@pytest.mark.slow
@pytest.mark.parametrize("accel", ["ortmodule", "artifacts"])
def test_ort_engines_skip_short_training_batches_for_batchnorm_with_running_stats(tmp_path, accel):
    _ort_matches_eager(tmp_path, accel)
