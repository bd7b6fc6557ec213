"""`model=hf`: a Hugging Face transformers model, pretrained from a local directory or the local Hugging Face cache,
or randomly initialised from an architecture and sizes in YAML, with no download either way.

    ortflow model=hf model.model_type=gpt2 ++model.config.n_layer=2 ++model.config.n_embd=64 ++model.config.n_head=2
    ortflow model=hf model.name_or_path=/models/tiny-llama          # a local checkpoint (or a cached hub name)
    ortflow model=hf model.task=sequence_classification model.num_labels=2 data=custom ...

The vocabulary and the context length of a random-initialised model follow the data (`model.vocab_size` and
`model.max_positions`, filled from `data.vocab_size` and `data.block_size`). The forward returns the output field
`model.output` (default `logits`) as a tensor, so every engine and every export sees a tensor-returning model; batch
inputs are passed on as they come (a tensor of token ids positionally as `input_ids`, a dict by keyword).
transformers is an optional extra (`pip install 'ortflow[hf]'`); its log records go to the run's log file.
"""

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ortflow.errors import ConfigError, ModelError
from ortflow.model import output_keys

log = logging.getLogger(__name__)

# model.task -> the transformers auto class that builds that head.
TASKS = {
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "token_classification": "AutoModelForTokenClassification",
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "model=hf needs Hugging Face transformers, which is not installed: pip install 'ortflow[hf]'."
        ) from None
    # Its records go through Python logging to the run's log file (the terminal shows ortflow's own warnings only).
    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.enable_propagation()
    transformers.utils.logging.disable_progress_bar()  # loading and saving weights: no bars on the terminal
    return transformers


class HFModel(nn.Module):
    """A transformers model whose forward returns one tensor: the `output` field of the model's output."""

    def __init__(self, model: nn.Module, output: str) -> None:
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args and "attention_mask" not in kwargs and len(args) == 1:
            # Token ids alone: every position is real. An explicit all-ones mask keeps transformers from looking
            # for packed sequences in the position ids (torch.diff, which the ONNX exporter cannot export).
            kwargs["attention_mask"] = torch.ones_like(args[0])
        out = self.model(*args, **kwargs)
        if isinstance(out, dict) and self.output in out:
            return out[self.output]
        raise ModelError(
            f"model.output={self.output!r}: the model's output has no field {self.output!r}; it returned "
            f"{output_keys(out)}. Set model.output to one of them (the logits, for training)."
        )


def _available_locally(name_or_path: str) -> bool:
    """Whether `name_or_path` is a model directory or a model in the local Hugging Face cache. Asked before
    transformers is: with local_files_only it still looks for a peft adapter online, five retries long."""
    if Path(name_or_path).is_dir():
        return True
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name_or_path, "config.json"), str)


def build_hf_model(
    task: str = "causal_lm",
    name_or_path: str | None = None,
    model_type: str | None = "gpt2",
    config: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    max_positions: int | None = None,
    num_labels: int | None = None,
    output: str = "logits",
) -> nn.Module:
    """Build a transformers model for `task`.

    Args:
        task: the head: causal_lm, masked_lm, sequence_classification or token_classification.
        name_or_path: a local model directory or a model name in the local Hugging Face cache (pretrained weights;
            nothing is downloaded). None: a random-initialised `model_type` model.
        model_type: the architecture of a random-initialised model (transformers' model_type: gpt2, llama, bert,
            distilbert, ...).
        config: keyword arguments for the architecture's config (sizes: n_layer, hidden_size, ...), also applied on
            top of a pretrained model's config.
        vocab_size: the vocabulary of a random-initialised model (from the data).
        max_positions: the context length of a random-initialised model (from the data's block size).
        num_labels: classes of a classification head.
        output: the output field the forward returns (logits).

    Returns:
        The model, mapping token ids (B, T) (or the data's dict of inputs) to the `output` tensor.

    Raises:
        ModelError: transformers is missing, the task or architecture is unknown, or the pretrained model is
            not available locally.
    """
    transformers = _transformers()
    if task not in TASKS:
        raise ModelError(f"model.task={task!r} is not a task ortflow knows; choose one of {sorted(TASKS)}.")
    auto = getattr(transformers, TASKS[task])
    settings = _config_settings(task, config, num_labels)
    if name_or_path:
        model = _pretrained(auto, name_or_path, settings)
        source = name_or_path
    else:
        model = _random_init(transformers, auto, model_type, settings, vocab_size, max_positions)
        source = f"random {model_type}"
    n_params = sum(p.numel() for p in model.parameters())
    log.info("built %s (%s, %s): %.2fM parameters", type(model).__name__, source, task, n_params / 1e6)
    return HFModel(model, output)


