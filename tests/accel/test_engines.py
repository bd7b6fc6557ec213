"""Loss parity eager vs ortmodule vs artifacts, proof that ORT executed, padding, the artifacts round trip."""

import itertools
import logging
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ortflow import accel
from ortflow.accel.engine import EngineContext, pad_batch
from ortflow.config import DebugConfig, OptimConfig
from ortflow.data.text import build_text_data
from ortflow.errors import OrtflowError
from ortflow.model.mlp import build_mlp
from ortflow.model.transformer import build_transformer
from ortflow.run.trainer import evaluate
from ortflow.step.batch import Layout
from ortflow.step.loss import IGNORE_INDEX, MSE, CrossEntropy
from ortflow.step.with_loss import WithLoss
from tests.conftest import make_cfg

STEPS = 10
# Tolerances, from measured differences (dropout=0, 10 AdamW steps, same seed and batches):
# ORTModule's kernels sum in another order than torch's (max relative difference seen: 9e-8);
# artifacts also run ORT's own AdamW graph (5e-6 seen). Both bounds leave ~100x headroom.
RTOL_ORTMODULE = 1e-5
RTOL_ARTIFACTS = 1e-4
# With dropout=0.1 the runtimes draw different masks; the mean loss of 10 steps agrees within this (0.7% seen).
RTOL_DROPOUT_MEAN = 0.02

optim = OmegaConf.structured(OptimConfig)


def tiny_model(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_transformer(vocab_size=256, d_model=32, nhead=2, num_layers=2, dim_feedforward=64, dropout=dropout)


@pytest.fixture(scope="module")
def data():
    return build_text_data("python_docs", block_size=16, batch_size=8, val_fraction=0.1, seed=0)


@pytest.fixture(scope="module")
def batches(data):
    return list(itertools.islice(iter(data.train), STEPS))


def make_engine(kind: str, dropout: float, example, tmp: Path, model: torch.nn.Module | None = None, **settings):
    """An engine built as the runner builds it: from conf/accel/<kind>.yaml and an EngineContext."""
    model = model if model is not None else tiny_model(dropout)
    mode = "none" if kind == "eager" else kind
    cfg = make_cfg(f"accel={mode}", *(f"accel.{key}={value}" for key, value in settings.items()))
    ctx = EngineContext(model, example, optim, debug=OmegaConf.structured(DebugConfig), onnx_dir=tmp / "onnx")
    return accel.build(cfg.accel, ctx)


def losses(engine, batches) -> list[float]:
    return [engine.train_step(x, y) for x, y in batches]


@pytest.mark.parametrize(("kind", "rtol"), [("ortmodule", RTOL_ORTMODULE), ("artifacts", RTOL_ARTIFACTS)])
def test_loss_parity_with_eager_without_dropout(kind, rtol, batches, tmp_path):
    eager = losses(make_engine("eager", 0.0, batches[0], tmp_path / "e"), batches)
    engine = make_engine(kind, 0.0, batches[0], tmp_path / kind)
    ort = losses(engine, batches)
    torch.testing.assert_close(torch.tensor(ort), torch.tensor(eager), rtol=rtol, atol=0)
    # Identical bits on every step would mean PyTorch ran the model; ORT's kernels round differently.
    assert ort != eager
    if kind == "ortmodule":
        forward, backward, _ = engine.runs.snapshot()
        assert forward == STEPS and backward == STEPS  # this engine's own ORT forward + backward runs
        assert engine.describe()["executed_by"] == "onnxruntime"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_the_seed_model_with_default_dropout_trains_in_ort(kind, batches, tmp_path):
    eager = losses(make_engine("eager", 0.1, batches[0], tmp_path / "e"), batches)
    engine = make_engine(kind, 0.1, batches[0], tmp_path / kind)
    ort = losses(engine, batches)
    assert engine.describe()["executed_by"] == "onnxruntime"
    assert engine.describe()["ort_train_steps"] == STEPS
    mean_eager, mean_ort = sum(eager) / STEPS, sum(ort) / STEPS
    assert abs(mean_ort - mean_eager) / mean_eager < RTOL_DROPOUT_MEAN
    assert ort[-1] < ort[0]  # it learns


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_eval_with_a_partial_last_batch_matches_eager_and_keeps_training_in_ort(kind, data, batches, tmp_path):
    # 13 validation windows in batches of 8: the second batch is partial (5 rows).
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(data.val.dataset, range(13)), batch_size=8)
    eager = make_engine("eager", 0.1, batches[0], tmp_path / "e")
    engine = make_engine(kind, 0.1, batches[0], tmp_path / kind)
    engine.train_step(*batches[0])  # ORT's training graph first, then evaluation, from the same weights as eager
    eager.model.load_state_dict(engine.model_state_dict())
    expected, got = evaluate(eager, val, None), evaluate(engine, val, None)  # dropout on in the model: off in eval
    assert got["eval/loss"] == pytest.approx(expected["eval/loss"], rel=1e-4)
    assert got["eval/accuracy"] == pytest.approx(expected["eval/accuracy"], abs=1e-9)
    # Training after eval still runs in ORT (torch's fast path would have pushed ORTModule onto PyTorch).
    engine.train_step(*batches[1])
    info = engine.describe()
    assert info["executed_by"] == "onnxruntime" and info["ort_eval_batches"] == 2


