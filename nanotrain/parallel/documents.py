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

The mask takes one of two forms, by ``model.attention_kernel`` (``resolve_kernel``):

* ``sdpa_mask``: a materialised boolean ``[B, 1, S_q, S]`` tensor given to SDPA (``attn_mask``),
  the exact reference. O(S^2) bytes per sample (64 MiB at S = 8192, shared by the layers), and
  every pair is computed, masked or not.
* ``flex``: a FlexAttention ``BlockMask`` (``document_blocks.py``): per-tile lists of
  ``[B, S_q/128, S/128]`` plus the element-wise rule, run by compiled ``flex_attention``. No
  S x S tensor exists, and tiles that cross no document are skipped (what lets the balanced cp
  order, ``parallelism.cp_balance: documents``, pay off). Under ``training.compile`` it runs
  outside the compiled layers' graphs (``sdpa.flex_kernel``).
* ``auto`` (default): ``flex`` on CUDA, ``sdpa_mask`` elsewhere.

Why FlexAttention: it is in torch (no new dependency), takes any order of queries and keys (cp's
zig-zag and balanced orders, where the varlen kernels need each document's tokens contiguous and
their lengths on the host, a sync per micro-batch), takes grouped-query k/v as they are, and its
masks are built from the document ids on the device. SDPA's nested-tensor path needs per-document
lengths on the host; FlashAttention's varlen is an extra package. torch has no FlexAttention
backward on the CPU (its compiled CPU forward, float32 and bf16 only, equals the reference to
float32 rounding: the tests compare them), so the CPU trains on the reference. Peak activation
bytes and tokens/s of each kernel against causal attention, and their command, are in the
README's masked-attention kernel section (``benchmarks/masked_attention.py``).
"""

from __future__ import annotations

import torch

from nanotrain.parallel.document_blocks import document_block_mask
from nanotrain.parallel.sdpa import BlockMask, flex_kernel

KERNELS = ("auto", "sdpa_mask", "flex")


def resolve_kernel(choice: str, device: torch.device) -> str:
    """``model.attention_kernel`` on ``device``: ``auto`` is ``flex`` on CUDA and ``sdpa_mask``
    elsewhere. ``flex`` where torch has no kernel for it is an error: training on the CPU (no
    FlexAttention backward there; its no-grad forward runs) or a torch without FlexAttention."""
    if choice not in KERNELS:
        raise ValueError(f"model.attention_kernel {choice!r}: one of {KERNELS}")
    if choice == "auto":
        # the rule of config's attention_kernel_on, which the torch-free estimate uses
        return "flex" if device.type == "cuda" and BlockMask is not None else "sdpa_mask"
    if choice == "flex":
        if BlockMask is None:
            raise ValueError("model.attention_kernel 'flex': this torch has no FlexAttention (2.5 or newer)")
        if device.type == "cpu" and torch.is_grad_enabled():
            raise ValueError(
                "model.attention_kernel 'flex' cannot train on the CPU (torch has no FlexAttention backward "
                "there): use auto or sdpa_mask"
            )
    return choice


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
    documents: torch.Tensor,
    query_positions: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    kernel: str = "sdpa_mask",
):
    """What attention needs for the queries at window positions ``query_positions`` (``[S_q]``;
    None: all S) over the keys at window positions ``key_positions`` (``[S]``, a permutation:
    the order gathered keys arrive in under cp's balanced order; None: position order) of
    windows with ``documents`` ``[B, S]``: the queries' RoPE positions ``[S_q, B]``
    (sequence-first, as the hidden states) and the block-causal mask: boolean ``[B, 1, S_q, S]``
    (True: attend), or under ``kernel`` (``model.attention_kernel``, ``resolve_kernel``) flex the
    same mask as a ``BlockMask``."""
    kernel = resolve_kernel(kernel, documents.device)
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
    if kernel == "flex":
        flex_kernel()  # made here, outside any compiled layer
        return query_rope.transpose(0, 1), document_block_mask(query_docs, query_index, key_docs, keys)
    mask = (query_docs[:, :, None] == key_docs[:, None, :]) & (query_index[:, None] >= keys[None, :])
    return query_rope.transpose(0, 1), mask[:, None]
