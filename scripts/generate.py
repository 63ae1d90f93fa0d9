#!/usr/bin/env python
"""Print a prompt's continuation by a nanotrain checkpoint (one process, CPU or one GPU, KV cache).

    python scripts/generate.py RUN_DIR [--step N] --prompt TEXT [--max-new-tokens K]
        [--temperature T --top-k K --top-p P --seed S] [--device D] [--dtype X] [--raw]

RUN_DIR: a run directory, a checkpoints root or one checkpoint, saved at any (dp, tp, pp, cp, ep,
ZeRO stage): the weights are merged into the plain model in this process. ``--step N`` picks
that step's checkpoint (default: the latest complete one). The prompt is encoded with the run's
own tokenizer (``data.tokenizer`` of the config saved in the checkpoint) as training encoded a
document. The continuation's text goes to stdout (control characters but newline and tab
escaped, unless ``--raw``), a summary line to stderr. Decoding stops after ``--max-new-tokens``
tokens, at the token the run's Hugging Face export names as eos (the document separator, unless
the tokenizer's own tokenizer_config.json names another; not printed), or where the sequence
reaches ``model.max_position_embeddings`` (or a shorter ``model.sliding_window``: past it the
model would compute another function than transformers').

``--temperature 0`` (the default) is greedy: token for token what ``transformers``' ``generate``
gives on the exported model. Above 0 it samples, after top-k and top-p (0 and 1: off), drawn with
``--seed`` (default: a random one, printed on stderr so the sample can be repeated exactly).
A wrong argument is one ``error:`` line and exit status 2, before torch is imported where it can
be told without it.
"""

from __future__ import annotations

import math
import re
import secrets
import sys
import time
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.checkpoint.layout import CheckpointError  # noqa: E402
from nanotrain.checkpoint.offline_checks import plan_generate  # noqa: E402
from nanotrain.config import ConfigError  # noqa: E402
from nanotrain.config.cli_args import ArgParser, answer, non_negative_int  # noqa: E402
from nanotrain.config.text import escaped  # noqa: E402
from nanotrain.data.errors import DataError  # noqa: E402