@pytest.mark.slow
def test_ortmodule_fallback_fail_stops_and_warn_records_pytorch(tmp_path, batches, caplog):
    from ortflow.errors import OrtflowError

    class Unexportable(torch.nn.Module):
        """Runs in PyTorch, but cannot be exported to ONNX (stands in for any unsupported model)."""

        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 256)

        def forward(self, x):
            if torch.onnx.is_in_onnx_export():
                raise RuntimeError("this model cannot be exported")
            return self.emb(x)

    x, y = batches[0]
    for fallback, expect_error in (("fail", True), ("warn", False)):
        engine = make_engine("ortmodule", 0.0, (x, y), tmp_path / fallback, model=Unexportable(), fallback=fallback)
        if expect_error:
            with pytest.raises(OrtflowError, match=r"cannot be exported.*accel\.fallback=warn"):
                engine.train_step(x, y)
        else:
            with caplog.at_level(logging.WARNING, logger="ortflow"):
                engine.train_step(x, y)
            assert engine.describe()["executed_by"] == "pytorch"
            warned = " ".join(r.getMessage() for r in caplog.records if "did not execute" in r.getMessage())
            assert "accel.fallback=fail stops" in warned and "Set accel.fallback=warn" not in warned


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target"), [("eager", "ortmodule"), ("ortmodule", "artifacts"), ("artifacts", "eager")]
)
def test_trained_weights_carry_over_between_engines_by_torch_names(source, target, batches, tmp_path):
    """What checkpoint conversion rests on: any engine's weights, loaded into the torch model, give another engine
    the same model; the optimizer state carries over too (all three step torch's AdamW; the artifacts engine on ORT's
    buffers)."""
    first = make_engine(source, 0.1, batches[0], tmp_path / "a")
    losses(first, batches[:5])
    weights = first.model_state_dict()
    fresh = tiny_model(0.1)
    assert set(weights) == set(fresh.state_dict())
    assert not torch.equal(weights["fc.weight"], fresh.state_dict()["fc.weight"])  # training changed them
    fresh.load_state_dict(weights, strict=True)
    second = make_engine(target, 0.1, batches[0], tmp_path / "b", model=fresh)
    x, y = batches[5]
    expected, got = first.eval_step(x, y), second.eval_step(x, y)
    assert got.loss_sum == pytest.approx(expected.loss_sum, rel=1e-5)
    assert got.sums["accuracy"] == expected.sums["accuracy"]
    assert second.load_optimizer_state(first.optimizer_state())


@pytest.mark.parametrize("kind", ["eager", "ortmodule", "artifacts"])
def test_a_non_finite_loss_leaves_weights_and_optimizer_untouched(kind, tmp_path):
    torch.manual_seed(0)
    model = build_mlp(in_features=64, num_classes=10, hidden=[16])
    x, y = torch.rand(8, 64), torch.randint(0, 10, (8,))
    engine = make_engine(kind, 0.0, (x, y), tmp_path, model=model)
    engine.train_step(x, y)
    before = engine.model_state_dict()
    bad = x.clone()
    bad[0, 0] = float("nan")
    assert math.isnan(engine.train_step(bad, y))
    after = engine.model_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.train_step(x, y)  # training goes on, still in ORT for the ORT engines
    assert not torch.equal(before["1.weight"], engine.model_state_dict()["1.weight"])
    if kind != "eager":
        assert engine.describe()["executed_by"] == "onnxruntime" and engine.describe()["ort_train_steps"] == 2


