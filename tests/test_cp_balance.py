"""Context-parallel work under document masks (issue 30 item 4), host arithmetic only, no ranks.

* The per-rank (query, key) pair count of ``cp_balance`` equals a brute-force count of the True
  entries of ``documents.document_attention``'s mask for each rank's query rows (zig-zag and a
  scrambled order, a batch of windows with documents of length 1 and one cut by the window's end).
* At cp4 and S = 8192 zig-zag is uneven under masks: one 6k-token document plus short ones puts
  max/mean well above 1.2 (the numbers are in the README).
* The balanced order (``balanced_order``, k = 4) is a partition of the window into equal ascending
  rows, and brings max/mean to at most 1.2 for that window, for a micro-batch of two windows, and
  for every window of the ``stdlib`` source's length mix (its files' byte sizes + 1 separator,
  packed as the sampler packs them: the byte tokenizer's exact counts here); it keeps zig-zag where
  zig-zag is already even (one document filling the window).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from nanotrain.data.sources import stdlib_files
from nanotrain.parallel.context_parallel import cp_positions
from nanotrain.parallel.cp_balance import (
    attention_flops,
    balanced_order,
    imbalance,
    packed_documents,
    rank_pairs,
    token_pairs,
    zigzag_order,
)
from nanotrain.parallel.documents import document_attention

CP, SEQ = 4, 8192


def _brute_pairs(documents: torch.Tensor, order: np.ndarray) -> list[int]:
    """True entries of the block-causal mask in each rank's query rows, summed over the batch."""
    counts = []
    for positions in order:
        _, mask = document_attention(documents, torch.as_tensor(positions))
        counts.append(int(mask.sum()))
    return counts


def _six_k_window() -> np.ndarray:
    """One 6144-token document after a few short ones, then short ones (16-256 tokens) to the end."""
    rng = np.random.default_rng(0)
    short = rng.integers(16, 257, size=200)
    return packed_documents([*short[:5], 6144, *short[5:]], SEQ)


def test_pair_count_equals_the_mask():
    lengths = [1, 5, 1, 9, 3, 1, 20, 7, 2, 30]  # 79 tokens: the second window cuts a document
    documents = torch.as_tensor(np.stack([packed_documents(lengths, 32, w) for w in (0, 1)]))
    scrambled = np.random.default_rng(1).permutation(32).reshape(2, 16)
    for order in (zigzag_order(32, 2), np.sort(scrambled, axis=1), zigzag_order(32, 4)):
        assert rank_pairs(documents, order).tolist() == _brute_pairs(documents, order)
    assert token_pairs(documents).sum() == sum(_brute_pairs(documents, np.arange(32)[None]))


def test_zigzag_order_is_cp_positions_and_even_without_masks():
    order = zigzag_order(SEQ, CP)
    for rank in range(CP):
        assert order[rank].tolist() == cp_positions(SEQ, CP, rank).tolist()
    one_document = np.zeros(SEQ, dtype=np.int64)
    assert imbalance(rank_pairs(one_document, order)) == 1.0


def test_zigzag_is_uneven_under_masks():
    pairs = rank_pairs(_six_k_window(), zigzag_order(SEQ, CP))
    assert imbalance(pairs) > 1.4
    flops = attention_flops(pairs, head_dim=128, heads=32)
    assert flops.tolist() == [4 * 128 * 32 * int(p) for p in pairs]


def _assert_partition(order: np.ndarray, seq_len: int, cp: int):
    assert order.shape == (cp, seq_len // cp)
    assert (np.diff(order, axis=1) > 0).all()
    assert sorted(order.reshape(-1).tolist()) == list(range(seq_len))


def test_balanced_order_evens_the_six_k_window():
    documents = _six_k_window()
    order = balanced_order(documents, CP)
    _assert_partition(order, SEQ, CP)
    assert imbalance(rank_pairs(documents, order)) <= 1.2
    batch = np.stack([documents, packed_documents([100, 7000, *[64] * 30], SEQ)])
    order = balanced_order(batch, CP)
    _assert_partition(order, SEQ, CP)
    assert imbalance(rank_pairs(batch, order)) <= 1.2
    one_document = np.zeros(SEQ, dtype=np.int64)
    assert (balanced_order(one_document, CP) == zigzag_order(SEQ, CP)).all()


def test_balanced_order_evens_every_stdlib_window():
    lengths = [size + 1 for size in (os.path.getsize(f) for f in stdlib_files()) if size]
    windows = (sum(lengths) - 1) // SEQ
    worst_zigzag = worst = 0.0
    for window in range(windows):
        documents = packed_documents(lengths, SEQ, window)
        worst_zigzag = max(worst_zigzag, imbalance(rank_pairs(documents, zigzag_order(SEQ, CP))))
        worst = max(worst, imbalance(rank_pairs(documents, balanced_order(documents, CP))))
    assert worst_zigzag > 1.2 and worst <= 1.2
