"""Tokenizers in the style of the Hugging Face families, built offline with ``tokenizers``.

Each style has the pipeline of the family's published ``tokenizer.json`` (normalizer,
pre-tokenizer, model flags, post-processor, decoder, special tokens and where their ids sit); only
the vocabulary is small: a BPE trained with ``BpeTrainer`` on ``CORPUS`` (a few hundred tokens,
well under a second to build):

* ``llama3`` (Llama 3.x, and SmolLM3, which kept it): byte-level BPE with ``ignore_merges``, no
  normalizer, pre-tokenizer ``Split(LLAMA3_REGEX, isolated)`` + ``ByteLevel(use_regex=False)``,
  256 special tokens after the vocabulary (``<|begin_of_text|>``, ``<|end_of_text|>``, the
  Llama 3.1 chat and tool tokens, the rest ``<|reserved_special_token_N|>``), post-processor
  ``ByteLevel`` + ``TemplateProcessing`` that puts ``<|begin_of_text|>`` first, decoder ``ByteLevel``;
* ``mistral`` (Llama 2 / Mistral, a SentencePiece BPE converted to ``tokenizers``): ``<unk>``,
  ``<s>``, ``</s>`` at ids 0-2, the 256 byte pieces ``<0x00>``..``<0xFF>`` at 3-258, then the pieces;
  BPE with ``byte_fallback`` and ``fuse_unk``, normalizer ``Prepend("▁")`` + ``Replace(" ", "▁")``
  and no pre-tokenizer (the published legacy form), post-processor ``<s> $A``, decoder
  ``Replace("▁", " ")`` + ``ByteFallback`` + ``Fuse`` + ``Strip(left=1)``; its pieces never span a
  word boundary (trained per ``▁``-word, as SentencePiece does);
* ``qwen2`` (Qwen2, Qwen2.5, Qwen3): byte-level BPE, normalizer ``NFC``, pre-tokenizer
  ``Split(QWEN2_REGEX, isolated)`` + ``ByteLevel(use_regex=False)``, post-processor and decoder
  ``ByteLevel`` (no BOS), special tokens after the vocabulary starting with ``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>``, then Qwen's non-special added tokens (``<tool_call>``, ``<think>``...).

``write_family_dir`` lays one out as an HF model directory holds it: ``tokenizer.json`` and, unless
told not to, the family's ``tokenizer_config.json`` (its ``tokenizer_class``, bos/eos, added tokens
and a chat template), ``special_tokens_map.json`` and, for ``qwen2``, the template as
``chat_template.jinja`` (where transformers >= 4.47 saves it) instead of inside the config.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

STYLES = ("llama3", "mistral", "qwen2")

# The pre-tokenizer regexes of the published tokenizer.json files (Llama 3's is tiktoken's
# cl100k pattern; Qwen2's differs in splitting digits one by one).
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The family's end-of-text token: what a document ends with in pretraining, so the data
# pipeline's separator.
EOS = {"llama3": "<|end_of_text|>", "mistral": "</s>", "qwen2": "<|endoftext|>"}
# The token the post-processor puts first (Qwen adds none).
BOS = {"llama3": "<|begin_of_text|>", "mistral": "<s>", "qwen2": None}
# What the family's (instruct) tokenizer_config.json names as bos/eos: the chat models end a
# turn with a token of their own, not the pretraining end-of-text.
CONFIG_BOS = {"llama3": "<|begin_of_text|>", "mistral": "<s>", "qwen2": None}
CONFIG_EOS = {"llama3": "<|eot_id|>", "mistral": "</s>", "qwen2": "<|im_end|>"}

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIALS += [f"<|reserved_special_token_{i}|>" for i in range(3, 256 - len(LLAMA3_SPECIALS) + 3)]
QWEN2_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN2_ADDED = [  # added tokens that are not special (Qwen2.5's tool and FIM tokens, Qwen3's think tags)
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>"]

# Training text: several scripts, accents, digits, code and whitespace runs, so the pre-tokenizers'
# rules all fire. Characters absent from it (TEXTS has some) reach the byte fallback.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and we'll train 3 models.",
    "Machine learning models learn patterns from data; tokenizers turn text into numbers.",
    "Le renard brun rapide saute par-dessus le chien paresseux. C'est l'été à Montréal.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Übung.",
    "El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca?",
    "Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!",
    "敏捷的棕色狐狸跳过了懒狗。我们今天学习语言模型。",
    "素早い茶色の狐がのろまな犬を飛び越える。東京は大きな都市です。",
    "빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요.",
    "Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "def train(model, data):\n    for step, batch in enumerate(data):\n        loss = model(batch)\n    return loss\n",
    "    if x == 1:\n\treturn {'a': [1, 2, 3]}  # comment\n\n\n",
    "Numbers: 1234567890, 3.14159, 1,000,000 and 42% of 100.",
    "Prices rose 12% in Q3; revenue hit $1.5B (up from $1.2B).",
]
# Texts for the checks: the corpus' kind of text and what it never showed (emoji, a CJK character
# outside it, combining accents that NFC composes, control characters, whitespace runs).
TEXTS = [
    "Hello world! The model learns.",
    "naïve café — ünïcödé ☕ 🦙 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Cafe\u0301 re\u0301sume\u0301 (combining accents)",
    "魑魅魍魉 and 東京 with numbers 1234567 and 0.5",
    "  leading spaces, trailing spaces   ",
    "def f(x):\n    return x + 1\n\n",
    "tab\tseparated\x01control\x7f",
    "It's we'll they'd I'M YOU'RE",
]


def _trained(pre_tokenizer, vocab_size: int, alphabet: Optional[list[str]]) -> tuple[dict[str, int], list]:
    """(vocab, merges) of a BPE trained on ``CORPUS`` with ``pre_tokenizer``."""
    from tokenizers import Tokenizer, models, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, initial_alphabet=alphabet or [])
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], [tuple(m) for m in model["merges"]]


def _added(tokens: list[str], special: bool = True) -> list:
    from tokenizers import AddedToken

    return [AddedToken(t, special=special, normalized=False) for t in tokens]


def _llama3(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    vocab, merges = _trained(pre, vocab_size, pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tok.pre_tokenizer = pre
    tok.add_special_tokens(_added(LLAMA3_SPECIALS))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    return tok


def _mistral(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    # SentencePiece pieces stay inside one "▁word": train on Metaspace-split words, then encode
    # the published way (whole text, normalizer only), which finds the same pieces.
    words = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trained, merges = _trained(words, vocab_size, None)
    pieces = [t for t, _ in sorted(trained.items(), key=lambda kv: kv[1])]
    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.add_special_tokens(_added(MISTRAL_SPECIALS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s>:1 $B:1", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def _qwen2(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    vocab, merges = _trained(pre, vocab_size, pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre
    tok.add_special_tokens(_added(QWEN2_SPECIALS))
    tok.add_tokens(_added(QWEN2_ADDED, special=False))
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


_BUILDERS = {"llama3": _llama3, "mistral": _mistral, "qwen2": _qwen2}


def build_tokenizer(style: str, vocab_size: int = 500):
    """A new ``tokenizers.Tokenizer`` of ``style``: a BPE of ``vocab_size`` trained tokens, plus
    the style's specials and, for ``mistral``, its 256 byte pieces."""
    return _BUILDERS[style](vocab_size)


