"""Vision models in both ORT engines: convolutions, BatchNorm's running statistics kept exactly as eager PyTorch keeps
them (training, accumulation, eval, checkpoint/resume, export), GroupNorm/InstanceNorm, each proven executed by ORT's
own run counters (describe()).

Models and data are small and made here: random 3x16x16 images (and 1-D signals), batch 8, 5 classes.
"""

import copy
import io
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from ortflow import accel
from ortflow.accel.engine import EngineContext
from ortflow.config import DebugConfig, OptimConfig
from ortflow.errors import ModelError
from tests.conftest import make_cfg

STEPS = 4
BATCH = 8
CLASSES = 5
# Loss parity against eager on the first steps (dropout off). Measured: ORTModule <= 3e-7, artifacts <= 2e-6 (ORT's
# own AdamW graph); the bounds leave ample headroom and still fail on a wrong statistic or a missed update.
RTOL = {"ortmodule": 1e-5, "artifacts": 1e-4}
STATS_ATOL = 1e-4  # running statistics after STEPS steps (measured <= 3e-7)

optim = OmegaConf.structured(OptimConfig)


def make_engine(kind: str, model: nn.Module, example, tmp: Path, accumulate: int = 1, **settings):
    """An engine as the runner builds it: from conf/accel/<kind>.yaml and an EngineContext."""
    cfg = make_cfg(f"accel={kind}", *(f"accel.{key}={value}" for key, value in settings.items()))
    ctx = EngineContext(
        model, example, optim, debug=OmegaConf.structured(DebugConfig), onnx_dir=tmp / kind, accumulate=accumulate
    )
    return accel.build(cfg.accel, ctx)


def images(steps: int = STEPS, seed: int = 0, shape=(3, 16, 16)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, *shape, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
        for _ in range(steps)
    ]


def conv_bn(momentum: float | None = 0.1, track: bool = True) -> nn.Module:
    """Conv -> BatchNorm2d -> ReLU twice, pooled, then Linear -> BatchNorm1d (a 2-D input) -> Linear.

    The layers before a BatchNorm have no bias, as usual: a bias there gets gradients that are only rounding noise,
    which AdamW turns into steps of size lr in directions that differ between runtimes (and the running mean with
    them), while the loss does not depend on it."""
    torch.manual_seed(0)

    def bn2d(c: int) -> nn.BatchNorm2d:
        return nn.BatchNorm2d(c, momentum=momentum, track_running_stats=track)

    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        bn2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False),
        bn2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 16, bias=False),
        nn.BatchNorm1d(16, momentum=momentum, track_running_stats=track),
        nn.ReLU(),
        nn.Linear(16, CLASSES),
    )


def buffers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "running_" in k or "num_batches_tracked" in k}


def train_both(kind: str, build, batches, tmp: Path, accumulate: int = 1, **settings):
    """The same model trained by eager PyTorch and by `kind` on the same batches: (eager, engine, eager losses,
    engine losses)."""
    torch.manual_seed(0)
    model = build()
    eager = make_engine("none", copy.deepcopy(model), batches[0], tmp, accumulate)
    engine = make_engine(kind, model, batches[0], tmp, accumulate, **settings)
    if accumulate == 1:
        expected = [eager.train_step(x, y) for x, y in batches]
        got = [engine.train_step(x, y) for x, y in batches]
    else:
        groups = [batches[i : i + accumulate] for i in range(0, len(batches), accumulate)]
        expected = [eager.train_micro(g) for g in groups]
        got = [engine.train_micro(g) for g in groups]
    return eager, engine, expected, got


def assert_ort_trained(engine, steps: int) -> None:
    info = engine.describe()
    assert info["executed_by"] == "onnxruntime" and info["ort_train_steps"] == steps, info
    if engine.name == "ortmodule":
        forward, backward, _ = engine.runs.snapshot()
        assert forward >= steps and backward >= steps


def assert_same_statistics(eager, engine) -> None:
    want, got = buffers(eager.model_state_dict()), buffers(engine.model_state_dict())
    assert want and want.keys() == got.keys()
    for name, value in want.items():
        if name.endswith("num_batches_tracked"):
            assert torch.equal(got[name], value), name
        else:
            torch.testing.assert_close(got[name], value, rtol=0, atol=STATS_ATOL, msg=name)


# ------------------------------------------------------------------------------------------------ BatchNorm
class CountsCopies(nn.Module):
    """conv_bn, counting its deep copies."""

    copies = 0

    def __init__(self) -> None:
        super().__init__()
        self.inner = conv_bn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def __deepcopy__(self, memo):
        type(self).copies += 1
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone


