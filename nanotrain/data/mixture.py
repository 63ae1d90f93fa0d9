"""Weighted mixtures: global sample index -> (source, that source's sample index), in closed form.

Why a periodic pattern (and not Megatron's sequential greedy, nor a random draw per sample): the
run's data position must stay one integer (consumed samples), so the source of sample g and the
rank of g among its source's samples must be computable from g alone, at any g, on any rank,
in O(1). A random draw per sample also drifts: over 1,000 samples a 0.1 share has a standard
deviation of ~1%, which breaks the 1% promise.

The pattern: weights are rounded to integer counts n_k summing to P = `PERIOD` (largest remainder),
and one period lists source k's i-th sample at the ideal position (i + 0.5) / n_k of the period,
all of them sorted by that position. Then, for every k and every prefix of n samples of the
endless stream, |count_k(n) - n * n_k / P| stays below about one sample (at most K/2 + 1 in
theory for K sources; below 1 for every weight set in tests/test_mixture.py), so any window of
N consecutive samples holds source k's share within ~2/N of n_k/P (0.2% at N = 1,000), and
n_k/P is within 1/P of the weight. Sample g is in period q = g // P at offset r = g % P; its
source is pattern[r] and its rank within that source is q * n_k + rank[r].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nanotrain.data.errors import DataError

PERIOD = 10_000


def integer_counts(weights, period: int = PERIOD) -> np.ndarray:
    """Counts per source that sum to `period`, proportional to `weights` (largest remainder).

    Raises DataError, naming `data.sources[i].weight`, for weights whose sum overflows a float
    (every share would be 0) and for a source whose share rounds to no sample in a period: it
    would never be read, silently. `check_data_config` calls this before launch."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise DataError(f"data.sources: weights must be positive numbers, got {list(weights)}")
    with np.errstate(over="ignore"):  # an overflowing sum is refused just below, not warned about
        total = w.sum()
    if not np.isfinite(total):
        raise DataError(
            f"data.sources: the weights sum to more than a float holds ({list(weights)}): "
            "scale them down (only their ratios matter), e.g. to shares that sum to 1"
        )
    exact = w / total * period
    counts = np.floor(exact).astype(np.int64)
    short = period - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    if not np.all(counts > 0):
        i = int(np.argmin(counts))
        raise DataError(
            f"data.sources[{i}].weight: {weights[i]:g} is {w[i] / total:.2g} of the total weight, "
            f"less than one sample in {period}, so the source would never be read: raise its "
            "weight or drop the source"
        )
    return counts


@dataclass(frozen=True)
class MixturePattern:
    """The period of the mixture; see the module docstring."""

    counts: np.ndarray  # [K] samples of each source per period
    source: np.ndarray  # [P] source id of each offset
    rank: np.ndarray  # [P] rank of that offset among its source's offsets
    prefix: np.ndarray  # [K, P+1] samples of source k among offsets [0, r)

    @classmethod
    def of(cls, weights, period: int = PERIOD) -> "MixturePattern":
        counts = integer_counts(weights, period if len(weights) > 1 else 1)
        ids = np.repeat(np.arange(len(counts)), counts)
        ranks = np.concatenate([np.arange(n) for n in counts])
        ideal = (ranks + 0.5) / counts[ids]
        order = np.lexsort((ids, ideal))  # by ideal position, ties by source id
        source, rank = ids[order], ranks[order]
        prefix = np.zeros((len(counts), len(source) + 1), dtype=np.int64)
        prefix[source, np.arange(1, len(source) + 1)] = 1
        return cls(counts, source, rank, np.cumsum(prefix, axis=1))

    @property
    def period(self) -> int:
        return int(self.source.shape[0])

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source id, rank among that source's samples) of global samples `g`."""
        q, r = np.divmod(np.asarray(g, dtype=np.int64), self.period)
        src = self.source[r]
        return src, q * self.counts[src] + self.rank[r]

    def count(self, n: int) -> np.ndarray:
        """[K] samples of each source among global samples [0, n)."""
        q, r = divmod(int(n), self.period)
        return q * self.counts + self.prefix[:, r]
