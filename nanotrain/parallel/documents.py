"""Document masking (``data.document_masking``): packed documents that do not see each other.

A window packs consecutive documents, each ended by the tokenizer's separator. With masking on,
the sampler hands every window its per-token *document ids* (``data/sampler.py``: the id of
input token i is the number of separators among the window's inputs before i, so a document is
its tokens up to and including its separator, and the window's first token starts document 0
even when that document began in the previous window). This module turns them, on the device and
without a host sync (no value is read back, every shape is known), into what attention needs:

* RoPE positions restarting at 0 at every document, and at the window's first token (a document
  cut by the window's edge restarts at 0 in the next window, as Megatron's
  ``--reset-position-ids`` does);
* a block-causal mask: query i sees key j iff j <= i in the window and both hold the same
  document id. Context parallelism hands in its queries' zig-zag global positions: each rank's
  queries then see exactly the keys of their own document among the gathered keys.

The mask is a materialised boolean ``[B, 1, S_q, S]`` tensor given to SDPA (``attn_mask``):
the exact reference on the CPU, and what runs on a GPU too (SDPA's memory-efficient kernel takes
it; O(S^2) bytes per sample, 64 MiB at S = 8192). Not built yet: a FlexAttention block mask or
a variable-length kernel for GPUs, which would never materialise S x S (and would let
``parallelism.cp_balance: documents`` pay off).
"""

from __future__ import annotations

import torch


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` document ids -> ``[B, S]`` int64 positions within each token's document (0 at
    each document's first token in the window). Ids are non-decreasing along the window."""
    seq = documents.shape[1]
    index = torch.arange(seq, device=documents.device).expand(documents.shape)
    starts = torch.ones(documents.shape, dtype=torch.bool, device=documents.device)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_attention(
    documents: torch.Tensor, query_positions: torch.Tensor | None = None, key_positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What attention needs for the queries at window positions ``query_positions`` (``[S_q]``;
    None: all S) over the keys at window positions ``key_positions`` (``[S]``, a permutation:
    the order gathered keys arrive in under cp's balanced order; None: position order) of
    windows with ``documents`` ``[B, S]``: the queries' RoPE positions ``[S_q, B]``
    (sequence-first, as the hidden states) and the boolean block-causal mask ``[B, 1, S_q, S]``
    (True: attend)."""
    keys = torch.arange(documents.shape[1], device=documents.device)
    positions = document_positions(documents)
    if query_positions is None:
        query_docs, query_rope, query_index = documents, positions, keys
    else:
        query_docs = documents.index_select(1, query_positions)
        query_rope = positions.index_select(1, query_positions)
        query_index = query_positions
    key_docs = documents
    if key_positions is not None:
        key_docs, keys = documents.index_select(1, key_positions), key_positions
    mask = (query_docs[:, :, None] == key_docs[:, None, :]) & (query_index[:, None] >= keys[None, :])
    return query_rope.transpose(0, 1), mask[:, None]