DTYPES = ("float32", "bfloat16", "float64")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# Controls, format characters (bidi, zero-width), lone surrogates, line/paragraph separators.
UNSAFE = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``; module doc); returns 0, or 2 for a wrong
    argument or input, a checkpoint that is not nanotrain's or is damaged, or one whose logits are
    not finite (one ``error:`` line on stderr), 130 on Ctrl-C."""
    # FloatingPointError: the checkpoint's logits are not finite (nan weights), nothing to decode
    return answer(lambda: _main(argv), CheckpointError, DataError, OSError, FloatingPointError)


def _parser() -> ArgParser:
    parser = ArgParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run directory, checkpoints root or checkpoint directory")
    parser.add_argument("--step", type=non_negative_int, help="the checkpoint of this step (default: the latest)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens only (0 = all)")
    parser.add_argument("--top-p", type=float, help="sample among the most likely tokens of this mass (1 = all)")
    parser.add_argument("--seed", type=non_negative_int, help="the sampler's seed (default: random, printed)")
    parser.add_argument("--device", default="auto", help="auto (cuda if there is one, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default float32)")
    parser.add_argument("--raw", action="store_true", help="print the text as decoded, control characters too")
    return parser


def check_arguments(args) -> None:
    """The numbers' ranges (ConfigError naming the flag); nothing read yet."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature {args.temperature}: must be a number >= 0 (0 = greedy)")
    if args.seed is not None and args.seed >= 2**63:
        raise ConfigError(f"--seed {args.seed}: must be below 2**63")
    if args.top_k is not None and args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 0 (0 = off)")
    if args.top_p is not None and not (0 < args.top_p <= 1):
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1] (1 = off)")
    if args.temperature == 0:
        flags = (("--top-k", args.top_k), ("--top-p", args.top_p), ("--seed", args.seed))
        given = [flag for flag, value in flags if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: only for sampling; add --temperature T > 0 (0 is greedy)")
    if not DEVICE.fullmatch(args.device):
        raise ConfigError(f"--device {args.device!r}: give auto, cpu, cuda or cuda:N")
    if args.prompt == "":
        raise ConfigError("--prompt is empty: give the text to continue")


def context_limit(model: dict) -> tuple[int, str]:
    """(tokens the model computes transformers' function over, the field that says so)."""
    limit, name = int(model.get("max_position_embeddings") or 2048), "model.max_position_embeddings"
    window = model.get("sliding_window")
    if isinstance(window, int) and window < limit:
        limit, name = window, "model.sliding_window"
    return limit, name


def decode(tok, ids: list[int]) -> str:
    """The text of ``ids``; an id past the tokenizer's vocabulary (a model vocabulary padded
    beyond it) shows as U+FFFD rather than failing."""
    parts, run = [], []
    for i in ids:
        if i < tok.vocab_size:
            run.append(i)
        else:
            parts += [tok.decode(run), "\ufffd"]
            run = []
    return "".join(parts) + tok.decode(run)


def shown(text: str) -> str:
    """``text`` safe for a terminal: every control character but newline and tab, every format,
    separator or lone surrogate character written as its escape (``\\x1b``), so that a sample
    cannot move the cursor, recolour the terminal or read otherwise than it is (``--raw``: as
    decoded, for a pipe)."""
    return "".join(c if c in "\t\n" or unicodedata.category(c) not in UNSAFE else escaped(c) for c in text)


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    check_arguments(args)
    ckpt, meta = plan_generate(args.run_dir, args.step)
    config = meta["config"]
    spec = (config.get("data") or {}).get("tokenizer", "byte")
    from nanotrain.data.hf_tokenizer import special_token_ids
    from nanotrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(spec, config["model"].get("vocab_size"))
    prompt = [int(i) for i in tok.encode_batch([args.prompt])[0]]
    if not prompt:
        raise ConfigError(f"--prompt {args.prompt!r}: encodes to no token")
    limit, field = context_limit(config["model"])
    if len(prompt) > limit:
        raise ConfigError(f"--prompt: {len(prompt)} tokens, longer than {field} ({limit})")
    eos = special_token_ids(spec, tok)["eos_token_id"]
    max_new = min(args.max_new_tokens, limit - len(prompt) + 1)  # the last new token is never fed
    seed = args.seed if args.seed is not None else secrets.randbits(63)
    # Imported only now: torch costs seconds, which a wrong argument must not wait for.
    import torch

    from nanotrain.checkpoint.plain_model import load_plain_model
    from nanotrain.models.generate import Sampling, generate

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and (torch.device(device).index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {args.device}: no such CUDA device here ({torch.cuda.device_count()} visible)")
    t0 = time.perf_counter()
    model = load_plain_model(ckpt, meta, getattr(torch, args.dtype), device)
    t1 = time.perf_counter()
    sampling = Sampling(args.temperature, args.top_k or 0, 1.0 if args.top_p is None else args.top_p, seed)
    new = generate(model, prompt, max_new, sampling, stop_ids=(eos,))
    seconds = time.perf_counter() - t1
    stopped = new[-1] == eos
    text = decode(tok, new[:-1] if stopped else new)
    print(text if args.raw else shown(text), flush=True)
    why = "eos" if stopped else ("--max-new-tokens" if len(new) == args.max_new_tokens else field)
    saved = meta.get("topology") or {}
    axes = [f"{a}{saved[a]}" for a in ("dp", "tp", "pp", "cp", "ep") if saved.get(a, 1) != 1]
    topology = " ".join(axes) or "one process"
    how = "greedy" if args.temperature == 0 else f"sampled, seed {seed}"
    print(
        f"{ckpt} (step {meta.get('step')}, saved at {topology}): {len(prompt)} prompt + {len(new)} new tokens, "
        f"{how}, stopped at {why}; {args.dtype} on {device}, loaded in {t1 - t0:.2f} s, "
        f"{len(new) / max(seconds, 1e-9):.1f} tokens/s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
