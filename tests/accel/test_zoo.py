"""Model zoo: each family tried for a few steps in every accel mode by `ortflow-check` (dropout off, same weights and
batches): it trains with loss parity against eager, or the mode refuses it with one line naming why."""

import pytest

from ortflow.check.modes import check
from ortflow.errors import OrtflowError
from tests.conftest import COMPILE_REFUSED, REPO

TEXT = ["data.block_size=16", "data.batch_size=8"]
DIGITS = ["data=digits", "data.batch_size=32"]
MASKED = ["data=custom", "data._target_=tests.helpers.zoo.masked_text"]  # a user's data: (tokens, mask) inputs
REGRESSION = ["data=diabetes", "data.batch_size=16", "loss=mse"]
# Measured max relative loss differences are 1e-7..1e-6 (ORTModule) and ~1e-5 (artifacts: ORT's AdamW graph).
RTOL = {"ortmodule": 1e-5, "artifacts": 1e-4}
# family -> (data overrides, {mode: text of its refusal} for the modes that refuse it)
ZOO = {
    "mlp": (DIGITS, {}),
    "cnn_batchnorm": (DIGITS, {}),
    "cnn_norms": (DIGITS, {}),
    "up_down": (DIGITS, {}),
    "patch_classifier": (DIGITS, {}),
    "gru_lm": (TEXT, {}),
    "gpt_block": (TEXT, {}),
    "tied_embeddings": (TEXT, {}),
    "frozen_submodule": (TEXT, {}),
    "custom_function": (TEXT, {"artifacts": "torch.autograd.Function ScaledTanh"}),
    "inplace_function": (TEXT, {"artifacts": "torch.autograd.Function DoubleInPlace"}),
    "buffers": (TEXT, {}),
    "two_inputs": (MASKED, {}),
    "dict_inputs": ([*MASKED, "+data.as_dict=true"], {}),
}