@functools.lru_cache(maxsize=None)
def tokenizer_json(style: str, vocab_size: int = 500) -> str:
    """The tokenizer.json text of ``build_tokenizer(style, vocab_size)``, built once per process."""
    return build_tokenizer(style, vocab_size).to_str()


def family_tokenizer(style: str):
    """A ``tokenizers.Tokenizer`` of ``style`` (a fresh object over the cached build)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json(style))


# Chat templates in the families' shape (short, but the real tokens and layout).
_LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
_QWEN2_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
CHAT_TEMPLATES = {"llama3": _LLAMA3_TEMPLATE, "mistral": _MISTRAL_TEMPLATE, "qwen2": _QWEN2_TEMPLATE}


def tokenizer_config(style: str) -> dict:
    """The family's tokenizer_config.json (an instruct model's: its chat template and eos)."""
    tok = json.loads(tokenizer_json(style))
    decoder = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in tok["added_tokens"]
    }
    common = {"added_tokens_decoder": decoder, "bos_token": CONFIG_BOS[style], "eos_token": CONFIG_EOS[style]}
    if style == "llama3":
        return {
            **common,
            "chat_template": _LLAMA3_TEMPLATE,
            "clean_up_tokenization_spaces": True,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
    if style == "mistral":
        return {
            "add_bos_token": True,
            "add_eos_token": False,
            **common,
            "additional_special_tokens": [],
            "chat_template": _MISTRAL_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "legacy": True,
            "model_max_length": 32768,
            "pad_token": None,
            "sp_model_kwargs": {},
            "spaces_between_special_tokens": False,
            "tokenizer_class": "LlamaTokenizer",
            "unk_token": "<unk>",
            "use_default_system_prompt": False,
        }
    return {  # qwen2: the template lives in chat_template.jinja
        "add_bos_token": False,
        "add_prefix_space": False,
        **common,
        "additional_special_tokens": QWEN2_SPECIALS[1:],
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_family_dir(style: str, directory: Path, *, config: bool = True) -> Path:
    """``directory``/tokenizer.json of ``style`` and, with ``config``, the family's
    tokenizer_config.json, special_tokens_map.json (and chat_template.jinja for qwen2); returns
    the tokenizer.json path (what ``data.tokenizer`` names)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_text(tokenizer_json(style))
    if config:
        cfg = tokenizer_config(style)
        (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        special = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if cfg.get(k)}
        (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        if style == "qwen2":
            (directory / "chat_template.jinja").write_text(CHAT_TEMPLATES[style])
    return path
