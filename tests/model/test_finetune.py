"""Fine-tuning saved transformers models: +peft=lora trains only the adapters in every engine (parity with eager, base
weights bit-identical), checkpoints resume exactly and refuse another base, export.hf writes a folder transformers
(and peft) load with the run's logits; LoRA on any nn.Module; the refusals."""

import json
from pathlib import Path

import pytest
import torch

from ortflow.api import load_run, train
from ortflow.check.modes import check
from ortflow.errors import CheckpointError, ConfigError
from tests.model.test_hf import RTOL

VOCAB = 256
SIZES = {
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 64},
    "llama": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
}
TEXT = ["data.block_size=16", "data.batch_size=8", "logger.tensorboard=false", "trainer.eval_batches=2"]


def save_tiny(arch: str, folder: Path, vocab: int = VOCAB) -> Path:
    """A tiny random causal LM made and saved with transformers alone (nothing downloaded)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(arch, vocab_size=vocab, bos_token_id=0, eos_token_id=0, **SIZES[arch])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder / arch)
    return folder / arch


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pretrained")
    return {arch: save_tiny(arch, folder) for arch in SIZES}


def finetune(saved_dir: Path, run_dir: Path, *extra: str):
    overrides = ["model=hf", f"model.name_or_path={saved_dir}", "+peft=lora", *TEXT, "trainer.max_steps=4", *extra]
    return train(overrides, run_dir=run_dir)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids)


EXECUTED_BY = {"none": "pytorch", "ortmodule": "onnxruntime", "artifacts": "onnxruntime", "compile": "inductor"}


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["none", "ortmodule", "artifacts", pytest.param("compile", marks=pytest.mark.slow)])
def test_lora_trains_only_adapters_exports_hf_and_transformers_loads_the_runs_logits(saved, arch, kind, tmp_path):
    import transformers

    result = finetune(saved[arch], tmp_path / "run", f"accel={kind}", "export.hf=true")
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["engine"]["executed_by"] == EXECUTED_BY[kind]
    if kind in ("ortmodule", "artifacts"):
        assert record["engine"]["ort_train_steps"] == 4
    if kind == "compile":
        assert record["engine"]["compiled_steps"] == 4
    trained = result.model.state_dict()
    adapters = {k for k in trained if ".lora_" in k}
    assert adapters and record["parameters"]["trainable"] == sum(trained[k].numel() for k in adapters)
    # Every base weight bit-identical after training; the adapters moved.
    base = transformers.AutoModelForCausalLM.from_pretrained(saved[arch]).state_dict()
    prefix = "model.base_model.model."
    for name, value in trained.items():
        if name in adapters:
            continue
        key = name.removeprefix(prefix).replace(".base_layer.", ".")
        assert torch.equal(value, base[key]), name
    assert any(not torch.equal(trained[k], torch.zeros_like(trained[k])) for k in adapters if "lora_B" in k)
    # hf/: the merged model, loaded by transformers alone, gives the run's logits.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    want = logits(result.model, ids)
    got = loaded.eval()(ids).logits.detach()
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    assert record["export_hf"]["merged_lora"] and record["export_hf"]["max_rel_diff"] < 1e-5
    assert load_run(tmp_path / "run").model is not None  # the run reloads with its adapters


def test_lora_losses_match_eager_in_both_ort_engines(saved):
    rows = {
        r["mode"]: r
        for r in check(
            ["model=hf", f"model.name_or_path={saved['gpt2']}", "+peft=lora", *TEXT],
            3,
            ["none", "ortmodule", "artifacts"],
        )["rows"]
    }
    for mode, rtol in RTOL.items():
        assert rows[mode]["trains"] and rows[mode]["executed_by"] == "onnxruntime", rows[mode]
        assert rows[mode]["max_rel_loss_diff"] < rtol, rows[mode]


SLOW_ORT = [pytest.param(kind, marks=pytest.mark.slow) for kind in ("ortmodule", "artifacts")]


@pytest.mark.parametrize("kind", ["none", *SLOW_ORT])
def test_a_lora_checkpoint_resumes_exactly_and_refuses_another_base(saved, kind, tmp_path):
    every = ["trainer.checkpoint.every=2", "trainer.checkpoint.keep=null", "trainer.eval_every=0", f"accel={kind}"]
    finetune(saved["gpt2"], tmp_path / "whole", *every)
    step2 = tmp_path / "whole" / "checkpoints" / "step-00000002.pt"
    payload = torch.load(step2, weights_only=True)
    assert all(".lora_" in k for k in payload["model"]) and payload["frozen_base"]  # adapters only
    finetune(saved["gpt2"], tmp_path / "resumed", *every, f"trainer.resume={step2}")
    want = torch.load(tmp_path / "whole" / "checkpoints" / "final.pt", weights_only=True)
    got = torch.load(tmp_path / "resumed" / "checkpoints" / "final.pt", weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    import transformers

    other = save_tiny("gpt2", tmp_path / "other")  # same architecture, other weights
    model = transformers.AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.transformer.wpe.weight.add_(1.0)
    model.save_pretrained(other)
    with pytest.raises(CheckpointError, match="frozen base"):
        finetune(other, tmp_path / "foreign", *every, f"trainer.resume={step2}")


# peft asks transformers for is_gradient_checkpointing, which transformers deprecates: between the two libraries.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_adapter_folder_loads_with_peft_onto_the_base(saved, tmp_path):
    import peft
    import transformers

    result = finetune(saved["gpt2"], tmp_path / "run", "export.hf=true", "export.hf_adapter_only=true")
    folder = tmp_path / "run" / "hf"
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    base = transformers.AutoModelForCausalLM.from_pretrained(saved["gpt2"])
    loaded = peft.PeftModel.from_pretrained(base, folder).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    want = logits(result.model, ids)
    got = loaded(input_ids=ids).logits.detach()
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_the_runs_bpe_tokenizer_is_exported_as_a_fast_tokenizer(saved, tmp_path):
    import transformers

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    data = [f"data.source={corpus}", "data.tokenizer=bpe", "data.bpe_vocab_size=260", f"data.cache_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="smaller than the data's"):  # 256 tokens: the tokenizer's ids overflow it
        finetune(saved["gpt2"], tmp_path / "small", *data, "trainer.max_steps=2")
    model = save_tiny("gpt2", tmp_path, vocab=260)
    finetune(model, tmp_path / "run", *data, "export.hf=true", "trainer.max_steps=2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "hf")
    ids = tokenizer("the lazy fox")["input_ids"]
    assert tokenizer.decode(ids) == "the lazy fox" and tokenizer.eos_token == "<|endoftext|>"


def test_lora_on_a_plain_module_trains_in_every_engine_with_parity():
    overrides = ["model=mlp", "data=digits", "+peft=lora", "peft.target_modules=['1','3']", "peft.r=4"]
    rows = {r["mode"]: r for r in check(overrides, 3, ["none", "ortmodule", "artifacts"])["rows"]}
    assert rows["none"]["trains"], rows["none"]
    for mode, rtol in RTOL.items():
        assert rows[mode]["trains"] and rows[mode]["executed_by"] == "onnxruntime", rows[mode]
        assert rows[mode]["max_rel_loss_diff"] < rtol, rows[mode]


def test_lora_without_targets_on_a_plain_module_names_its_linear_layers():
    with pytest.raises(ConfigError, match=r"peft.target_modules.*1, 3, 5"):
        check(["model=mlp", "data=digits", "+peft=lora"], 1, ["none"])


def test_the_adapter_folder_alone_needs_the_export():
    from ortflow.validate import problems
    from tests.conftest import make_cfg

    assert any("set export.hf=true too" in p for p in problems(make_cfg("export.hf_adapter_only=true")))


def test_export_hf_refuses_a_model_that_is_not_a_transformers_model(tmp_path):
    with pytest.raises(ConfigError, match=r"export\.hf=true .* not one"):
        train(["model=mlp", "data=digits", "export.hf=true", "trainer.max_steps=1"], run_dir=tmp_path / "run")


@pytest.mark.slow
def test_a_sweep_over_the_rank_and_learning_rate_runs_every_job(saved, tmp_path):
    from tests.conftest import run_cli, run_dirs

    args = ["model=hf", f"model.name_or_path={saved['gpt2']}", "+peft=lora", *TEXT, "trainer.max_steps=2"]
    proc = run_cli("-m", *args, "peft.r=2,4", "optim.lr=1e-3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trainable = sorted(json.loads((d / "run.json").read_text())["parameters"]["trainable"] for d in run_dirs(tmp_path))
    assert len(trainable) == 2 and trainable[1] == 2 * trainable[0]  # the adapters' size follows peft.r


def test_the_finetune_recipe_is_lora_with_an_hf_export_and_needs_a_pretrained_model():
    from ortflow.api import compose
    from ortflow.errors import ModelError

    cfg = compose(["+recipe=finetune"])
    assert cfg.peft.r == 8 and cfg.export.hf and cfg.model.task == "causal_lm"
    with pytest.raises(ModelError, match=r"needs model\.name_or_path"):
        check(["+recipe=finetune"], 1, ["none"])
    assert compose(["+recipe=finetune", "~peft"]).peft is None  # full fine-tuning


@pytest.mark.parametrize("kind", ["ortmodule", "artifacts"])
def test_lora_on_convolutions_trains_in_ort_with_parity(kind, tmp_path):
    from omegaconf import OmegaConf

    from ortflow.config import LoraConfig
    from ortflow.model.lora import apply_lora
    from tests.accel.test_vision_engines import assert_ort_trained, conv_bn, images, train_both

    settings = OmegaConf.structured(LoraConfig(r=2, target_modules=["0", "3"]))  # the two Conv2d layers
    _, engine, expected, got = train_both(kind, lambda: apply_lora(conv_bn(), settings), images(), tmp_path)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=RTOL[kind], atol=0)
    assert_ort_trained(engine, len(got))
    model = engine.inner.model if kind == "ortmodule" else engine.model
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == 4 and all(".lora_" in n for n in trained)  # lora_A and lora_B of both convolutions