def test_ortmodule_exports_without_a_copy_of_the_model_and_keeps_eagers_statistics(tmp_path):
    """ORTModule runs a forward before each export (training and eval) to learn its outputs; it ran it on a deep copy
    of the whole model, held beside the training session. It runs on the model itself now, its BatchNorm statistics
    put back: they end as eager's, updated once per step."""
    batches = images(2)
    torch.manual_seed(0)
    model = CountsCopies()
    eager = make_engine("none", copy.deepcopy(model), batches[0], tmp_path)
    engine = make_engine("ortmodule", model, batches[0], tmp_path)
    copies = CountsCopies.copies  # the test's own copy for eager, and whatever the engine's build made
    expected = [eager.train_step(x, y) for x, y in batches]
    got = [engine.train_step(x, y) for x, y in batches]  # the training graph's export
    x, y = images(1, seed=1)[0]
    want, have = eager.eval_step(x, y), engine.eval_step(x, y)  # the eval graph's
    assert_ort_trained(engine, 2)
    assert engine.describe()["ort_eval_batches"] == 1
    assert CountsCopies.copies == copies
    assert have.loss_sum == pytest.approx(want.loss_sum, rel=1e-4)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL["ortmodule"], atol=0)
    assert_same_statistics(eager, engine)
    assert int(engine.model_state_dict()["inner.1.num_batches_tracked"]) == 2


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_batchnorm_trains_and_keeps_eagers_running_statistics(kind, momentum, tmp_path):
    batches = images()
    eager, engine, expected, got = train_both(kind, lambda: conv_bn(momentum), batches, tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert got != expected  # identical bits would mean PyTorch ran it
    assert_ort_trained(engine, STEPS)
    info = engine.describe()
    assert info["batchnorm_layers"] == 3 and info["batchnorm_updates"] == STEPS
    assert info["graph_fixes"]["batchnorm_batch_statistics_in_place"] == 3
    assert_same_statistics(eager, engine)
    assert int(engine.model_state_dict()["1.num_batches_tracked"]) == STEPS
    # Evaluation uses the running statistics: eager's outputs, from ORT's eval graph.
    x, y = images(1, seed=1)[0]
    want, have = eager.eval_step(x, y), engine.eval_step(x, y)
    assert have.loss_sum == pytest.approx(want.loss_sum, rel=1e-4)
    assert engine.describe()["ort_eval_batches"] == 1


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_batchnorm_without_running_statistics_trains_and_evaluates_with_batch_statistics(kind, tmp_path):
    batches = images()
    eager, engine, expected, got = train_both(kind, lambda: conv_bn(track=False), batches, tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert_ort_trained(engine, STEPS)
    assert "batchnorm_updates" not in engine.describe()  # nothing to keep
    x, y = images(1, seed=1)[0]
    assert engine.eval_step(x, y).loss_sum == pytest.approx(eager.eval_step(x, y).loss_sum, rel=1e-4)
    # The batch's statistics in evaluation too: a short batch would be padded, and is refused instead.
    with pytest.raises(ModelError, match="evaluation batch of 5 samples"):
        engine.eval_step(x[:5], y[:5])


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_accumulated_micro_batches_each_update_the_statistics(kind, tmp_path):
    batches = images(4)
    eager, engine, expected, got = train_both(kind, conv_bn, batches, tmp_path, accumulate=2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert engine.describe()["batchnorm_updates"] == 4  # one per micro-batch forward, as eager
    assert_same_statistics(eager, engine)
    assert int(engine.model_state_dict()["1.num_batches_tracked"]) == 4


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_a_short_training_batch_is_refused_for_batchnorm(kind, tmp_path):
    x, y = images(1)[0]
    engine = make_engine(kind, conv_bn(), (x, y), tmp_path)
    with pytest.raises(ModelError, match="training batch of 5 samples"):
        engine.train_step(x[:5], y[:5])


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_running_statistics_survive_save_and_restore(kind, tmp_path):
    """What a checkpoint holds (model_state_dict, optimizer_state) rebuilt into a new engine around a model that
    loaded those weights continues exactly as the engine that wrote it."""
    batches = images(6)
    model = conv_bn()
    first = make_engine(kind, model, batches[0], tmp_path / "a")
    for x, y in batches[:3]:
        first.train_step(x, y)
    saved = io.BytesIO()  # as a checkpoint file holds them (torch.optim's state would share tensors otherwise)
    torch.save({"model": first.model_state_dict(), "optimizer": first.optimizer_state()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    weights, optimizer = checkpoint["model"], checkpoint["optimizer"]
    restored = conv_bn()
    restored.load_state_dict(weights)
    second = make_engine(kind, restored, batches[0], tmp_path / "b")
    assert second.load_optimizer_state(optimizer)
    for name, value in buffers(second.model_state_dict()).items():  # the build (an export) left them alone
        assert torch.equal(value, weights[name]), name
    continued = [second.train_step(x, y) for x, y in batches[3:]]
    uninterrupted = [first.train_step(x, y) for x, y in batches[3:]]
    torch.testing.assert_close(torch.tensor(continued), torch.tensor(uninterrupted), rtol=1e-6, atol=0)
    a, b = first.model_state_dict(), second.model_state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7, msg=name)
    x, y = images(1, seed=1)[0]
    assert second.eval_step(x, y).loss_sum == pytest.approx(first.eval_step(x, y).loss_sum, rel=1e-6)


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_the_exported_inference_model_uses_the_running_statistics(kind, tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from ortflow.data import Data
    from ortflow.run.export import inference_onnx

    batches = images()
    eager, engine, _, _ = train_both(kind, conv_bn, batches, tmp_path)
    val = images(1, seed=1)[0]
    data = Data(DataLoader(TensorDataset(*batches[0]), BATCH), DataLoader(TensorDataset(*val), BATCH), {})
    model = conv_bn()
    record = inference_onnx(model, engine.model_state_dict(), data, tmp_path, 17)
    assert record["max_abs_diff"] < 1e-5  # ONNX Runtime's inference against torch with the same weights
    import onnxruntime

    session = onnxruntime.InferenceSession(record["file"], providers=["CPUExecutionProvider"])
    (got,) = session.run(["output"], {"input": val[0].numpy()})
    eager.model.eval()
    with torch.no_grad():
        expected = eager.model(val[0])  # eager's own running statistics
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-4, atol=1e-4)


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, CLASSES))

    def forward(self, x):
        return self.head(self.bn(self.conv(self.bn(x))))


class OwnForward(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
@pytest.mark.parametrize(
    ("layer", "says"),
    [
        (lambda: nn.SyncBatchNorm(3), "averages the batch statistics across processes"),
        (lambda: OwnForward(3), "forward of its own"),
        (lambda: nn.InstanceNorm2d(3, track_running_stats=True), "keeps no running statistics"),
        (None, "runs it more than once"),
    ],
    ids=["sync", "own_forward", "instance_norm_tracking", "called_twice"],
)
def test_normalisation_it_cannot_keep_exactly_is_refused_with_the_reason(kind, layer, says, tmp_path):
    model = Shared() if layer is None else nn.Sequential(layer(), nn.Flatten(), nn.Linear(3 * 16 * 16, CLASSES))
    with pytest.raises(ModelError, match=says) as refused:
        make_engine(kind, model, images(1)[0], tmp_path)
    assert "sequence-first" not in str(refused.value)


# ------------------------------------------------------------------------------------------------ GroupNorm & co.
def norms_model() -> nn.Module:
    """GroupNorm, InstanceNorm (affine and not) and a LayerNorm over (C, H, W)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(4, 8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.InstanceNorm2d(8, affine=True),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3, stride=2, padding=1),
        nn.InstanceNorm2d(4),
        nn.LayerNorm([4, 8, 8]),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, CLASSES),
    )


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_group_instance_and_layer_norm_train_with_parity(kind, tmp_path):
    batches = images()
    eager, engine, expected, got = train_both(kind, norms_model, batches, tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert_ort_trained(engine, STEPS)
    if kind == "artifacts":  # GroupNorm's and both InstanceNorms' InstanceNormalization, written out
        assert engine.describe()["graph_fixes"]["instance_norm_decomposed"] == 3
    x, y = images(1, seed=1)[0]
    assert engine.eval_step(x, y).loss_sum == pytest.approx(eager.eval_step(x, y).loss_sum, rel=1e-4)


# ------------------------------------------------------------------------------------------------ convolutions
class ConvFamilies(nn.Module):
    """Conv1d, Conv2d, ConvTranspose2d and a depthwise Conv2d (groups = channels) on 3x16x16 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.conv1d = nn.Conv1d(4, 4, 5, padding=2)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        x = torch.relu(self.depthwise(torch.relu(self.conv(x))))
        x = self.up(x)  # (B, 4, 32, 32)
        x = self.conv1d(x.flatten(2))  # (B, 4, 1024)
        return self.head(x.mean(-1))


class PatchEmbedding(nn.Module):
    """A ViT-style classifier: a strided Conv2d cuts 4x4 patches, a transformer layer, mean pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, 16, 4, stride=4)
        self.position = nn.Parameter(torch.zeros(16, 16))
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x):
        tokens = self.patches(x).flatten(2).transpose(1, 2) + self.position  # (B, 16 patches, 16)
        return self.head(self.encoder(tokens).mean(1))


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
@pytest.mark.parametrize("family", [ConvFamilies, PatchEmbedding], ids=["conv_families", "patch_embedding"])
def test_convolution_families_train_in_ort_with_parity(kind, family, tmp_path):
    def build():
        torch.manual_seed(0)
        return family()

    _, engine, expected, got = train_both(kind, build, images(), tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert got != expected
    assert_ort_trained(engine, STEPS)


def vgg() -> nn.Module:
    """A small VGG-style CNN (3x3 convolutions, ReLU, max-pooling), the shape the ATen path was measured on."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, CLASSES),
    )


@pytest.mark.parametrize("build", [vgg, conv_bn, lambda: ConvFamilies()], ids=["vgg", "conv_bn", "conv_families"])
def test_aten_convolutions_give_eagers_loss_and_gradients_in_artifacts(build, tmp_path):
    """accel.aten_conv: every convolution an ATen node run by torch's kernels; the loss and every gradient are
    eager PyTorch's (closer than ORT's own Conv, which sums in another order), and those of the native path."""
    from ortflow.step.batch import Layout
    from ortflow.step.loss import CrossEntropy
    from ortflow.step.with_loss import WithLoss

    x, y = images(1)[0]
    torch.manual_seed(0)
    model = build()
    reference = WithLoss(copy.deepcopy(model), CrossEntropy(), Layout(1, single=True)).train()
    aten = make_engine("artifacts", copy.deepcopy(model), (x, y), tmp_path / "aten", aten_conv=True)
    convolutions = sum(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    assert aten.describe()["graph_fixes"]["convolutions_run_by_torch"] == convolutions
    loss, grads = aten.gradients(x, y)
    expected = reference(x, y)
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-6)
    for name, p in reference.model.named_parameters():
        torch.testing.assert_close(torch.from_numpy(grads[name]), p.grad, rtol=1e-4, atol=1e-6, msg=name)
    if build is not vgg:
        return
    native = make_engine("artifacts", copy.deepcopy(model), (x, y), tmp_path / "native", aten_conv=False)
    assert "convolutions_run_by_torch" not in native.describe()["graph_fixes"]
    native_loss, native_grads = native.gradients(x, y)
    assert native_loss == pytest.approx(loss, rel=1e-5)
    for name, grad in native_grads.items():
        torch.testing.assert_close(torch.from_numpy(grads[name]), torch.from_numpy(grad), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("build", [vgg, conv_bn], ids=["vgg", "conv_bn"])
def test_aten_convolutions_train_in_ortmodule_with_parity(build, tmp_path):
    batches = images()
    eager, engine, expected, got = train_both("ortmodule", build, batches, tmp_path, aten_conv=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL["ortmodule"], atol=0)
    assert_ort_trained(engine, STEPS)
    convolutions = sum(isinstance(m, nn.modules.conv._ConvNd) for m in eager.model.modules())
    assert engine.describe()["graph_fixes"]["convolutions_run_by_torch"] == convolutions
    if build is conv_bn:
        assert_same_statistics(eager, engine)
    _, native, _, native_losses = train_both("ortmodule", build, batches, tmp_path / "native", aten_conv=False)
    assert "convolutions_run_by_torch" not in native.describe()["graph_fixes"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(native_losses), rtol=RTOL["ortmodule"], atol=0)


def frozen_backbone() -> nn.Module:
    """Transfer learning's shape: convolutions frozen, a new head trained."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, CLASSES),
    )
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    return model


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_frozen_aten_convolutions_train_the_rest_with_parity(kind, tmp_path):
    """Frozen ATen convolutions compute no weight gradient: their masks agree with the gradient graph, which has none
    for frozen weights in either engine (a mismatch once failed with 'Only tensor type OrtValues are supported')."""
    batches = images()
    _, engine, expected, got = train_both(kind, frozen_backbone, batches, tmp_path, aten_conv=True)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert_ort_trained(engine, STEPS)
    assert engine.describe()["graph_fixes"]["convolutions_run_by_torch"] == 2
    state, start = engine.model_state_dict(), frozen_backbone().state_dict()
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert torch.equal(state[name], start[name]), name
    assert not torch.equal(state["6.weight"], start["6.weight"])


class ConvBnDropout(nn.Module):
    """BatchNorm after a dropout: the statistics are those of the dropped activations, so the engine's masks must be
    the ones its statistics saw. padding="same" convolutions (aten::_convolution_mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding="same", bias=False)
        self.drop = nn.Dropout(0.25)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES))

    def forward(self, x):
        return self.head(self.bn(self.drop(self.conv(x))))


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_batchnorm_statistics_see_the_fed_dropout_masks(kind, tmp_path):
    """With rewrite_dropout the engine draws the masks (seeded from torch's RNG); eager PyTorch fed the same masks
    gives the engine's loss and running statistics."""
    from ortflow.accel.graph import fed_dropout
    from ortflow.accel.graph.masks import draw_masks
    from ortflow.step.batch import Layout
    from ortflow.step.loss import CrossEntropy
    from ortflow.step.with_loss import WithLoss

    torch.manual_seed(0)
    model = ConvBnDropout()
    reference = WithLoss(copy.deepcopy(model), CrossEntropy(), Layout(1, single=True))
    batches = images(2)
    engine = make_engine(kind, model, batches[0], tmp_path)
    assert engine.describe()["graph_fixes"]["dropout_to_mask_inputs"] == 1
    fed = fed_dropout.WithLossAndMasks(reference, fed_dropout.find_masks(reference, batches[0])).train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    for seed, (x, y) in enumerate(batches):
        torch.manual_seed(seed)
        masks = [torch.from_numpy(m) for m in draw_masks(engine.masks)]
        torch.manual_seed(seed)  # the engine draws the same masks from the same seed
        loss = engine.train_step(x, y)
        expected = fed(x, *masks, y)
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss == pytest.approx(float(expected.detach()), rel=RTOL[kind])
    state = engine.model_state_dict()
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(state[f"bn.{name}"], getattr(reference.model.bn, name), rtol=0, atol=STATS_ATOL)
    assert int(state["bn.num_batches_tracked"]) == 2
    assert engine.describe()["graph_fixes"]["convolutions_run_by_torch"] == 1  # padding="same", as an ATen node


class ExportsNothing(nn.Module):
    """Runs in PyTorch but cannot be exported (after its BatchNorm has run): ORTModule falls back to PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 16 * 16, CLASSES))

    def forward(self, x):
        out = self.head(self.bn(self.conv(x)))
        if torch.onnx.is_in_onnx_export():
            raise RuntimeError("this model cannot be exported")
        return out


def test_ortmodules_pytorch_fallback_keeps_eagers_statistics(tmp_path):
    batches = images(3)
    eager, engine, expected, got = train_both("ortmodule", ExportsNothing, batches, tmp_path, fallback="warn")
    assert engine.describe()["executed_by"] == "pytorch"
    assert got == expected  # PyTorch ran it
    assert_same_statistics(eager, engine)


# ------------------------------------------------------------------------------------------------ end to end
BN_RUN = [
    "model=custom",
    "model._target_=tests.helpers.zoo.cnn_batchnorm",
    "data=digits",
    "data.batch_size=32",
    "trainer.max_steps=12",
    "trainer.eval_every=6",
    "trainer.checkpoint.every=6",
    "logger.progress=false",
    "export.onnx=true",
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_a_batchnorm_cnn_resumed_from_a_checkpoint_ends_as_the_uninterrupted_run(
    kind, tmp_path, ortflow_cli, monkeypatch
):
    """Through the command line: the step-6 checkpoint holds the running statistics; a run resumed from it ends with
    the uninterrupted run's weights and statistics, and both export them into model.onnx."""
    import json

    from tests.conftest import REPO

    monkeypatch.syspath_prepend(str(REPO))
    status, stderr = ortflow_cli(*BN_RUN, f"accel={kind}", "hydra.run.dir=whole", cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-00000006.pt"
    saved = torch.load(checkpoint, weights_only=True)["model"]
    assert int(saved["2.num_batches_tracked"]) == 6 and not torch.equal(saved["2.running_var"], torch.ones(4))
    args = [*BN_RUN, f"accel={kind}", f"trainer.resume={checkpoint}", "hydra.run.dir=resumed"]
    status, stderr = ortflow_cli(*args, cwd=tmp_path)
    assert status == 0, stderr[-3000:]
    whole = torch.load(tmp_path / "whole" / "checkpoints" / "final.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "final.pt", weights_only=True)
    assert int(whole["2.num_batches_tracked"]) == int(resumed["2.num_batches_tracked"]) == 12
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-6, atol=1e-7, msg=name)
    for run in ("whole", "resumed"):
        record = json.loads((tmp_path / run / "run.json").read_text())
        assert record["engine"]["executed_by"] == "onnxruntime" and record["engine"]["batchnorm_layers"] == 1
        assert record["export"]["max_abs_diff"] < 1e-4  # model.onnx, with the running statistics, against torch
