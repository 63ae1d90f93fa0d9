"""The run's tokenizer as Hugging Face files (``tokenizer.json`` + ``tokenizer_config.json``), for export.

The byte tokenizer (id = UTF-8 byte value) becomes a ``tokenizers`` BPE with no merges over the
256 byte-level symbols (the GPT-2 byte -> unicode table of ``ByteLevel``), no normalizer, no
regex split and no post-processor: every byte is one token whose id is the byte's value, so
``AutoTokenizer`` encodes every text to exactly the ids training saw (tests/test_hf.py checks it on
ASCII, multi-byte UTF-8 and control characters). Its end-of-document token is id 0 (the NUL
byte, shown by ``ByteLevel`` as ``Ā``). A ``tokenizer.json`` run exports its file as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from nanotrain.data.tokenizer import BYTE, load_tokenizer


def byte_tokenizer_json() -> str:
    """tokenizer.json text of the byte tokenizer (built with the ``tokenizers`` package)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte-level symbols
    table = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(table.values())
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode symbol table, the one ``ByteLevel`` applies."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def export_tokenizer(spec: str, out_dir: Path, max_length: int) -> dict:
    """Write tokenizer.json + tokenizer_config.json for ``data.tokenizer`` ``spec``; returns
    ``{"bos_token_id", "eos_token_id"}`` for config.json. Both are the separator training appended
    after every document: the token a document followed during training, and where it ends."""
    out_dir = Path(out_dir)
    if spec == BYTE:
        (out_dir / "tokenizer.json").write_text(byte_tokenizer_json())
        sep_id = 0
        sep = _bytes_to_unicode()[0]
    else:
        tok = load_tokenizer(spec)
        shutil.copyfile(Path(spec).expanduser(), out_dir / "tokenizer.json")
        sep_id = tok.separator_id
        vocab = json.loads((out_dir / "tokenizer.json").read_text())
        names = {t["id"]: t["content"] for t in vocab.get("added_tokens", [])}
        sep = names.get(sep_id) or next(k for k, v in vocab["model"]["vocab"].items() if v == sep_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": sep,
        "eos_token": sep,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"bos_token_id": sep_id, "eos_token_id": sep_id}
