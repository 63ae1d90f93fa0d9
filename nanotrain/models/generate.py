"""Autoregressive decoding with the plain ``LlamaModel``: greedy or sampled, with or without the
KV cache (``kv_cache.py``); ``scripts/generate.py`` is its command line.

Greedy (``temperature`` 0) takes the argmax of each step's logits, which is what
``transformers``' ``generate(do_sample=False)`` takes, so the two agree token for token on the
same weights (where logits tie, in float64 practically never, the first index wins in both).
Sampling applies, in ``transformers``' order, the temperature, top-k (the k largest logits
kept) and top-p (the smallest set of most likely tokens whose probability reaches p kept, at
least one), then draws from the softmax with a ``torch.Generator`` seeded by ``seed``. The draw
is made on the CPU in float64, whatever the model's device and dtype: a seed then gives the same
tokens on every run (a device's generator and its kernels need not repeat across devices).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from nanotrain.models.kv_cache import KVCache


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: ``temperature`` 0 greedy; ``top_k`` 0 and ``top_p`` 1 off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def sampling_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One position's logits ``[V]`` as the float64 CPU scores sampled from: divided by the
    temperature, then -inf outside the top k and outside the top-p set (``transformers``'
    ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, in that order). The
    largest logit is subtracted first, which the softmax does not see, so that a tiny temperature
    makes the others -inf instead of overflowing the largest to inf (inf - inf: no distribution)."""
    wide = logits.detach().to(device="cpu", dtype=torch.float64)
    scores = (wide - wide.max()) / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))  # ties with the k-th stay
    if sampling.top_p < 1.0:
        ascending, order = torch.sort(scores)
        below = ascending.softmax(-1).cumsum(-1) <= 1 - sampling.top_p  # the unlikely tail
        below[-1] = False  # the most likely token always stays
        scores = scores.masked_fill(torch.empty_like(below).scatter_(0, order, below), float("-inf"))
    return scores


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token from one position's logits ``[V]`` (``generator``: a CPU one, for sampling)."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_scores(logits, sampling).softmax(-1), 1, generator=generator))


@torch.inference_mode()
def generate(
    model,
    prompt: list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop_ids: tuple[int, ...] = (),
    cache: bool = True,
) -> list[int]:
    """Up to ``max_new_tokens`` tokens after ``prompt`` (token ids), stopping after the first one
    in ``stop_ids`` (which is returned, as ``transformers`` returns its eos). ``cache`` False
    runs the whole sequence through the model at every step (what the cache must equal).
    ``model`` is a plain ``LlamaModel`` on one device, in the dtype to decode in. Raises
    FloatingPointError where the logits are not finite (there is no distribution to pick from)."""
    if not prompt or max_new_tokens < 1:
        raise ValueError("generate: an empty prompt or max_new_tokens < 1")
    device = model.embed.weight.device
    generator = None if sampling.temperature == 0 else torch.Generator().manual_seed(sampling.seed)
    out: list[int] = []
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # [1, S]
    kv = KVCache(model, len(prompt) + max_new_tokens - 1)  # the last new token is never fed
    with kv if cache else contextlib.nullcontext():
        while True:
            model.begin_step(1)  # MoE layers: no routing statistics kept from step to step
            logits = kv.forward(ids, last=True) if cache else model(torch.tensor([prompt + out], device=device))
            if not bool(torch.isfinite(logits[-1, 0]).all()):
                raise FloatingPointError(
                    f"the model's logits for new token {len(out) + 1} are not finite (nan or inf): weights "
                    "that are, or a dtype too narrow for them"
                )
            out.append(next_token(logits[-1, 0], sampling, generator))
            if len(out) == max_new_tokens or out[-1] in stop_ids:
                return out
            ids = torch.tensor([[out[-1]]], dtype=torch.long, device=device)
