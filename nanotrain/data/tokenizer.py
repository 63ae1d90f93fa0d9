"""Tokenizers: UTF-8 bytes (the default, nothing to download) or a Hugging Face `tokenizer.json`.

Both expose the same four things the pipeline needs: `encode_batch`, `vocab_size`,
`separator_id` (appended after every document, so the model sees where one ends) and a
`fingerprint` that names the tokenised cache.

Separator choice for `byte`: id 0, the NUL byte. It keeps the vocabulary at exactly 256 (the
default `model.vocab_size`), and NUL essentially never occurs in text or source code, so it is
unambiguous in practice. A `tokenizer.json` uses its own end-of-text special token.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional, Protocol, Sequence

import numpy as np

from nanotrain.config.paths import FILE, check_path
from nanotrain.data.errors import DataError

BYTE = "byte"

# End-of-document tokens of common tokenizer families, tried in this order: GPT-2/NeoX and
# Qwen2/2.5/3, Llama 3 and SmolLM3, Llama 2/Mistral/Mixtral, Gemma, then generic spellings
# (tests/test_family_tokenizers.py checks the first three families' pick).
SEPARATOR_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<eot>", "[EOS]", "[SEP]")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    separator_id: int
    fingerprint: str

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Token id = UTF-8 byte value; 256 ids; documents end with id 0 (see module docstring)."""

    name = BYTE
    vocab_size = 256
    separator_id = 0
    fingerprint = "byte-v1"

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class JsonTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (BPE, Unigram, ...), as the model's vocabulary.

    Texts are encoded without the tokenizer's own special tokens (no BOS from a post-processor),
    so the separator is the only structure added and packing stays the same for every tokenizer.
    """

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise DataError(
                f"data.tokenizer: {path!r} needs the optional `tokenizers` package; "
                f"pip install tokenizers (or the 'dev' extra), or use 'byte'"
            ) from None
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as exc:  # noqa: BLE001 - the Rust side raises a bare Exception
            first = (str(exc).splitlines() or [""])[0][:200]
            raise DataError(
                f"data.tokenizer: cannot load {path!r} as a Hugging Face "
                f"tokenizer.json ({first}); use 'byte' or a valid file"
            ) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.name = path
        self.vocab_size = max(vocab.values()) + 1  # ids may be sparse; the model needs max+1
        sep = next((vocab[t] for t in SEPARATOR_TOKENS if t in vocab), None)
        if sep is None:
            raise DataError(
                f"data.tokenizer: {path!r} has none of the end-of-text tokens "
                f"{list(SEPARATOR_TOKENS)}; add one as a special token"
            )
        self.separator_id = sep
        with open(path, "rb") as fh:
            self.fingerprint = "json-" + hashlib.sha256(fh.read()).hexdigest()[:16]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        """The id of ``token`` (a vocabulary entry or an added token), None if it has none."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        """The token of ``token_id``, None outside the vocabulary."""
        return self._tok.id_to_token(int(token_id))


def check_tokenizer_path(spec: str) -> None:
    """The cheap part of loading: the file is there, a regular file we may read (a FIFO is never
    opened), by the one path checker; used before a job is submitted."""
    if spec != BYTE:
        check_path(
            "data.tokenizer",
            spec,
            FILE,
            DataError,
            missing=f"data.tokenizer: no such file {spec!r}; use 'byte' or a path to a tokenizer.json",
        )


def load_tokenizer(spec: str, vocab_size: Optional[int] = None) -> Tokenizer:
    """The tokenizer named by `data.tokenizer` (`byte` or a tokenizer.json path), checked against
    `model.vocab_size` when given.

    Raises:
        DataError: the file is missing or unreadable, `tokenizers` is not installed, the file has
            no end-of-text token, or its vocabulary is larger than `vocab_size`.
    """
    check_tokenizer_path(spec)
    tok: Tokenizer = ByteTokenizer() if spec == BYTE else JsonTokenizer(os.path.expanduser(spec))
    if vocab_size is not None and tok.vocab_size > vocab_size:
        raise DataError(
            f"model.vocab_size={vocab_size} is smaller than the vocabulary of "
            f"data.tokenizer={spec!r} ({tok.vocab_size} tokens); "
            f"set model.vocab_size >= {tok.vocab_size}"
        )
    return tok


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id: 2 bytes per token up to 65536 ids."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
