"""Named workloads for `ortflow-bench --workload NAME`: the model sizes the performance docs measure, each a recipe
(or none) plus overrides, so a number in docs/performance.md is one command away.

A workload is nothing the bench could not be told by hand: `--workload gpt2-124m` is `--recipe none` followed by
its overrides (shown by `ortflow-bench --help`), and overrides given after it win over its own."""

from dataclasses import dataclass

NO_RECIPE = "none"  # --recipe none: the primary config alone, for a model=hf or model=custom config


@dataclass(frozen=True)
class Workload:
    recipe: str  # a recipe name, or NO_RECIPE
    overrides: tuple[str, ...]
    about: str


_D512 = (
    "model.d_model=512",
    "model.nhead=8",
    "model.dim_feedforward=2048",
    "model.num_layers=4",
    "data.block_size=128",
    "data.batch_size=16",
)
_GPT2_124M = (
    "model=hf",
    "model.model_type=gpt2",
    "++model.config.n_layer=12",
    "++model.config.n_embd=768",
    "++model.config.n_head=12",
    "data.block_size=256",
    "data.batch_size=8",
    "loss.class_dim=-1",  # 256 bytes and 256 positions: the logits' class dimension is the last
)
_QWEN2_LORA = (
    "model=hf",
    "model.model_type=qwen2",
    "++model.config.hidden_size=896",
    "++model.config.intermediate_size=4864",
    "++model.config.num_hidden_layers=24",
    "++model.config.num_attention_heads=14",
    "++model.config.num_key_value_heads=2",
    "+peft=lora",
    "optim.weight_decay=0.0",
    "data.block_size=256",
    "data.batch_size=4",
    "loss.class_dim=-1",
)

WORKLOADS: dict[str, Workload] = {
    "d512": Workload(
        "transformer", _D512, "the transformer recipe at d_model 512, 4 layers, block 128, batch 16 (13M)"
    ),
    "gpt2-124m": Workload(
        NO_RECIPE,
        _GPT2_124M,
        "GPT-2 124M's shape (12 layers, 768 wide, 12 heads), byte vocabulary: 86M, block 256, batch 8",
    ),
    "qwen2-lora": Workload(
        NO_RECIPE,
        _QWEN2_LORA,
        "Qwen2-0.5B's shape (24 layers, 896 wide, 14 heads, 2 KV heads), byte vocabulary: 359M frozen, LoRA r 8 on "
        "q/v (0.54M trainable), block 256, batch 4",
    ),
}


def subject(recipe: str, workload: str | None) -> list[str]:
    """The overrides that say what is benched: the workload's, or `+recipe=NAME` (nothing for --recipe none)."""
    if workload is not None:
        named = WORKLOADS[workload]
        return [*subject(named.recipe, None), *named.overrides]
    return [] if recipe == NO_RECIPE else [f"+recipe={recipe}"]


def describe(recipe: str, workload: str | None) -> str:
    """What a bench measured, for its table's title."""
    if workload is not None:
        return f"--workload {workload}"
    return "no recipe" if recipe == NO_RECIPE else f"+recipe={recipe}"


def help_text() -> str:
    return "\n".join(f"  {name}: {w.about}" for name, w in WORKLOADS.items())