def _config_settings(task: str, config: dict[str, Any] | None, num_labels: int | None) -> dict[str, Any]:
    """The keyword arguments for the model's config: model.config, with no key/value cache for a causal LM (unless
    set) and model.num_labels when given."""
    settings = dict(config or {})
    if task == "causal_lm":
        settings.setdefault("use_cache", False)  # training: no key/value cache among the outputs
    if num_labels is not None:
        settings["num_labels"] = num_labels
    return settings


def _pretrained(auto: Any, name_or_path: str, settings: dict[str, Any]) -> nn.Module:
    """The pretrained model in a local directory or the local Hugging Face cache, with `settings` on its config.

    Raises:
        ModelError: the model is not available locally (nothing is downloaded), or it does not load.
    """
    try:
        if not _available_locally(name_or_path):
            raise OSError("no config.json there or in the cache")
        return auto.from_pretrained(name_or_path, local_files_only=True, **settings)
    except (OSError, ValueError) as err:
        raise ModelError(
            f"model.name_or_path={name_or_path!r} is not a model directory here nor a model in the local Hugging "
            f"Face cache, and ortflow downloads nothing ({str(err).strip().splitlines()[0]}). Give a local "
            "directory holding config.json and the weights, or set model.name_or_path=null for a random-"
            "initialised model."
        ) from None


def _random_init(
    transformers: Any,
    auto: Any,
    model_type: str | None,
    settings: dict[str, Any],
    vocab_size: int | None,
    max_positions: int | None,
) -> nn.Module:
    """A random-initialised `model_type` model, its vocabulary and context length following the data's.

    Raises:
        ModelError: no model_type, or one transformers does not know.
        ConfigError: model.config sets a special token id outside the vocabulary.
    """
    if not model_type:
        raise ModelError("model=hf needs model.name_or_path (pretrained) or model.model_type (random init).")
    try:
        model_config = transformers.AutoConfig.for_model(model_type, **settings)
    except ValueError as err:
        raise ModelError(f"model.model_type={model_type!r}: {str(err).splitlines()[0]}") from None
    if vocab_size is not None:
        model_config.vocab_size = vocab_size
        _special_tokens_within(model_config, vocab_size, settings, model_type)
    if max_positions is not None and "max_position_embeddings" not in settings:
        model_config.max_position_embeddings = max_positions  # gpt2's n_positions through its attribute map
    return auto.from_config(model_config)


SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "mask_token_id")


def _special_tokens_within(model_config: Any, vocab_size: int, settings: dict[str, Any], model_type: str) -> None:
    """A random-initialised model's special token ids within the data's vocabulary: an architecture's default that
    lies outside (phi3's pad_token_id 32000 beside a 256-byte vocabulary; its embedding's padding_idx must be a
    token) is cleared, the model then has no such token; one the user set there is refused.

    Raises:
        ConfigError: model.config.<key> names a token id outside the vocabulary.
    """
    for key in SPECIAL_TOKENS:
        value = getattr(model_config, key, None)
        if not isinstance(value, int) or 0 <= value < vocab_size:
            continue
        if key in settings:
            raise ConfigError(
                f"model.config.{key}={value} lies outside the model's vocabulary of {vocab_size} tokens (the data's: "
                f"data.vocab_size): a token id must be below {vocab_size}. Give an id the data's tokenizer uses, or "
                "leave the key out."
            )
        log.info("model=hf %s: %s=%d is outside the vocabulary of %d; cleared", model_type, key, value, vocab_size)
        setattr(model_config, key, None)


def check_vocabulary(model: nn.Module, vocab: int | None, name_or_path: str | None) -> None:
    """A pretrained model must embed every token id of the data's tokenizer.

    Raises:
        ConfigError: the model's vocabulary is smaller than the tokenizer's.
    """
    size = getattr(getattr(getattr(model, "model", None), "config", None), "vocab_size", None)
    if isinstance(model, HFModel) and vocab is not None and isinstance(size, int) and size < vocab:
        raise ConfigError(
            f"model.name_or_path={name_or_path!r} has a vocabulary of {size} tokens, smaller than the data's tokenizer "
            f"({vocab} tokens): its token ids would overflow the model's embeddings. Encode the data with the "
            "tokenizer the model was trained with (data.tokenizer=<its tokenizer.json>)."
        )
