"""The document mask as a FlexAttention block mask (``model.attention_kernel: flex``).

FlexAttention (``torch.nn.attention.flex_attention``, compiled) walks the score matrix in tiles
of ``BLOCK`` x ``BLOCK``: a tile listed *full* is computed without looking at the mask, a tile
listed *partial* is computed with the element-wise ``mask_mod``, a tile in neither list is
skipped. So the mask never exists as an S x S tensor, and the tiles that cross no document
(most of them once documents are short) cost nothing.

The tile lists are built here from per-tile summaries of the document ids and the window
positions (min and max over each tile's tokens): ``[B, S_q/BLOCK, S/BLOCK]`` booleans, 256 per
sample at S = 8192 instead of 64 Mi, all on the device with no value read back (no host sync).

* A tile is *full* iff every pair in it is attended: the query tile's smallest position is at
  least the key tile's largest, and both tiles hold one and the same document (min = max on each
  side). Exact, not conservative: a tile listed full skips ``mask_mod``.
* A tile may be attended (*partial* unless full) iff some query position reaches the key tile's
  smallest position and the two tiles' document-id ranges overlap: a necessary condition, so no
  tile with an attended pair is skipped; a tile listed partial that has none costs time only
  (its ``mask_mod`` masks it all).

The same summaries serve every token order context parallelism uses: zig-zag queries over keys
in position order, and a balanced order's queries over keys in gather order (a tile straddling
two ranks' runs only widens its ranges). A tile holding tokens past the sequence's end is never
listed full; ``mask_mod`` reads ids padded with values no real token has, so the padding matches
nothing.
"""

from __future__ import annotations

import torch

from nanotrain.parallel.sdpa import BlockMask

BLOCK = 128  # FlexAttention's default tile (its CUDA kernels' BLOCK_M = BLOCK_N)


def _padded(values: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """``values`` ``[..., N]`` padded with ``fill`` to ``length`` along the last dim."""
    pad = length - values.shape[-1]
    return values if pad == 0 else torch.nn.functional.pad(values, (0, pad), value=fill)


def _tile_ranges(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile (min, max) of ``values`` ``[..., N]`` over tiles of ``block`` tokens
    ``[..., ceil(N / block)]``; the last tile is padded with its last token (no new extremes)."""
    n = values.shape[-1]
    pad = -n % block
    if pad:
        values = torch.cat([values, values[..., -1:].expand(*values.shape[:-1], pad)], dim=-1)
    tiles = values.unflatten(-1, (-1, block))
    return tiles.amin(-1), tiles.amax(-1)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, Qt, Kt]`` booleans -> (counts ``[B, 1, Qt]``, key-tile indices ``[B, 1, Qt, Kt]``
    listed first), FlexAttention's ordered form (as its ``_dense_to_ordered``)."""
    counts = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None].contiguous(), indices[:, None].contiguous()


def tile_lists(
    query_docs: torch.Tensor,
    query_index: torch.Tensor,
    key_docs: torch.Tensor,
    keys: torch.Tensor,
    block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) ``[B, S_q/block, S/block]`` booleans: the tiles computed under ``mask_mod``
    and those computed whole, for queries at window positions ``query_index`` ``[S_q]`` with
    document ids ``query_docs`` ``[B, S_q]`` over keys at ``keys`` ``[S]`` with ``key_docs``."""
    qd_lo, qd_hi = _tile_ranges(query_docs, block)  # [B, Qt]
    kd_lo, kd_hi = _tile_ranges(key_docs, block)  # [B, Kt]
    qp_lo, qp_hi = _tile_ranges(query_index, block)  # [Qt]
    kp_lo, kp_hi = _tile_ranges(keys, block)  # [Kt]
    q_whole = torch.arange(1, qp_lo.shape[0] + 1, device=keys.device) * block <= query_index.shape[0]
    k_whole = torch.arange(1, kp_lo.shape[0] + 1, device=keys.device) * block <= keys.shape[0]
    reach = (qp_hi[:, None] >= kp_lo[None, :])[None]
    overlap = (qd_hi[:, :, None] >= kd_lo[:, None, :]) & (kd_hi[:, None, :] >= qd_lo[:, :, None])
    below = ((qp_lo[:, None] >= kp_hi[None, :]) & q_whole[:, None] & k_whole[None, :])[None]
    one_doc = (qd_lo == qd_hi)[:, :, None] & (kd_lo == kd_hi)[:, None, :] & (qd_lo[:, :, None] == kd_lo[:, None, :])
    full = below & one_doc
    return reach & overlap & ~full, full


def document_block_mask(
    query_docs: torch.Tensor,
    query_index: torch.Tensor,
    key_docs: torch.Tensor,
    keys: torch.Tensor,
    block: int = BLOCK,
) -> BlockMask:
    """The block-causal document mask (query i sees key j iff j <= i in the window and both hold
    the same document id) as a ``BlockMask`` over ``[B, 1, S_q, S]`` (arguments: ``tile_lists``)."""
    partial, full = tile_lists(query_docs, query_index, key_docs, keys, block)
    s_q, s_k = query_index.shape[0], keys.shape[0]
    q_len, k_len = partial.shape[1] * block, partial.shape[2] * block
    # Padding that matches nothing: query ids -1 / keys -2, query positions -1 (before any key).
    qd, kd = _padded(query_docs, q_len, -1), _padded(key_docs, k_len, -2)
    qi, ki = _padded(query_index, q_len, -1), _padded(keys, k_len, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        return (qd[b, q_idx] == kd[b, kv_idx]) & (qi[q_idx] >= ki[kv_idx])

    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(s_q, s_k)
    )
