"""Per-cp-rank attention work under document masks, zig-zag vs the balanced order.

Host arithmetic only (``nanotrain/parallel/cp_balance.py``), no model and no ranks, in seconds:

    .venv/bin/python benchmarks/cp_balance.py [--cp 4] [--seq 8192] [--heads 32] [--head-dim 128]

Prints max/mean of the per-rank (query, key) pairs under the block-causal mask, and each rank's
forward attention GFLOP (4 * head_dim * heads * pairs, per layer and sequence) for
(a) one window holding a 6144-token document after a few short ones (16-256 tokens) and short
ones after it, and (b) every window of the ``stdlib`` source packed as the sampler packs it
(document lengths: the files' byte sizes + 1 separator, the byte tokenizer's counts): the mean
and the worst window.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.data.sources import stdlib_files  # noqa: E402
from nanotrain.parallel.cp_balance import (  # noqa: E402
    attention_flops,
    balanced_order,
    imbalance,
    packed_documents,
    rank_pairs,
    zigzag_order,
)


def six_k_window(seq: int) -> np.ndarray:
    """Document ids of one window: 5 short documents, a 6144-token one, short ones to the end."""
    short = np.random.default_rng(0).integers(16, 257, size=seq // 16)
    return packed_documents([*short[:5], 6144, *short[5:]], seq)


def stdlib_lengths() -> list[int]:
    """Token counts of the stdlib source's documents under the byte tokenizer: bytes + separator
    (empty files are skipped, as the tokeniser skips empty documents)."""
    return [size + 1 for size in (os.path.getsize(f) for f in stdlib_files()) if size]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    cp, seq = args.cp, args.seq
    zigzag = zigzag_order(seq, cp)

    def gflops(pairs) -> str:
        return " ".join(f"{x / 1e9:.1f}" for x in attention_flops(pairs, args.head_dim, args.heads))

    print(f"cp{cp}, S = {seq}, {args.heads} heads x {args.head_dim}: max/mean of per-rank masked attention work")
    documents = six_k_window(seq)
    for name, order in (("zig-zag", zigzag), ("balanced", balanced_order(documents, cp))):
        pairs = rank_pairs(documents, order)
        print(f"  6k document + short ones, {name:8s}: {imbalance(pairs):.3f} (forward GFLOP by rank: {gflops(pairs)})")
    lengths = stdlib_lengths()
    windows = (sum(lengths) - 1) // seq
    ratios = {"zig-zag": [], "balanced": []}
    for w in range(windows):
        documents = packed_documents(lengths, seq, w)
        ratios["zig-zag"].append(imbalance(rank_pairs(documents, zigzag)))
        ratios["balanced"].append(imbalance(rank_pairs(documents, balanced_order(documents, cp))))
    for name, values in ratios.items():
        print(
            f"  stdlib, {windows} windows, {name:8s}: mean {np.mean(values):.3f}, worst {np.max(values):.3f}"
            f" ({sum(v > 1.2 for v in values)} windows above 1.2)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
