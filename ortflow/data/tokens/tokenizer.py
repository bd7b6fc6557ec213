"""Tokenizers for language-model data, chosen by `data.tokenizer`:

- `bytes` (default): every byte is a token (vocabulary 256, any encoding, nothing to train or ship). Documents are
  separated by byte 0, which a text file never holds (files with a NUL byte are refused as binary).
- `bpe`: a byte-level BPE trained on the corpus (or a bounded sample of it) with Hugging Face `tokenizers`, with
  `data.bpe_vocab_size` tokens, `<|endoftext|>` (id 0) between documents.
- a path to a `tokenizer.json` (or a folder holding one), or the name of a model in the local Hugging Face cache
  (looked up offline; nothing is downloaded).

ortflow's own BPE splits text into words with one plain regex (SPLIT_PATTERN, ASCII classes only, so byte classes
split as the Rust tokenizer does) before the byte-level merges. That lets the prepare step encode each distinct word
once and reuse it (ortflow/data/tokens/encode.py: several times the throughput of encoding whole texts with
`tokenizers`), while the saved tokenizer.json encodes a prompt exactly as the corpus was encoded.
"""

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortflow.errors import DataError

BYTES, BPE = "bytes", "bpe"
SEPARATOR = "<|endoftext|>"
# Words: letters with one leading space, up to 3 digits with one leading space, other non-space characters with
# one leading space, runs of whitespace. No lookahead, so splitting a word again yields the word itself.
SPLIT_PATTERN = r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^ \t\n\r\fA-Za-z0-9]+|[ \t\n\r\f]+"
# End-of-document tokens of common pretrained tokenizers, in the order they are looked for.
KNOWN_SEPARATORS = (SEPARATOR, "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits (vocabulary <= 65,536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class ByteTokenizer:
    """Bytes as tokens. Decoding drops document separators and replaces invalid UTF-8."""

    kind = BYTES
    vocab_size = 256
    separator = 0
    identity = BYTES
    json: str | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (trained here or loaded from a tokenizer.json).

    Attributes:
        kind: "bpe" for ortflow's own BPE (its words can be encoded one at a time), "pretrained" otherwise.
        identity: "sha256:<first 16 hex digits of the tokenizer.json's SHA-256>": the same file, the same ids.
        separator: the id put between documents, or None when the tokenizer has no end-of-text token.
    """

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer = tokenizer
        self.json = text
        self.kind = BPE if is_ortflow_bpe(json.loads(text)) else "pretrained"
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.identity = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
        self.separator = next(
            (i for name in KNOWN_SEPARATORS if (i := tokenizer.token_to_id(name)) is not None),
            None,
        )
        # Text that spells a special token (a corpus quoting "<|endoftext|>") is encoded as text, as the corpus was.
        tokenizer.encode_special_tokens = True

    @classmethod
    def from_str(cls, text: str, origin: str) -> "HFTokenizer":
        """Raises DataError naming `origin` when `text` is not a tokenizer.json that `tokenizers` can load."""
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_str(text), text)
        except Exception as err:  # tokenizers raises a bare Exception for JSON it cannot read
            reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise DataError(
                f"data.tokenizer: '{origin}' is not a tokenizer file that Hugging Face tokenizers can load "
                f"({reason}). Give a tokenizer.json, data.tokenizer=bpe to train one, or data.tokenizer=bytes."
            ) from None

    @classmethod
    def from_file(cls, path: Path) -> "HFTokenizer":
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise DataError(f"data.tokenizer: cannot read '{path}' ({err}).") from None
        return cls.from_str(text, str(path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


Tokenizer = ByteTokenizer | HFTokenizer


def is_ortflow_bpe(spec: dict) -> bool:
    """Whether a tokenizer.json is ortflow's own BPE (SPLIT_PATTERN then byte-level): its words encode alone."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    return (
        (spec.get("model") or {}).get("type") == "BPE"
        and len(steps) == 2
        and steps[0].get("type") == "Split"
        and steps[0].get("pattern", {}).get("Regex") == SPLIT_PATTERN
        and steps[1].get("type") == "ByteLevel"
        and steps[1].get("use_regex") is False
        and not spec.get("normalizer")
    )


def train_bpe(texts: Iterable[str], vocab_size: int, show_progress: bool = False) -> HFTokenizer:
    """A byte-level BPE with `vocab_size` tokens (fewer if the text runs out of pairs to merge), trained on `texts`
    with Hugging Face tokenizers; `<|endoftext|>` is id 0 and the 256 byte symbols follow, so every text encodes."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HF

    tokenizer = HF(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SEPARATOR],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return HFTokenizer(tokenizer, tokenizer.to_str())


@dataclass(frozen=True)
class TokenizerChoice:
    """What `data.tokenizer` names: a kind (bytes, bpe, file) and, for a file, its path and SHA-256."""

    kind: str
    path: Path | None = None
    sha256: str | None = None

    def identity(self, bpe_vocab_size: int, bpe_train_bytes: int) -> dict:
        """What keys the cache for this choice."""
        if self.kind == BPE:
            return {"kind": BPE, "vocab_size": bpe_vocab_size, "train_bytes": bpe_train_bytes, "pattern": SPLIT_PATTERN}
        return {"kind": self.kind, "sha256": self.sha256}


def _hf_cache_file(name: str) -> Path | None:
    """`tokenizer.json` of model `name` in the local Hugging Face cache, without any network access."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id=name, filename="tokenizer.json")
    except Exception:  # an invalid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def choose(spec: str) -> TokenizerChoice:
    """The tokenizer `data.tokenizer` names.

    Raises:
        DataError: a path that does not exist, a folder without tokenizer.json, or a name that is neither a file
            nor a model in the local Hugging Face cache.
    """
    if spec in (BYTES, BPE):
        return TokenizerChoice(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        cached = None if "/" in spec.strip("/") and Path(spec).is_absolute() else _hf_cache_file(spec)
        if cached is None:
            raise DataError(
                f"data.tokenizer: '{spec}' is not bytes, bpe, a tokenizer.json file, or a model in the local Hugging "
                "Face cache (looked up offline; nothing is downloaded). Give a path to a tokenizer.json, or "
                "data.tokenizer=bpe to train one on the corpus."
            )
        path = cached
    path = path.absolute()
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as err:
        raise DataError(f"data.tokenizer: cannot read '{path}': {err.strerror}.") from None
    return TokenizerChoice("file", path, digest)
