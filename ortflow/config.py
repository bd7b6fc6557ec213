"""Structured-config schema: one dataclass per config group, stored in Hydra's ConfigStore by `store_schemas`.

The YAML files under conf/ choose values; these classes fix which keys exist and their types, so a typo, a
wrong type or an unknown key stops Hydra before anything runs. Groups with several shapes (model, data,
accel) register one schema per option; each option's YAML names its schema first in its defaults list.
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from annotated_types import Ge, Gt, Interval, Len
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, SI

from ortflow.ranges import ranged

PROBABILITY = Interval(ge=0, lt=1)  # dropout and friends: 1 would drop everything
FRACTION = Interval(gt=0, lt=1)
SEED = Interval(ge=0, le=2**32 - 1)  # numpy's generator takes seeds below 2**32


# ----------------------------------------------------------------------------------------------------- model
@dataclass
class TransformerModelConfig:
    _target_: str = "ortflow.model.transformer.build_transformer"
    vocab_size: int | None = ranged(None, Ge(1))  # null: the data's vocabulary (data.vocab_size, from its tokenizer)
    d_model: int = ranged(128, Ge(1))
    nhead: int = ranged(4, Ge(1))
    num_layers: int = ranged(2, Ge(1))
    dim_feedforward: int = ranged(2048, Ge(1))  # nn.TransformerEncoderLayer's default
    dropout: float = ranged(0.1, PROBABILITY)  # nn.TransformerEncoderLayer's default
    causal: bool = True  # attend only to earlier positions (a language model must not see the next token)
    freeze: list[str] = field(default_factory=list)  # globs of parameters/modules that do not train (model/freeze.py)


# The final metrics every run reports (run.json "metrics"), besides its loss's eval metrics (eval/accuracy for
# classification, eval/mae for regression: ortflow/step/loss.py); a sweep job can return any of them as its objective.
FINAL_METRICS = ("train/loss", "eval/loss", "perf/samples_per_sec")


@dataclass
class MLPModelConfig:
    _target_: str = "ortflow.model.mlp.build_mlp"
    in_features: int = ranged(64, Ge(1))  # 8x8 digits
    num_classes: int = ranged(10, Ge(1))  # outputs per sample (1 for one regression target)
    hidden: list[int] = ranged([128, 64], each=Ge(1))
    dropout: float = ranged(0.0, PROBABILITY)
    freeze: list[str] = field(default_factory=list)  # globs of parameters/modules that do not train (model/freeze.py)


@dataclass
class HFModelConfig:
    """model=hf: a Hugging Face transformers model (ortflow/model/hf.py)."""

    _target_: str = "ortflow.model.hf.build_hf_model"
    task: str = "causal_lm"  # causal_lm | masked_lm | sequence_classification | token_classification
    name_or_path: str | None = None  # a local model dir or a name in the local HF cache; null: random init
    model_type: str | None = "gpt2"  # the architecture of a random-initialised model
    config: dict[str, Any] = field(default_factory=dict)  # the architecture's config keys (++model.config.n_layer=2)
    vocab_size: int | None = ranged(None, Ge(1))  # random init: the data's vocabulary
    max_positions: int | None = ranged(None, Ge(1))  # random init: the context length (the data's block size)
    num_labels: int | None = ranged(None, Ge(2))  # classification heads: classes
    output: str = "logits"  # the output field the forward returns
    freeze: list[str] = field(default_factory=list)  # globs of parameters/modules that do not train (model/freeze.py)


@dataclass
class ResNetModelConfig:
    _target_: str = "ortflow.model.resnet.build_resnet"
    num_classes: int = ranged(10, Ge(1))
    in_channels: int = ranged(3, Ge(1))  # 3 for RGB images (data=images and data=image_folder give RGB)
    width: int = ranged(16, Ge(1))  # channels of the first stage; each later stage doubles them
    blocks: list[int] = ranged([1, 1, 1], Len(1, 8), each=Ge(1))  # BasicBlocks per stage (CIFAR ResNet-20: [3, 3, 3])
    freeze: list[str] = field(default_factory=list)  # globs of parameters/modules that do not train (model/freeze.py)


@dataclass
class TorchvisionModelConfig:
    _target_: str = "ortflow.model.torchvision_models.build_torchvision"
    name: str = "resnet18"  # a torchvision.models builder (torchvision.models.list_models()) or class name
    num_classes: int = ranged(10, Ge(1))
    weights: str | None = None  # null: random init, no download; a weights name (e.g. DEFAULT) downloads them
    kwargs: dict[str, Any] = field(default_factory=dict)  # the builder's other keyword arguments
    freeze: list[str] = field(default_factory=list)  # globs of parameters/modules that do not train (model/freeze.py)


class LoraBias(Enum):
    none = "none"
    all = "all"
    lora_only = "lora_only"


@dataclass
class LoraConfig:
    """+peft=lora: LoRA adapters through the peft library (ortflow/model/lora.py)."""

    method: str = "lora"
    r: int = ranged(8, Ge(1))  # the adapters' rank
    alpha: float = ranged(16.0, Gt(0))  # the adapters' output is scaled by alpha / r
    dropout: float = ranged(0.0, PROBABILITY)  # dropout on the adapters' input
    target_modules: list[str] | None = None  # null: peft's defaults for the transformers architecture
    bias: LoraBias = LoraBias.none  # which biases train too


# ------------------------------------------------------------------------------------------------------ data
@dataclass
class TextDataConfig:
    _target_: str = "ortflow.data.text.build_text_data"
    # `python_docs` (embedded corpus), a text file, a folder of text files, a .jsonl or .parquet file, a dataset saved
    # with Hugging Face datasets.save_to_disk, or a folder ortflow-prepare wrote. Raw text is prepared once into the
    # token cache (ortflow/data/tokens/prepare.py) and streamed from disk.
    source: str = "python_docs"
    # bytes (vocabulary 256) | bpe (trained on the corpus) | a tokenizer.json path | a model in the local HF cache
    tokenizer: str = "bytes"
    bpe_vocab_size: int = ranged(8192, Interval(ge=257, le=2**20))  # data.tokenizer=bpe: tokens, separator included
    # data.tokenizer=bpe: the tokenizer trains on at most this much text, an evenly spread sample of a larger corpus.
    bpe_train_bytes: int = ranged(100_000_000, Ge(1))
    text_field: str = "text"  # the field holding the text in JSON lines, parquet and saved datasets
    cache_dir: str | None = None  # the token cache; null: $XDG_CACHE_HOME/ortflow/tokens or ~/.cache/ortflow/tokens
    num_proc: int | None = ranged(None, Ge(1))  # processes that encode the corpus; null: the CPUs available
    # Filled by the runner from the tokenizer (the model's vocabulary follows it); leave null.
    vocab_size: int | None = ranged(None, Ge(1))
    block_size: int = ranged(64, Interval(ge=1, le=65536))  # tokens per sequence
    batch_size: int = ranged(32, Interval(ge=1, le=65536))  # per rank
    val_fraction: float = ranged(0.1, FRACTION)  # share of the bytes held out for evaluation, taken from the end
    seed: int = ranged(SI("${seed}"), SEED)  # seeds the training blocks
    num_workers: int = ranged(0, Ge(0))  # DataLoader workers for the validation windows
    # false: the model is sequence-first (e.g. nn.Transformer layers with batch_first=False and no transpose of its
    # own); it then gets (T, B) token ids and its (T, B, C) outputs are transposed back.
    batch_first: bool = True


@dataclass
class DigitsDataConfig:
    _target_: str = "ortflow.data.digits.build_digits_data"
    batch_size: int = ranged(64, Interval(ge=1, le=65536))
    val_fraction: float = ranged(0.25, FRACTION)  # stratified held-out share of the 1,797 images
    seed: int = ranged(SI("${seed}"), SEED)
    num_workers: int = ranged(0, Ge(0))


@dataclass
class DiabetesDataConfig:
    _target_: str = "ortflow.data.diabetes.build_diabetes_data"
    batch_size: int = ranged(32, Interval(ge=1, le=65536))
    val_fraction: float = ranged(0.2, FRACTION)  # held-out share of the 442 patients
    seed: int = ranged(SI("${seed}"), SEED)
    num_workers: int = ranged(0, Ge(0))


class ImageCrop(Enum):
    random_resized = "random_resized"  # RandomResizedCrop to image_size, covering crop_scale of the image's area
    center = "center"  # the evaluation crop: shorter side resized to `resize`, center crop of image_size


@dataclass
class ImageDataConfig:
    """The keys data=images and data=image_folder share: batches and transforms (torchvision references' and
    timm's vocabulary)."""

    _target_: str = MISSING
    image_size: int = ranged(32, Interval(ge=8, le=4096))  # side of the square images the model gets
    resize: int | None = ranged(None, Ge(1))  # evaluation: shorter side before the center crop; null = image_size
    crop: ImageCrop = ImageCrop.center  # the training crop
    crop_scale: list[float] = ranged([0.08, 1.0], Len(2, 2), each=Interval(gt=0, le=1))  # random_resized's area share
    hflip: float = ranged(0.5, Interval(ge=0, le=1))  # training: probability of a horizontal flip
    mean: list[float] = ranged([0.485, 0.456, 0.406], Len(3, 3))  # per-channel Normalize (RGB)
    std: list[float] = ranged([0.229, 0.224, 0.225], Len(3, 3), each=Gt(0))
    batch_size: int = ranged(64, Interval(ge=1, le=65536))
    seed: int = ranged(SI("${seed}"), SEED)  # seeds the training order and augmentation (data=images: the drawing)
    num_workers: int = ranged(0, Ge(0))


@dataclass
class ImagesDataConfig(ImageDataConfig):
    _target_: str = "ortflow.data.images.embedded.build_images_data"
    mean: list[float] = ranged([0.5, 0.5, 0.5], Len(3, 3))  # the drawn colours are uniform in [0, 1]
    std: list[float] = ranged([0.3, 0.3, 0.3], Len(3, 3), each=Gt(0))
    train_images: int = ranged(5000, Ge(1))  # drawn images, classes balanced
    val_images: int = ranged(1000, Ge(1))
    noise: float = ranged(0.08, Interval(ge=0, le=1))  # standard deviation of the pixel noise (intensities 0..1)


@dataclass
class ImageFolderDataConfig(ImageDataConfig):
    _target_: str = "ortflow.data.images.folder.build_image_folder_data"
    # torchvision's classification references': 224 crops of 256, RandomResizedCrop in training
    image_size: int = ranged(224, Interval(ge=8, le=4096))
    resize: int | None = ranged(256, Ge(1))
    crop: ImageCrop = ImageCrop.random_resized
    batch_size: int = ranged(32, Interval(ge=1, le=65536))
    root: str = MISSING  # the folder holding train/<class>/<images> and val/<class>/<images>
    verify: bool = True  # read every image's header before training (a bad file stops the run at start-up)


# ------------------------------------------------------------------------------------------------------ loss
@dataclass
class CrossEntropyLossConfig:
    _target_: str = "ortflow.step.loss.CrossEntropy"
    ignore_index: int = -100  # targets equal to it carry no loss and no accuracy (padding)
    label_smoothing: float = ranged(0.0, Interval(ge=0, le=1))
    # the logits' class dimension: 1 (torch's layout) or -1 (ortflow's, classes last); null = from the shapes
    class_dim: int | None = None


@dataclass
class MSELossConfig:
    _target_: str = "ortflow.step.loss.MSE"


@dataclass
class BCEWithLogitsLossConfig:
    _target_: str = "ortflow.step.loss.BCEWithLogits"
    pos_weight: float | None = ranged(None, Gt(0))  # weight of positive targets; null = 1


# ----------------------------------------------------------------------------------------- single-shape groups
@dataclass
class DistributedConfig:
    """Process wrappers around the model, innermost first, and how the processes are started."""

    name: str = "none"  # none | ddp | deepspeed
    # Innermost first. `accel` marks where the accel mode's own wrapper (ORTModule) sits; the others are
    # ddp (torch DistributedDataParallel), deepspeed (DeepSpeed's engine) and dp (torch.nn.DataParallel, refused with
    # ORTModule).
    wrappers: list[str] = ranged(["accel"], Len(1, 4))
    backend: str = "gloo"  # gloo on CPU (nccl needs GPUs)
    nproc_per_node: int = ranged(
        1, Ge(1)
    )  # processes on this machine; > 1 and not under torchrun: ortflow starts torchrun itself
    nnodes: int = ranged(1, Ge(1))  # machines; each runs the same command with its own node_rank
    node_rank: int = ranged(0, Ge(0))
    rdzv_endpoint: str = "127.0.0.1:29500"  # host:port of node 0, reachable from every node (multi-node)
    # Multi-node: how long the nodes wait for each other at the start before the run fails (torchrun's rendezvous).
    rdzv_timeout_s: int = ranged(300, Ge(1))
    timeout_s: int = ranged(
        60, Ge(1)
    )  # a collective waiting longer than this (a peer died) fails the rank with an error
    # distributed=deepspeed: the ZeRO stage (0: DeepSpeed's data parallelism; 1: optimizer state partitioned over
    # the ranks; 2: gradients too; 3, parameters too, is refused), and ZeRO's communication settings
    zero_stage: int = ranged(0, Interval(ge=0, le=3))
    overlap_comm: bool = False  # ZeRO: reduce gradients while the backward pass runs
    reduce_bucket_size: int = ranged(500_000_000, Ge(1))  # ZeRO: elements reduced at a time


class OrtLogLevel(Enum):
    FATAL = "FATAL"
    ERROR = "ERROR"
    WARNING = "WARNING"
    INFO = "INFO"
    VERBOSE = "VERBOSE"


@dataclass
class DebugConfig:
    """ORTModule DebugOptions. Saved ONNX files go to <run dir>/onnx/."""

    save_onnx: bool = False
    log_level: OrtLogLevel = OrtLogLevel.WARNING
    onnx_prefix: str = "model"


class OptimName(Enum):
    adamw = "adamw"
    sgd = "sgd"


@dataclass
class OptimConfig:
    name: OptimName = OptimName.adamw
    lr: float = ranged(1e-3, Interval(gt=0, le=10))  # peak learning rate (the scheduler scales it)
    weight_decay: float = ranged(0.01, Interval(ge=0, le=1))
    betas: list[float] = ranged([0.9, 0.999], Len(2, 2), each=Interval(ge=0, lt=1))  # adamw only
    eps: float = ranged(1e-8, Interval(gt=0, le=1))  # adamw only
    momentum: float = ranged(0.0, Interval(ge=0, lt=1))  # sgd only
    # adamw only: torch's fused kernel, one pass over each tensor, for parameters on the CPU or CUDA (accel=artifacts:
    # on ORT's own buffers); false: torch's default loop (accel=artifacts: ORT's AdamW graph, moments in ORT's state)
    fused: bool = True


class SchedulerName(Enum):
    constant = "constant"
    cosine = "cosine"  # linear warmup, then cosine decay to min_lr_ratio * lr at trainer.max_steps


@dataclass
class SchedulerConfig:
    name: SchedulerName = SchedulerName.constant
    warmup_steps: int = ranged(0, Ge(0))  # longer than trainer.max_steps: clamped to it, with a warning
    min_lr_ratio: float = ranged(0.1, Interval(ge=0, le=1))


class OnNonFinite(Enum):
    stop = "stop"  # stop the run, naming the step; the last checkpoint stays the last good state
    skip = "skip"  # drop that step's update and go on (up to trainer.max_skipped_steps in a row)


@dataclass
class CheckpointConfig:
    every: int = ranged(
        100, Ge(0)
    )  # write a full checkpoint every N steps (and always at the end); 0 = only at the end
    keep: int | None = ranged(3, Ge(1))  # how many step checkpoints to keep (oldest deleted first); null = keep all


class Allocator(Enum):
    steady = "steady"  # glibc malloc's mmap and trim thresholds fixed (ortflow/allocator.py): faster, steadier steps
    system = "system"  # glibc's own adaptive thresholds


class StopMode(Enum):
    min = "min"  # lower is better (a loss)
    max = "max"  # higher is better (accuracy)


@dataclass
class EarlyStoppingConfig:
    """Stop when an eval metric has not improved by more than min_delta for `patience` evaluations in a row."""

    metric: str | None = None  # an eval metric the run reports (eval/loss, eval/accuracy, eval/mae); null = off
    mode: StopMode = StopMode.min
    patience: int = ranged(3, Ge(1))  # evaluations without improvement before stopping
    min_delta: float = ranged(0.0, Ge(0))  # smaller changes do not count as improvements


# trainer.precision: fp32, or torch's CPU autocast (matmuls, linear layers and convolutions computed in bf16; weights,
# optimizer state, normalisation, softmax, losses and reductions fp32), or auto (bf16-mixed where the CPU has bf16
# units, fp32 elsewhere; ortflow/machine.py).
FP32, BF16, AUTO = "fp32", "bf16-mixed", "auto"
PRECISIONS = (FP32, BF16, AUTO)


@dataclass
class TrainerConfig:
    max_steps: int = ranged(100, Ge(1))  # optimizer steps
    eval_every: int = ranged(50, Ge(0))  # evaluate every N steps and at the end; 0 = only at the end
    eval_batches: int | None = ranged(None, Ge(1))  # cap on validation batches per evaluation; null = the whole split
    log_every: int = ranged(10, Ge(1))  # steps between TensorBoard/terminal loss points
    grad_clip: float | None = ranged(None, Gt(0))  # max global gradient norm; null = no clipping
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # null: a new run. auto: continue the latest valid checkpoint in this run dir (a fresh start if it has none).
    # A path: continue from that checkpoint file (any accel mode's checkpoint loads in any other).
    resume: str | None = None
    # Resuming on data whose fingerprint differs from the checkpoint's (a changed file or data setting) is refused;
    # true continues on the new data (recorded). Another tokenizer is always refused.
    allow_data_change: bool = False
    on_nonfinite: OnNonFinite = OnNonFinite.stop  # what a NaN/inf loss, gradient norm or eval metric does
    # Stop when the training loss, averaged over a log window, exceeds this many times the first step's loss (the
    # model far worse than as built: a learning rate too high). null = off.
    divergence_factor: float | None = ranged(2.0, Gt(1))
    # A smoke run of any recipe: N steps, one eval batch at the end, no checkpoints. 0 = off.
    fast_dev_run: int = ranged(0, Ge(0))
    max_skipped_steps: int = ranged(10, Ge(0))  # with on_nonfinite=skip: stop after this many non-finite steps in a row
    # Micro-batches per optimizer step: gradients of N batches of data.batch_size are averaged, as one step on a
    # batch N times larger would compute them (a step then draws N batches; samples/s counts all of them).
    accumulate_grad_batches: int = ranged(1, Interval(ge=1, le=4096))
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    precision: str = FP32  # fp32 | bf16-mixed | auto (PRECISIONS above)
    allocator: Allocator = Allocator.steady  # steady | system (ortflow/allocator.py)


@dataclass
class ExportConfig:
    """The trained model as an inference ONNX file, <run dir>/model.onnx, checked against ONNX Runtime."""

    onnx: bool = False
    opset: int = ranged(17, Interval(ge=14, le=20))  # 17: LayerNormalization is one op; torch 2.6 exports up to 20
    # The largest |ONNX Runtime - torch| difference accepted on validation batches, relative to the outputs' largest
    # magnitude (at least 1); above it the run fails and the file is removed.
    tolerance: float = ranged(1e-4, Interval(gt=0, lt=1))
    # true: <run dir>/hf/, the trained transformers model (model=hf) by save_pretrained, with the run's tokenizer,
    # loaded back with transformers and checked against the run's outputs (export.tolerance); LoRA merged in.
    hf: bool = False
    hf_adapter_only: bool = False  # with +peft=lora: hf/ holds the adapter folder peft loads onto the base model
    # true: <run dir>/device/, the trained model as training artifacts a device trains with ORT's on-device API
    # (what ortflow-export-artifacts writes), checked in a process without torch; device_web adds the browser page
    # (onnxruntime-web vendored with npm).
    device: bool = False
    device_web: bool = False


@dataclass
class MLflowConfig:
    """logger=[tensorboard,mlflow]: the run in an MLflow tracking store (ortflow/report/mlflow_sink.py)."""

    enabled: bool = False
    # null: a local store, sqlite:///<cwd>/outputs/mlflow.db (artifacts in outputs/mlartifacts/); any server's URI
    tracking_uri: str | None = None
    experiment: str | None = None  # null: the recipe's name (+recipe=NAME), else "ortflow"
    # false: a missing `mlflow` package or an unusable URI is a warning and the run trains without MLflow
    required: bool = True
    # true: the final weights (checkpoints/final.pt) and, with export.hf, the hf/ folder as artifacts under model/
    log_model: bool = False


@dataclass
class LoggerConfig:
    tensorboard: bool = True  # write <run dir>/tensorboard/
    csv: bool = False  # logger=[tensorboard,csv]: every log point to <run dir>/metrics.csv (step,name,value rows)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    progress: bool = True  # progress bar on the terminal (a plain line every trainer.log_every steps without one)
    verbose: bool = False  # other libraries' messages (ORT, torch) and ortflow's INFO lines on the terminal too


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    accel: Any = MISSING
    loss: Any = MISSING
    distributed: DistributedConfig = MISSING
    debug: DebugConfig = MISSING
    optim: OptimConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING
    export: ExportConfig = field(default_factory=ExportConfig)
    peft: Any = None  # +peft=lora: adapters instead of full fine-tuning (conf/peft/)
    seed: int = ranged(0, SEED)  # seeds python, numpy, torch, ORT and the data order
    objective: str = "eval/loss"  # the metric a sweep job returns (Optuna optimises it): see validate.objectives
    # The loop's callbacks, by name: each a `_target_` (a subclass of ortflow.run.callbacks.Callback) and its
    # arguments, e.g. +callbacks.stop_at._target_=my_pkg.StopAt (ortflow/run/callbacks.py)
    callbacks: dict[str, Any] = field(default_factory=dict)


# Per-option schemas live in the `schema/<group>` groups; an option's YAML pulls its schema in with
# `- /schema/<group>/<option>@_here_`, so `ortflow --help` lists only the real options under <group>. Each accel
# engine module declares its own (ortflow/accel/<mode>.py: Settings).
_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {
        "transformer": TransformerModelConfig,
        "mlp": MLPModelConfig,
        "hf": HFModelConfig,
        "resnet": ResNetModelConfig,
        "torchvision": TorchvisionModelConfig,
    },
    "data": {
        "text": TextDataConfig,
        "digits": DigitsDataConfig,
        "diabetes": DiabetesDataConfig,
        "images": ImagesDataConfig,
        "image_folder": ImageFolderDataConfig,
    },
    "peft": {"lora": LoraConfig},
    "loss": {"cross_entropy": CrossEntropyLossConfig, "mse": MSELossConfig, "bce_with_logits": BCEWithLogitsLossConfig},
}


def store_schemas(cs: ConfigStore) -> None:
    """Store the schema of every config group in Hydra's ConfigStore `cs` (the engines' own schemas are stored by
    `ortflow.api.register_configs`)."""
    cs.store(name="config_schema", node=Config)
    for group, schemas in _SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
