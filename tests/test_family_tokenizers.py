"""The HF families' tokenizers through the data pipeline and out again with the export.

One tokenizer.json per family style (``helpers.family_tokenizers``: Llama 3 / SmolLM3 byte-level
BPE, Llama 2 / Mistral SentencePiece BPE with byte fallback, Qwen2 / 2.5 / 3 NFC byte-level BPE),
built offline here, with the families' pre-tokenizers, special tokens and post-processors:

* the pipeline (``data.tokenizer: DIR/tokenizer.json``) ends every document with the family's
  end-of-text token, encodes without the post-processor's BOS, and the stream decodes back;
* ``export_tokenizer`` carries tokenizer.json byte-identical, and with it the HF directory's
  tokenizer_config.json (chat template kept), special_tokens_map.json and chat_template.jinja;
  ``AutoTokenizer.from_pretrained`` on the export encodes every text to the pipeline's ids, with
  and without a family config beside the source; the bos/eos ids for config.json are the
  tokenizer's own.
"""

from __future__ import annotations

import importlib.util
import json
import time
import unicodedata

import numpy as np
import pytest
import transformers  # a dev dependency: the reference loader

from nanotrain.config.schema import DataArgs
from nanotrain.data import DataError, TokenDataset, load_tokenizer
from nanotrain.data.hf_tokenizer import FAST_CLASS, export_tokenizer

from helpers.family_tokenizers import (
    BOS,
    CHAT_TEMPLATES,
    CONFIG_BOS,
    CONFIG_EOS,
    EOS,
    LLAMA3_REGEX,
    QWEN2_REGEX,
    STYLES,
    TEXTS,
    build_tokenizer,
    family_tokenizer,
    tokenizer_config,
    tokenizer_json,
    write_family_dir,
)

VOCAB = 1024  # model.vocab_size: above every style's (at most 756 ids)


def expected_text(style: str, text: str) -> str:
    """What a text decodes back to: Qwen's NFC normalizer composes the combining accents."""
    return unicodedata.normalize("NFC", text) if style == "qwen2" else text


def pipeline(tmp_path, path) -> TokenDataset:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return TokenDataset.build(
        DataArgs(source=str(src), tokenizer=str(path)), seq_len=8, cache_dir=str(tmp_path / "cache"), vocab_size=VOCAB
    )