def test_padding_a_short_batch_leaves_the_loss_unchanged():
    torch.manual_seed(0)
    loss = CrossEntropy()
    module = WithLoss(tiny_model(0.0), loss, Layout(1, single=True)).eval()
    x, y = torch.randint(0, 256, (5, 16)), torch.randint(0, 256, (5, 16))
    (px,), py = pad_batch((x,), y, 8, loss)
    assert px.shape == (8, 16) and (py[5:] == IGNORE_INDEX).all()
    with torch.no_grad():
        torch.testing.assert_close(module(px, py)[0], module(x, y)[0])


def test_a_short_training_batch_is_refused_for_a_loss_without_padding_targets():
    x, y = torch.zeros(5, 3), torch.zeros(5, 1)
    with pytest.raises(OrtflowError, match="fewer than the batch size 8"):
        pad_batch((x,), y, 8, MSE())


# Every speed rewrite off (the graph ORT differentiates as exported) against the defaults (all on).
REWRITES_OFF = {
    "rewrite_gathers": False,
    "rewrite_relu": False,
    "rewrite_embedding_max_vocab": 0,
    "rewrite_dropout": False,
}


def test_artifacts_rewrites_keep_the_loss_and_every_gradient(batches, tmp_path):
    plain = make_engine("artifacts", 0.0, batches[0], tmp_path / "plain", **REWRITES_OFF)
    rewritten = make_engine("artifacts", 0.0, batches[0], tmp_path / "rewritten")
    assert "relu_to_mask_mul" not in plain.describe()["graph_fixes"]
    fixes = rewritten.describe()["graph_fixes"]
    assert fixes["relu_to_mask_mul"] == 2 and fixes["embedding_to_onehot_matmul"] == 1  # one per layer; the embedding
    # one packed q/k/v split per layer; dropout 0 here, and ORT's Dropout copies its input at ratio 0: no masks to feed
    assert fixes["packed_projections_to_splits"] == 2 and "constant_gathers_to_slices" not in fixes
    assert "dropout_to_mask_inputs" not in fixes
    for x, y in batches[:3]:
        loss, grads = plain.gradients(x, y)
        loss_rewritten, grads_rewritten = rewritten.gradients(x, y)
        assert loss_rewritten == pytest.approx(loss, rel=1e-6)
        assert grads_rewritten.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grads_rewritten[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_artifacts_embedding_by_torch_keeps_the_loss_and_every_gradient(batches, tmp_path):
    # ORT's Gather and GatherGrad (neither torch's kernels nor the OneHot rewrite) against torch's embedding node
    gather = make_engine(
        "artifacts", 0.0, batches[0], tmp_path / "gather", aten_embedding=False, rewrite_embedding_max_vocab=0
    )
    by_torch = make_engine("artifacts", 0.0, batches[0], tmp_path / "torch", aten_embedding=True)
    assert by_torch.describe()["graph_fixes"]["embeddings_run_by_torch"] == 1
    assert "embeddings_run_by_torch" not in gather.describe()["graph_fixes"]
    for x, y in batches[:3]:  # byte-level text: each batch repeats ids, whose gradient rows add up
        loss, grads = gather.gradients(x, y)
        loss_by_torch, grads_by_torch = by_torch.gradients(x, y)
        assert loss_by_torch == pytest.approx(loss, rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grads_by_torch[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_ortmodule_relu_rewrite_keeps_the_losses(batches, tmp_path):
    plain = make_engine("ortmodule", 0.0, batches[0], tmp_path / "plain", rewrite_relu=False)
    rewritten = make_engine("ortmodule", 0.0, batches[0], tmp_path / "rewritten")
    assert torch.tensor(losses(rewritten, batches)) == pytest.approx(torch.tensor(losses(plain, batches)), rel=1e-6)
    assert "relu_to_mask_mul" not in plain.describe()["graph_fixes"]
    assert rewritten.describe()["graph_fixes"]["relu_to_mask_mul"] == 2
    assert rewritten.describe()["executed_by"] == "onnxruntime"


def test_artifacts_dropout_masks_follow_the_torch_seed(batches, tmp_path):
    """With rewrite_dropout the masks are seeded from torch's RNG: the same seed gives the same losses with dropout
    on, another seed other masks; both train close to eager (the dropout distribution is torch's)."""
    engine = make_engine("artifacts", 0.1, batches[0], tmp_path / "a")
    again = make_engine("artifacts", 0.1, batches[0], tmp_path / "b")
    eager = make_engine("eager", 0.1, batches[0], tmp_path / "e")
    torch.manual_seed(5)
    got = losses(engine, batches)
    torch.manual_seed(5)
    assert losses(again, batches) == got
    torch.manual_seed(6)
    other = losses(make_engine("artifacts", 0.1, batches[0], tmp_path / "c"), batches)
    assert other != got
    expected = losses(eager, batches)
    assert abs(sum(got) - sum(expected)) / sum(expected) < RTOL_DROPOUT_MEAN


def test_ortmodule_dropout_masks_follow_the_torch_seed(batches, tmp_path):
    runs = []
    for seed, name in [(5, "a"), (5, "b"), (6, "c")]:
        engine = make_engine("ortmodule", 0.1, batches[0], tmp_path / name)
        torch.manual_seed(seed)
        runs.append(losses(engine, batches))
        assert engine.describe()["executed_by"] == "onnxruntime"
    assert runs[0] == runs[1] and runs[0] != runs[2]


def dropout_block() -> torch.nn.Module:
    from tests.helpers.zoo import dropout_block

    torch.manual_seed(0)
    return dropout_block()


# model, its dropout sites: nn.TransformerEncoderLayer has per layer the attention weights' dropout (inside
# scaled_dot_product_attention), then dropout, dropout1, dropout2; the zoo's DropoutBlock has one of each form
# (scaled_dot_product_attention's dropout_p, F.dropout, nn.Dropout).
DROPOUT_MODELS = {"transformer": (lambda: tiny_model(0.1), 8), "dropout_block": (dropout_block, 3)}


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
@pytest.mark.parametrize("family", sorted(DROPOUT_MODELS))
def test_fed_dropout_masks_give_eager_pytorchs_loss_and_gradients(kind, family, batches, tmp_path):
    """With rewrite_dropout every dropout is `x * mask` on masks the engine draws (ORTModule: extra inputs of the
    module it runs; artifacts: graph inputs, in the graph's order, which is the forward's call order): eager
    PyTorch fed the same masks gives the engine's loss and gradients."""
    import copy

    from ortflow.accel.compat import ortmodule_patches
    from ortflow.accel.graph import fed_dropout
    from ortflow.accel.graph.masks import draw_masks

    build, sites = DROPOUT_MODELS[family]
    model = build()
    reference = WithLoss(copy.deepcopy(model), CrossEntropy(), Layout(1))
    engine = make_engine(kind, 0.1, batches[0], tmp_path, model=model)
    assert engine.describe()["graph_fixes"]["dropout_to_mask_inputs"] == sites
    found = fed_dropout.find_masks(reference, batches[0])
    assert [m.shape for m in engine.masks] == [m.shape for m in found]
    assert [m.ratio for m in engine.masks] == pytest.approx([m.ratio for m in found])  # artifacts': a float32
    fed = fed_dropout.WithLossAndMasks(reference, found).train()
    for seed, (x, y) in enumerate(batches[:2]):
        torch.manual_seed(seed)
        masks = [torch.from_numpy(m) for m in draw_masks(engine.masks)]
        assert any((m == 0).any() for m in masks)
        if kind == "artifacts":
            torch.manual_seed(seed)  # the engine draws the same masks from the same seed
            loss, grads = engine.gradients(x, y)
            grads = {name: torch.from_numpy(g) for name, g in grads.items()}
        else:
            with ortmodule_patches.ortmodule_scope(engine.session, engine.runs, engine.graph_fixes):
                engine.module.train()
                out = engine.module(x, *masks, y)
                out.backward()
            loss, grads = float(out.detach()), {name: p.grad for name, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
        expected = fed(x, *masks, y)
        expected.backward()
        assert loss == pytest.approx(float(expected.detach()), rel=1e-5)
        for name, p in reference.model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
            p.grad = None
    if kind == "ortmodule":
        assert engine.runs.snapshot()[:2] == (2, 2)  # ORT ran both forwards and backwards
