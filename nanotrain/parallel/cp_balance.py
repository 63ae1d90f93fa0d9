"""Context-parallel load balance under document masks: per-rank attention work, and an assignment
of tokens to cp ranks that evens it out.

Zig-zag (``context_parallel.cp_positions``: 2*cp chunks, rank r keeps chunks r and 2cp-1-r)
gives every rank the same work under the plain causal mask, where query i attends to i+1 keys.
Under document masking (``documents.py``) query i attends only to the keys of its own document
at or before it: its *position within its document* + 1. A window holding one long document and
many short ones then puts most of the work on the ranks that hold the long document's late part,
and the step waits for the slowest rank.

What is counted (host arithmetic, numpy, no torch): per rank, the (query, key) pairs its queries
attend to under the block-causal mask, summed over the rows of the micro-batch (one token order
serves the whole micro-batch, so that every row's ``[S/cp]`` slice has the same shape). This is the
work of a kernel that skips masked pairs (``model.attention_kernel: flex``, whose block mask
skips masked 128 x 128 tiles: the pairs up to the tiles' edges); the materialised-mask SDPA path
(``sdpa_mask``) computes every pair of its query chunk against the keys up to the chunk's end,
masked or not. FLOPs are the forward's matrix products only:
``4 * head_dim * heads * pairs`` (2*d for q.k and 2*d for p.v per pair and head); the backward
is about twice that and the max/mean ratio is the same.

The balanced order (``balanced_order``) cuts the sequence into 2*cp*k equal chunks (k = 4) and deals them
out largest-work-first to the least-loaded rank that still has fewer than 2k chunks (every rank
gets the same number of tokens, so shapes stay equal across ranks), and keeps zig-zag when that
is at least as even. It depends only on the document ids, which the sampler computes on the host
with the batch.
"""

from __future__ import annotations

import numpy as np


def token_pairs(documents) -> np.ndarray:
    """Keys each query attends to under the block-causal mask: its position within its document
    plus one. ``documents``: per-token document ids ``[..., S]``, non-decreasing along S (the
    sampler's; a torch CPU tensor or an array)."""
    docs = np.asarray(documents, dtype=np.int64)
    index = np.broadcast_to(np.arange(docs.shape[-1]), docs.shape)
    starts = np.ones(docs.shape, dtype=bool)
    starts[..., 1:] = docs[..., 1:] != docs[..., :-1]
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)
    return index - first + 1


def packed_documents(lengths, seq_len: int, window: int = 0) -> np.ndarray:
    """Per-token document ids ``[S]`` of window ``window`` of a stream packing documents of
    ``lengths`` tokens (each counting its separator) back to back, as the sampler cuts it: the
    window's inputs are stream tokens ``[window*S, window*S + S)`` and its first token starts
    document 0 (a document cut by the window's edge is a document of its own in each window)."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    tokens = np.arange(window * seq_len, (window + 1) * seq_len)
    if tokens[-1] >= ends[-1]:
        raise ValueError(f"window {window} of {seq_len} tokens runs past the stream's {ends[-1]} tokens")
    ids = np.searchsorted(ends, tokens, side="right")
    return ids - ids[0]


def zigzag_order(seq_len: int, cp: int) -> np.ndarray:
    """``[cp, S/cp]`` global positions of each rank's tokens under zig-zag (``cp_positions``)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2*cp = {2 * cp}")
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    return np.stack([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def rank_pairs(documents, order) -> np.ndarray:
    """``[cp]`` (query, key) pairs each rank computes when rank r holds the queries at positions
    ``order[r]``, summed over the micro-batch's rows."""
    per_token = token_pairs(documents).reshape(-1, np.asarray(documents).shape[-1]).sum(axis=0)
    return per_token[np.asarray(order)].sum(axis=-1)


def attention_flops(pairs, head_dim: int, heads: int):
    """Forward attention FLOPs of ``pairs`` (query, key) pairs: q.k and p.v, 2*d each, per head."""
    return 4 * head_dim * heads * np.asarray(pairs, dtype=np.int64)


def imbalance(work) -> float:
    """max/mean of per-rank work: the step's attention time over a perfectly even split's."""
    work = np.asarray(work, dtype=np.float64)
    return float(work.max() / work.mean())


def balanced_order(documents, cp: int, k: int = 4) -> np.ndarray:
    """``[cp, S/cp]`` global positions (each row ascending) of the tokens each rank holds, chosen
    to even out the masked attention work of the micro-batch ``documents`` (``[B, S]`` or ``[S]``).

    Greedy, longest-processing-time first with equal counts: 2*cp*k chunks of S/(2*cp*k) tokens,
    by decreasing work, each to the least-loaded rank (lowest rank on ties) that holds fewer than
    2k; zig-zag is kept when it is at least as even (plain causal work, one document per window).
    ``k`` is halved until S divides into the chunks (S is a multiple of 2*cp)."""
    seq_len = np.asarray(documents).shape[-1]
    zigzag = zigzag_order(seq_len, cp)
    if cp == 1:
        return zigzag
    while seq_len % (2 * cp * k):  # S is a multiple of 2*cp (validated): k = 1 always fits
        k //= 2
    n = 2 * cp * k
    size = seq_len // n
    per_token = token_pairs(documents).reshape(-1, seq_len).sum(axis=0)
    chunk_work = per_token.reshape(n, size).sum(axis=1)
    load, owned = np.zeros(cp, dtype=np.int64), [[] for _ in range(cp)]
    for chunk in np.argsort(-chunk_work, kind="stable"):
        open_ranks = [r for r in range(cp) if len(owned[r]) < 2 * k]
        rank = min(open_ranks, key=lambda r: (load[r], r))
        owned[rank].append(int(chunk))
        load[rank] += chunk_work[chunk]
    order = np.stack([(np.sort(o)[:, None] * size + np.arange(size)).reshape(-1) for o in owned])
    return order if load.max() < rank_pairs(documents, zigzag).max() else zigzag