def test_styles_have_the_families_pipelines():
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert LLAMA3_REGEX == TikTokenConverter().pattern and QWEN2_REGEX == PRETOKENIZE_REGEX
    for style in STYLES:
        t0 = time.perf_counter()
        build_tokenizer(style)
        assert time.perf_counter() - t0 < 1.0, style
    llama3, mistral, qwen2 = (json.loads(tokenizer_json(s)) for s in STYLES)

    assert llama3["normalizer"] is None
    split, byte_level = llama3["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["behavior"] == "Isolated" and split["pattern"]["Regex"] == LLAMA3_REGEX
    assert byte_level == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    assert llama3["model"]["ignore_merges"] and not llama3["model"]["byte_fallback"]
    added = llama3["added_tokens"]
    assert len(added) == 256 and all(t["special"] for t in added)
    assert [t["content"] for t in added[:2]] == ["<|begin_of_text|>", "<|end_of_text|>"]
    assert added[9]["content"] == "<|eot_id|>" and added[-1]["content"] == "<|reserved_special_token_247|>"
    assert added[0]["id"] == len(llama3["model"]["vocab"])  # the specials follow the vocabulary
    assert [p["type"] for p in llama3["post_processor"]["processors"]] == ["ByteLevel", "TemplateProcessing"]
    assert llama3["decoder"]["type"] == "ByteLevel"

    assert [n["type"] for n in mistral["normalizer"]["normalizers"]] == ["Prepend", "Replace"]
    assert mistral["pre_tokenizer"] is None
    model = mistral["model"]
    assert model["byte_fallback"] and model["fuse_unk"] and model["unk_token"] == "<unk>"
    assert list(model["vocab"])[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and model["vocab"]["<0xFF>"] == 258
    assert [(t["id"], t["content"]) for t in mistral["added_tokens"]] == [(0, "<unk>"), (1, "<s>"), (2, "</s>")]
    assert mistral["post_processor"]["single"][0] == {"SpecialToken": {"id": "<s>", "type_id": 0}}
    assert [d["type"] for d in mistral["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse", "Strip"]
    assert not any("▁" in piece[1:] for piece in model["vocab"])  # no piece spans a word boundary

    assert qwen2["normalizer"] == {"type": "NFC"}
    split, byte_level = qwen2["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"]["Regex"] == QWEN2_REGEX and byte_level["type"] == "ByteLevel"
    assert qwen2["post_processor"]["type"] == "ByteLevel" and qwen2["decoder"]["type"] == "ByteLevel"
    specials = [t["content"] for t in qwen2["added_tokens"] if t["special"]]
    assert specials[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert {"<think>", "</think>"} <= {t["content"] for t in qwen2["added_tokens"] if not t["special"]}


@pytest.mark.parametrize("style", STYLES)
def test_pipeline_ends_documents_with_the_family_eos(tmp_path, style):
    path = write_family_dir(style, tmp_path / "hf")
    hf = family_tokenizer(style)
    ds = pipeline(tmp_path, path)
    sep = hf.token_to_id(EOS[style])
    assert ds.separator_id == sep and load_tokenizer(str(path)).separator_id == sep
    expected = []
    for text in TEXTS:
        expected += hf.encode(text, add_special_tokens=False).ids + [sep]
    tokens = np.asarray(ds.tokens)
    assert tokens.tolist() == expected
    if BOS[style] is not None:  # the post-processor's BOS would be there with add_special_tokens
        assert hf.encode(TEXTS[0]).ids[0] == hf.token_to_id(BOS[style]) not in tokens
    if style == "mistral":  # characters the training text never had went through the byte fallback
        assert np.isin(tokens, np.arange(3, 259)).sum() > 20
    tok = load_tokenizer(str(path))
    docs = np.split(tokens, np.flatnonzero(tokens == sep) + 1)[:-1]
    assert [tok.decode(d[:-1]) for d in docs] == [expected_text(style, t) for t in TEXTS]


@pytest.mark.parametrize("with_config", [True, False], ids=["hf-dir", "bare"])
@pytest.mark.parametrize("style", STYLES)
def test_export_encodes_as_the_pipeline(tmp_path, style, with_config):
    path = write_family_dir(style, tmp_path / "hf", config=with_config)
    out = tmp_path / "out"
    out.mkdir()
    ids = export_tokenizer(str(path), out, max_length=4096)
    assert (out / "tokenizer.json").read_bytes() == path.read_bytes()

    pipe = load_tokenizer(str(path))
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    for text, got in zip(TEXTS, pipe.encode_batch(TEXTS)):
        assert hf.encode(text, add_special_tokens=False) == got.tolist(), (style, text)
    # With its special tokens the export adds what the family's tokenizer.json adds (Llama 3's
    # and Mistral's BOS, nothing for Qwen).
    assert hf.encode(TEXTS[0]) == family_tokenizer(style).encode(TEXTS[0]).ids
    assert ids == {"bos_token_id": hf.bos_token_id or pipe.separator_id, "eos_token_id": hf.eos_token_id}

    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == FAST_CLASS
    if not with_config:
        assert ids == {"bos_token_id": pipe.separator_id, "eos_token_id": pipe.separator_id}
        assert hf.eos_token == EOS[style] and config["model_max_length"] == 4096
        assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
        return
    source = tokenizer_config(style)
    assert config == {**source, "tokenizer_class": FAST_CLASS}
    if style == "llama3":  # already the fast class: the file as it is
        assert (out / "tokenizer_config.json").read_bytes() == (path.parent / "tokenizer_config.json").read_bytes()
    assert hf.eos_token == CONFIG_EOS[style] and hf.bos_token == CONFIG_BOS[style]
    assert pipe.id_to_token(ids["eos_token_id"]) == CONFIG_EOS[style]
    for name in ("special_tokens_map.json", "chat_template.jinja"):
        if (path.parent / name).exists():
            assert (out / name).read_bytes() == (path.parent / name).read_bytes()
    assert hf.chat_template == CHAT_TEMPLATES[style]
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert {"llama3": "<|start_header_id|>user", "mistral": "<s>[INST] hi", "qwen2": "<|im_start|>user"}[style] in chat


def test_export_replaces_an_earlier_exports_tokenizer_files(tmp_path):
    qwen = write_family_dir("qwen2", tmp_path / "qwen")
    (qwen.parent / "additional_chat_templates").mkdir()
    (qwen.parent / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    out = tmp_path / "out"
    out.mkdir()
    export_tokenizer(str(qwen), out, max_length=64)
    (out / "added_tokens.json").write_text('{"<stale>": 999}')
    assert (out / "chat_template.jinja").is_file() and (out / "additional_chat_templates" / "tool_use.jinja").is_file()
    assert transformers.AutoTokenizer.from_pretrained(str(out)).chat_template.keys() == {"default", "tool_use"}
    llama = write_family_dir("llama3", tmp_path / "llama", config=False)
    assert export_tokenizer(str(llama), out, max_length=64) == {"bos_token_id": 501, "eos_token_id": 501}
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf.chat_template is None and "<stale>" not in hf.get_vocab() and hf.eos_token == "<|end_of_text|>"

    # Into the HF directory it came from: nothing to copy onto itself, only the class pinned.
    assert export_tokenizer(str(qwen), qwen.parent, max_length=64)["eos_token_id"] == 502
    assert json.loads((qwen.parent / "tokenizer_config.json").read_text())["tokenizer_class"] == FAST_CLASS
    assert (qwen.parent / "chat_template.jinja").is_file()


def test_export_refuses_a_config_of_another_tokenizer(tmp_path):
    path = write_family_dir("llama3", tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    config = path.parent / "tokenizer_config.json"
    config.write_text(json.dumps({**tokenizer_config("llama3"), "eos_token": "<|im_end|>"}))
    with pytest.raises(DataError, match=r"tokenizer_config.json: eos_token '<\|im_end\|>' is not a token of"):
        export_tokenizer(str(path), out, max_length=64)
    config.write_text("{not json")
    with pytest.raises(DataError, match="tokenizer_config.json: not a JSON file"):
        export_tokenizer(str(path), out, max_length=64)
    assert list(out.iterdir()) == []  # checked before anything is written
    config.write_text(json.dumps({**tokenizer_config("llama3"), "eos_token": {"content": "<|end_of_text|>"}}))
    assert export_tokenizer(str(path), out, max_length=64) == {"bos_token_id": 500, "eos_token_id": 501}


def test_export_script_refuses_a_bad_tokenizer_config_in_one_line(tmp_path, capsys):
    from nanotrain.checkpoint import save_checkpoint
    from nanotrain.config import Config, ModelArgs
    from nanotrain.models.llama_parallelize import build_llama

    from helpers.runs import ROOT

    path = write_family_dir("llama3", tmp_path / "hf")
    (path.parent / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer_config("llama3"), "eos_token": "<|im_end|>"})
    )
    args = ModelArgs(vocab_size=1024, hidden_size=16, intermediate_size=32, num_layers=1, num_attention_heads=2)
    config = Config(model=args, data=DataArgs(tokenizer=str(path)))
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, build_llama(args, None), config=config)
    spec = importlib.util.spec_from_file_location("_script_export_hf", ROOT / "scripts" / "export_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    code = script.main([str(ckpt), str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "eos_token '<|im_end|>' is not a token of" in lines[0] and not (tmp_path / "out").exists()