@pytest.mark.parametrize("family", sorted(ZOO))
def test_every_family_trains_with_parity_or_is_refused_with_a_reason(family, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    data, refused = ZOO[family]
    report = check(
        ["model=custom", f"model._target_=tests.helpers.zoo.{family}", *data], 3, ["none", "ortmodule", "artifacts"]
    )
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["none"]["trains"], rows["none"]
    for mode in ("ortmodule", "artifacts"):
        row = rows[mode]
        if mode in refused:
            assert not row["trains"] and refused[mode] in row["reason"], row
            continue
        assert row["trains"] and row["executed_by"] == "onnxruntime", row
        assert row["max_rel_loss_diff"] < RTOL[mode], row


def test_the_seeds_sequence_first_transformer_trains_in_every_mode_by_config(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    overrides = ["model=custom", "model._target_=tests.helpers.seed_model.build", *TEXT, "data.batch_first=false"]
    rows = {r["mode"]: r for r in check(overrides, 3, ["none", "ortmodule", "artifacts"])["rows"]}
    assert all(r["trains"] for r in rows.values()), rows
    assert rows["ortmodule"]["max_rel_loss_diff"] < RTOL["ortmodule"]
    assert rows["artifacts"]["max_rel_loss_diff"] < RTOL["artifacts"]


@pytest.mark.parametrize(
    ("family", "key"), [("returns_dict", "logits"), ("returns_tuple", "0"), ("returns_object", "logits")]
)
def test_a_forward_returning_a_tuple_dict_or_object_trains_through_its_output_key(family, key, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    overrides = ["model=custom", f"model._target_=tests.helpers.zoo.{family}", *TEXT]
    with pytest.raises(OrtflowError, match=r"model\._output_="):  # without the key: refused, naming the fix
        check(overrides, 3, ["none"])
    rows = {
        r["mode"]: r
        for r in check([*overrides, f"+model._output_={key}"], 3, ["none", "ortmodule", "artifacts"])["rows"]
    }
    assert all(r["trains"] for r in rows.values()), rows
    assert rows["ortmodule"]["max_rel_loss_diff"] < RTOL["ortmodule"]
    assert rows["artifacts"]["max_rel_loss_diff"] < RTOL["artifacts"]


def test_a_two_input_model_on_one_input_data_is_refused_naming_the_inputs(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(OrtflowError, match=r"forward failed on a data batch of inputs one tensor \(8, 16\)"):
        check(["model=custom", "model._target_=tests.helpers.zoo.two_inputs", *TEXT], 3, ["none"])


MLP_REGRESSION = ["model=mlp", "model.in_features=10", "model.num_classes=1", "model.hidden=[16]"]
MLP_BINARY = ["model=mlp", "model.num_classes=1", "data=custom", "data._target_=tests.helpers.zoo.even_digits"]
# Each loss in every mode: ORT's own loss block (cross_entropy, mse, bce_with_logits) or the loss exported with the
# model (label smoothing, pos_weight, a user's function or class).
LOSSES = {
    "mse": [*MLP_REGRESSION, *REGRESSION],
    "custom_function": [*MLP_REGRESSION, *REGRESSION, "loss=custom", "loss._target_=tests.helpers.zoo.mean_abs_error"],
    "custom_class": [
        *MLP_REGRESSION,
        *REGRESSION,
        "loss=custom",
        "loss._target_=torch.nn.MSELoss",
        "+loss.reduction=mean",
    ],
    "label_smoothing": ["model=mlp", *DIGITS, "loss.label_smoothing=0.1"],
    "bce_with_logits": [*MLP_BINARY, "loss=bce_with_logits"],
    "bce_pos_weight": [*MLP_BINARY, "loss=bce_with_logits", "loss.pos_weight=2.0"],
}


@pytest.mark.parametrize("case", sorted(LOSSES))
def test_every_loss_trains_with_parity_in_every_mode(case, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    rows = {r["mode"]: r for r in check(LOSSES[case], 3, ["none", "ortmodule", "artifacts"])["rows"]}
    assert all(r["trains"] for r in rows.values()), rows
    assert rows["ortmodule"]["max_rel_loss_diff"] < RTOL["ortmodule"], rows
    assert rows["artifacts"]["max_rel_loss_diff"] < RTOL["artifacts"], rows


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["model=mlp", "model.in_features=10", *REGRESSION], r"loss=mse expects the targets' shape \(16, 1\)"),
        (["model=mlp", "model.in_features=10", "model.num_classes=1", "data=diabetes"], "int64 class ids"),
        (["model=mlp", *DIGITS, "loss=mse"], "float targets"),
        (["model=mlp", *DIGITS, "loss=custom", "loss._target_=tests.helpers.zoo.nowhere"], "cannot be imported"),
        (["model=mlp", *DIGITS, "loss=custom", "loss._target_=tests.helpers.zoo.a_number"], "returned int"),
    ],
)
def test_a_loss_that_does_not_fit_the_model_or_data_is_refused_before_training(overrides, says, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(OrtflowError, match=says):
        check(overrides, 2, ["none"])


def test_ortflow_check_prints_one_table_and_writes_json(tmp_path, capfd, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from ortflow.cli.check import main

    out = tmp_path / "check.json"
    main(["model=custom", "model._target_=tests.helpers.zoo.mlp", *DIGITS, "--steps", "2", "--out", str(out)])
    printed = capfd.readouterr().out
    assert "ortflow-check" in printed and "ortmodule" in printed and "artifacts" in printed
    import json

    report = json.loads(out.read_text())
    assert report["rows"][0]["mode"] == "none" and {r["mode"] for r in report["rows"]} == {
        "none",
        "ortmodule",
        "artifacts",
        "compile",
    }
    refused = {"compile"} if COMPILE_REFUSED is not None else set()  # below its verified torch: refused, saying why
    assert all(r["trains"] for r in report["rows"] if r["mode"] not in refused), report["rows"]
    assert all("offers it from torch" in r["reason"] for r in report["rows"] if r["mode"] in refused)


def test_a_data_builder_returning_something_else_is_refused_by_name(monkeypatch):
    with pytest.raises(OrtflowError, match=r"data._target_=builtins.dict returned dict, not an ortflow.data.Data"):
        check(["data=custom", "data._target_=builtins.dict"], 2, ["none"])


def test_a_model_with_functional_dropout_is_reported_as_drawing_random_numbers(monkeypatch):
    """ortflow-check sets dropout modules to p=0; F.dropout and scaled_dot_product_attention's dropout_p it cannot
    reach, and says so instead of presenting the loss difference as the runtimes' parity."""
    monkeypatch.syspath_prepend(str(REPO))
    report = check(["model=custom", "model._target_=tests.helpers.zoo.dropout_block", *TEXT], 3, ["none", "ortmodule"])
    rows = {r["mode"]: r for r in report["rows"]}
    assert report["random_forward"] and rows["ortmodule"]["executed_by"] == "onnxruntime"
    plain = check(["model=custom", "model._target_=tests.helpers.zoo.gpt_block", *TEXT], 2, ["none"])
    assert not plain["random_forward"]
