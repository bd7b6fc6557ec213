"""model=hf: Hugging Face transformers models built from YAML sizes (no download) or a local directory, trained in
every accel mode with parity against eager; output selection and its errors; transformers' log records."""

import logging

import pytest
import torch

from ortflow.check.modes import check
from ortflow.errors import ConfigError, ModelError
from ortflow.model.hf import build_hf_model
from ortflow.validate import problems
from tests.conftest import REPO, make_cfg

TEXT = ["data.block_size=16", "data.batch_size=8", "model.vocab_size=256"]
# Tiny random-initialised architectures, sized in YAML the way a user writes them.
ARCHITECTURES = {
    "gpt2": [
        "model.model_type=gpt2",
        "++model.config.n_layer=2",
        "++model.config.n_embd=32",
        "++model.config.n_head=2",
    ],
    "llama": [
        "model.model_type=llama",
        "++model.config.hidden_size=32",
        "++model.config.intermediate_size=64",
        "++model.config.num_hidden_layers=2",
        "++model.config.num_attention_heads=2",
        "++model.config.num_key_value_heads=2",
    ],
    "bert": [
        "model.model_type=bert",
        "model.task=masked_lm",
        "++model.config.hidden_size=32",
        "++model.config.intermediate_size=64",
        "++model.config.num_hidden_layers=1",
        "++model.config.num_attention_heads=2",
    ],
    "distilbert": [
        "model.model_type=distilbert",
        "model.task=masked_lm",
        "++model.config.dim=32",
        "++model.config.hidden_dim=64",
        "++model.config.n_layers=1",
        "++model.config.n_heads=2",
    ],
}
RTOL = {"ortmodule": 1e-5, "artifacts": 1e-4}


def assert_trains_in_every_mode(overrides: list[str]) -> dict:
    rows = {r["mode"]: r for r in check(overrides, 3, ["none", "ortmodule", "artifacts"])["rows"]}
    assert rows["none"]["trains"], rows["none"]
    for mode, rtol in RTOL.items():
        row = rows[mode]
        assert row["trains"] and row["executed_by"] == "onnxruntime", row
        assert row["max_rel_loss_diff"] < rtol, row
    return rows


@pytest.mark.parametrize(
    "arch",
    [
        "gpt2",
        pytest.param("llama", marks=pytest.mark.slow),
        pytest.param("bert", marks=pytest.mark.slow),
        pytest.param("distilbert", marks=pytest.mark.slow),
    ],
)
def test_a_tiny_model_from_yaml_sizes_trains_in_every_mode_with_parity(arch):
    assert_trains_in_every_mode(["model=hf", *ARCHITECTURES[arch], *TEXT])


def test_the_vocabulary_and_context_follow_the_data():
    cfg = make_cfg("model=hf", "data.block_size=48")
    assert cfg.model.max_positions == 48
    model = build_hf_model(
        model_type="gpt2", config={"n_layer": 1, "n_embd": 16, "n_head": 2}, vocab_size=300, max_positions=48
    )
    assert model.model.config.vocab_size == 300 and model.model.config.n_positions == 48
    assert model(torch.zeros(2, 48, dtype=torch.long)).shape == (2, 48, 300)


def test_a_classification_head_on_dict_batches_trains_in_every_mode(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    overrides = [
        "model=hf",
        *ARCHITECTURES["bert"][:1],
        *ARCHITECTURES["bert"][2:],
        "model.task=sequence_classification",
        "model.num_labels=2",
        "data=custom",
        "data._target_=tests.helpers.hf_data.token_classes",
        "++model.config.vocab_size=64",
    ]
    assert_trains_in_every_mode(overrides)


def test_a_pretrained_model_loads_from_a_local_directory_with_its_weights(tmp_path):
    saved = build_hf_model(model_type="gpt2", config={"n_layer": 1, "n_embd": 16, "n_head": 2}, vocab_size=64)
    saved.model.save_pretrained(tmp_path / "tiny-gpt2")
    loaded = build_hf_model(name_or_path=str(tmp_path / "tiny-gpt2"))
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in saved.state_dict().items())


def test_a_model_that_is_not_available_locally_is_refused_without_downloading():
    with pytest.raises(ModelError, match="downloads nothing"):
        build_hf_model(name_or_path="no-such-org/no-such-model")


def test_an_output_field_the_model_does_not_return_is_named_with_the_ones_it_has():
    with pytest.raises(ModelError) as err:
        check(["model=hf", *ARCHITECTURES["gpt2"], *TEXT, "model.output=scores"], 2, ["none"])
    assert "model.output='scores'" in str(err.value) and "['logits']" in str(err.value)


@pytest.mark.parametrize(("family", "key"), [("returns_dict", "prediction"), ("returns_tuple", "5")])
def test_a_wrong_output_key_names_the_keys_the_model_returned(family, key, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    overrides = ["model=custom", f"model._target_=tests.helpers.zoo.{family}", *TEXT[:2], f"+model._output_={key}"]
    with pytest.raises(ModelError) as err:
        check(overrides, 2, ["none"])
    assert f"model._output_='{key}'" in str(err.value) and "has [" in str(err.value), err.value
    assert "does not fit the data" not in str(err.value)


@pytest.mark.parametrize("group", ["transformer", "mlp", "hf", "custom"])
def test_the_output_key_is_accepted_by_every_model_group(group):
    overrides = [f"model={group}", "+model._output_=logits"] + (["model._target_=a.b"] if group == "custom" else [])
    cfg = make_cfg(*overrides)
    assert cfg.model._output_ == "logits"
    assert not [p for p in problems(cfg) if "_output_" in p]


def test_transformers_log_records_go_to_the_log_not_the_terminal(caplog):
    build_hf_model(model_type="gpt2", config={"n_layer": 1, "n_embd": 16, "n_head": 2}, vocab_size=64)
    from transformers.utils import logging as hf_logging

    assert not hf_logging.get_logger("transformers").handlers  # its own stderr handler removed
    with caplog.at_level(logging.WARNING):
        hf_logging.get_logger("transformers.modeling_utils").warning("a transformers notice")
    assert any(r.name.startswith("transformers") for r in caplog.records)  # propagates to ortflow's handlers


PHI3 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)


def test_special_token_defaults_outside_the_datas_vocabulary_are_cleared_and_a_users_is_refused():
    # phi3's pad_token_id (32000) and eos_token_id (32000) lie outside a 256-byte vocabulary: torch's embedding would
    # refuse the padding index; they are cleared (the model has no such token), bos_token_id=1 stays.
    model = build_hf_model(model_type="phi3", config=dict(PHI3), vocab_size=256, max_positions=16)
    config = model.model.config
    assert config.pad_token_id is None and config.eos_token_id is None and config.bos_token_id == 1
    out = model(torch.randint(0, 256, (2, 16)))
    assert out.shape == (2, 16, 256)
    with pytest.raises(ConfigError, match=r"model.config.pad_token_id=300 lies outside the model's vocabulary of 256"):
        build_hf_model(model_type="phi3", config={**PHI3, "pad_token_id": 300}, vocab_size=256, max_positions=16)
