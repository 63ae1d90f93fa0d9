"""The run's tokenizer as Hugging Face files (``tokenizer.json`` + ``tokenizer_config.json``), for export.

The byte tokenizer (id = UTF-8 byte value) becomes a ``tokenizers`` BPE with no merges over the
256 byte-level symbols (the GPT-2 byte -> unicode table of ``ByteLevel``), no normalizer, no
regex split and no post-processor: every byte is one token whose id is the byte's value, so
``AutoTokenizer`` encodes every text to exactly the ids training saw (tests/test_hf.py checks it on
ASCII, multi-byte UTF-8 and control characters). Its end-of-document token is id 0 (the NUL
byte, shown by ``ByteLevel`` as ``Ā``).

A ``tokenizer.json`` run exports its file as it is (byte-identical). When the file is an HF model
directory's ``tokenizer.json`` (``data.tokenizer: DIR/tokenizer.json`` beside a
``tokenizer_config.json``, as for a run started with ``checkpoints.init_from_hf``), the directory's
own tokenizer files come along: ``tokenizer_config.json`` (chat template, special tokens, added
tokens, model_max_length), ``special_tokens_map.json``, ``chat_template.jinja`` and
``additional_chat_templates/``, instead of a generic config (``export_tokenizer`` says which ids
config.json then gets, and the one key of the config that changes). ``tokenizer.model``,
``vocab.json`` and ``merges.txt`` are not copied: ``tokenizer.json`` is the vocabulary training
used, and the export names no class that would read another.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from nanotrain.data.errors import DataError
from nanotrain.data.tokenizer import BYTE, load_tokenizer

# The class every exported tokenizer_config.json names. It loads tokenizer.json exactly as it is
# (transformers 4.x ``PreTrainedTokenizerFast``, 5.x ``TokenizersBackend``). A family's own class
# may not: transformers 5's ``LlamaTokenizer``, ``Qwen2Tokenizer``... keep only the vocabulary and
# merges of tokenizer.json and rebuild normalizer, pre-tokenizer and decoder their own way (5.x's
# ``LlamaTokenizer`` puts a Metaspace where Llama 2 / Mistral v0.1 files have a Prepend("▁")
# normalizer, which differs on a text that starts with a space: "▁▁x" becomes "▁x").
FAST_CLASS = "PreTrainedTokenizerFast"
CONFIG = "tokenizer_config.json"
# What transformers' AutoTokenizer reads from a model directory besides tokenizer.json and
# tokenizer_config.json: copied from the source directory, or removed from the export directory
# where an earlier export left them (a stale chat template or added_tokens.json would load with
# the new tokenizer).
SIDE_FILES = ("special_tokens_map.json", "chat_template.jinja", "additional_chat_templates", "added_tokens.json")
COPIED = SIDE_FILES[:3]


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
    """Write the tokenizer of ``data.tokenizer`` ``spec`` into ``out_dir`` as Hugging Face files;
    returns ``{"bos_token_id", "eos_token_id"}`` for config.json and generation_config.json.

    * ``byte``, or a tokenizer.json with no ``tokenizer_config.json`` beside it (or not named
      ``tokenizer.json``): tokenizer.json (the run's file, byte-identical) and a generic
      tokenizer_config.json whose bos and eos are the separator training appended after every
      document (the token a document followed during training, and where it ends); both ids are
      the separator's. ``max_length`` is its ``model_max_length``.
    * ``DIR/tokenizer.json`` with ``DIR/tokenizer_config.json`` (an HF model directory): both files
      and the ``COPIED`` ones beside them. The config is copied byte-identical except that its
      ``tokenizer_class`` becomes ``PreTrainedTokenizerFast`` (and an ``auto_map`` entry for
      ``AutoTokenizer`` goes), so ``AutoTokenizer`` encodes with tokenizer.json as training did
      (see ``FAST_CLASS``); its ``model_max_length`` is kept. The returned ids are those of its
      ``bos_token`` and ``eos_token``: the copied config wins over the separator, because
      config.json, generation_config.json and the tokenizer must name the same tokens, and a model
      started from an HF checkpoint keeps its family's convention (an instruct model's eos is its
      end-of-turn token, ``<|eot_id|>`` or ``<|im_end|>``, which ``generate`` must stop on; the
      separator, e.g. ``<|end_of_text|>``, is then a different token). Where the config names no
      bos or eos (Qwen's ``bos_token: null``), the separator's id stands in, as Qwen's own
      config.json has it.

    Raises:
        DataError: the tokenizer cannot be loaded (``load_tokenizer``), or the tokenizer_config.json
            beside it is not a JSON object or names a bos/eos token that tokenizer.json lacks (it
            belongs to another tokenizer; ``AutoTokenizer`` would add the token past the model's
            vocabulary).
    """
    out_dir = Path(out_dir)
    path = source_dir = hf = None
    if spec == BYTE:
        sep_id, sep = 0, _bytes_to_unicode()[0]
    else:
        path = Path(spec).expanduser()
        tok = load_tokenizer(spec)
        sep_id = tok.separator_id
        sep = tok.id_to_token(sep_id)
        if path.name == "tokenizer.json" and (path.parent / CONFIG).is_file():
            source_dir = path.parent
            hf = _hf_config(source_dir / CONFIG, tok, spec)  # checked before anything is written
    if path is None:
        (out_dir / "tokenizer.json").write_text(byte_tokenizer_json())
    else:
        _copy(path, out_dir / "tokenizer.json")
    if source_dir is None or not _same(source_dir, out_dir):
        for name in SIDE_FILES:
            _remove(out_dir / name)
    if hf is not None:
        text, ids = hf
        if text is None:
            _copy(source_dir / CONFIG, out_dir / CONFIG)
        else:
            (out_dir / CONFIG).write_text(text, encoding="utf-8")
        if not _same(source_dir, out_dir):  # an export into the source directory has them already
            for name in COPIED:
                if (source_dir / name).is_dir():
                    shutil.copytree(source_dir / name, out_dir / name)
                elif (source_dir / name).is_file():
                    shutil.copyfile(source_dir / name, out_dir / name)
        return ids
    config = {
        "tokenizer_class": FAST_CLASS,
        "bos_token": sep,
        "eos_token": sep,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return {"bos_token_id": sep_id, "eos_token_id": sep_id}


def special_token_ids(spec: str, tok=None) -> dict:
    """``{"bos_token_id", "eos_token_id"}`` as ``export_tokenizer`` gives them for ``spec``, with
    nothing written: the eos is what the export's ``generation_config.json`` stops at, so
    ``scripts/generate.py`` stops at the same token (``tok``: ``spec`` already loaded)."""
    if spec == BYTE:
        return {"bos_token_id": 0, "eos_token_id": 0}
    path = Path(spec).expanduser()
    tok = tok if tok is not None else load_tokenizer(spec)
    if path.name == "tokenizer.json" and (path.parent / CONFIG).is_file():
        return _hf_config(path.parent / CONFIG, tok, spec)[1]
    return {"bos_token_id": tok.separator_id, "eos_token_id": tok.separator_id}


def _hf_config(path: Path, tok, spec: str) -> tuple[str | None, dict]:
    """(the text to export for the tokenizer_config.json at ``path``, None where it is copied as it
    is; the bos/eos ids for config.json), by the rules of ``export_tokenizer``."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # bad JSON or not UTF-8
        raise DataError(f"{path}: not a JSON file ({exc}); fix it, or remove it to export a generic one") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON object; fix it, or remove it to export a generic one")
    ids = {}
    for key in ("bos_token", "eos_token"):
        name = _token_name(config.get(key))
        token_id = tok.separator_id if name is None else tok.token_to_id(name)
        if token_id is None:
            raise DataError(
                f"{path}: {key} {name!r} is not a token of data.tokenizer={spec!r}: this "
                f"tokenizer_config.json belongs to another tokenizer; fix it, or remove it to export a generic one"
            )
        ids[f"{key}_id"] = token_id
    changed = {**config, "tokenizer_class": FAST_CLASS}
    auto_map = config.get("auto_map")
    if isinstance(auto_map, dict) and "AutoTokenizer" in auto_map:  # custom code, not exported
        rest = {k: v for k, v in auto_map.items() if k != "AutoTokenizer"}
        if rest:
            changed["auto_map"] = rest
        else:
            del changed["auto_map"]
    text = None if changed == config else json.dumps(changed, indent=2, ensure_ascii=False) + "\n"
    return text, ids


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken object
    (``{"content": ..., "__type": "AddedToken"}``) or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and a.samefile(b)
    except OSError:
        return False


def _copy(src: Path, dst: Path) -> None:
    """``src`` to ``dst`` byte for byte; nothing to do where they are the same file (an export
    into the directory the tokenizer came from)."""
    if not _same(src, dst):
        shutil.copyfile(src, dst)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
