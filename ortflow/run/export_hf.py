"""`export.hf=true`: <run dir>/hf/, the trained transformers model as `save_pretrained` writes it (LoRA adapters
merged into the weights; `export.hf_adapter_only=true` keeps the adapter folder peft loads onto the base model), plus
the run's tokenizer as a fast tokenizer transformers loads, when the run's data has a tokenizer file (BPE, a
tokenizer.json). The folder is loaded back with transformers and its logits compared with the run's model.
"""

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ortflow.errors import ConfigError, OrtflowError
from ortflow.model.hf import HFModel, _transformers
from ortflow.step.batch import Inputs

log = logging.getLogger(__name__)

FOLDER = "hf"
END_OF_DOCUMENT = "<|endoftext|>"


def _peft_inside(inner: nn.Module) -> Any:
    try:
        import peft
    except ImportError:
        return None
    return inner if isinstance(inner, peft.PeftModel) else None


def check(model: nn.Module, adapter_only: bool) -> None:
    """Refuse, before training, a run whose model export.hf cannot write.

    Raises:
        ConfigError: the model is not a transformers model (model=hf), or export.hf_adapter_only=true without
            adapters or without a pretrained base the adapters could be loaded onto.
    """
    if not isinstance(model, HFModel):
        raise ConfigError(
            f"export.hf=true writes a Hugging Face transformers model with save_pretrained, and this run's model "
            f"({type(model).__name__}) is not one. Use model=hf, or export.onnx=true for an inference model of any "
            "architecture."
        )
    peft_model = _peft_inside(model.model)
    if adapter_only and peft_model is None:
        raise ConfigError(
            "export.hf_adapter_only=true keeps the LoRA adapter folder, and this run has no adapters; add +peft=lora "
            "or set export.hf_adapter_only=false."
        )
    if adapter_only and not getattr(peft_model.get_base_model().config, "_name_or_path", ""):
        raise ConfigError(
            "export.hf_adapter_only=true: the base model was random-initialised (model.name_or_path=null), so there "
            "is no base model the adapter folder could be loaded onto. Set export.hf_adapter_only=false (the merged "
            "model), or fine-tune a saved model (model.name_or_path=DIR)."
        )


def _tokenizer(run_files: dict[str, bytes]) -> Any:
    """The run's tokenizer file as a transformers fast tokenizer; None for a run without one (bytes)."""
    content = run_files.get("tokenizer.json")
    if content is None:
        return None
    from tokenizers import Tokenizer

    transformers = _transformers()
    backend = Tokenizer.from_str(content.decode())
    special = {}
    if backend.token_to_id(END_OF_DOCUMENT) is not None:
        special = {"eos_token": END_OF_DOCUMENT, "bos_token": END_OF_DOCUMENT, "pad_token": END_OF_DOCUMENT}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def _load(folder: Path, base_class: type, adapter_only: bool) -> nn.Module:
    if not adapter_only:
        return base_class.from_pretrained(folder, local_files_only=True)
    import peft

    config = peft.PeftConfig.from_pretrained(folder)
    base = base_class.from_pretrained(config.base_model_name_or_path, local_files_only=True)
    return peft.PeftModel.from_pretrained(base, folder)


@torch.no_grad()
def _max_relative_difference(run_model: nn.Module, loaded: nn.Module, inputs: Inputs) -> float:
    training = run_model.training
    run_model.eval()
    loaded.eval()
    try:
        expected = run_model(inputs) if isinstance(inputs, torch.Tensor) else run_model(**inputs)
        wrapped = HFModel(loaded, run_model.output)
        got = wrapped(inputs) if isinstance(inputs, torch.Tensor) else wrapped(**inputs)
    finally:
        run_model.train(training)
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1.0))


def save(
    model: HFModel, run_files: dict[str, bytes], inputs: Inputs, run_dir: Path, adapter_only: bool, tolerance: float
) -> dict[str, Any]:
    """Write <run dir>/hf/ from the trained `model`, load it back with transformers and compare its outputs on
    `inputs` (a validation batch) with the run's.

    Returns:
        What run.json records: the folder, whether it holds adapters only, its tokenizer, the largest relative
        difference of the reloaded model's outputs.

    Raises:
        OrtflowError: the reloaded model's outputs differ by more than `tolerance` (relative).
    """
    folder = run_dir / FOLDER
    inner = model.model
    peft_model = _peft_inside(inner)
    merge = peft_model is not None and not adapter_only
    saved = copy.deepcopy(peft_model).merge_and_unload() if merge else inner  # the run's model keeps its adapters
    base = peft_model.get_base_model() if peft_model is not None else inner
    cache = getattr(saved.config, "use_cache", None)
    if cache is not None and not adapter_only:
        saved.config.use_cache = True  # trained without the key/value cache; generation wants it
    try:
        saved.save_pretrained(folder)
    finally:
        if cache is not None and not adapter_only:
            saved.config.use_cache = cache
    tokenizer = _tokenizer(run_files)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    loaded = _load(folder, type(base), adapter_only)
    difference = _max_relative_difference(model, loaded, inputs)
    if not difference <= tolerance:
        raise OrtflowError(
            f"export.hf: the model transformers loads from '{folder}' gives outputs that differ from the run's by "
            f"{difference:.2e} (relative), above export.tolerance={tolerance}. The folder does not hold the trained "
            "model; report this with the run's config."
        )
    log.info("export.hf: %s (%s), outputs within %.1e of the run's", folder, type(saved).__name__, difference)
    return {
        "path": str(folder),
        "adapter_only": adapter_only,
        "merged_lora": peft_model is not None and not adapter_only,
        "tokenizer": tokenizer is not None,
        "max_rel_diff": difference,
    }
