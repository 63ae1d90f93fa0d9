"""Which windows each dp rank trains on at each step, as a pure function of the position.

The run reads one endless *global sample stream*: global sample g is window `perm_e[g % W]`,
where W is the number of windows, e = g // W is the epoch, and `perm_e` is a permutation drawn
from `numpy.random.SeedSequence([seed, e])` (a fresh order every epoch; the pair, unlike
`seed + epoch`, never lets seed 1's second epoch repeat seed 2's first).

Step s consumes the G = dp * m * micro_batch_size samples [s*G, (s+1)*G); dp rank d takes the
contiguous m*mbs of them starting at s*G + d*m*mbs, as m micro-batches. The position of a run is
therefore one integer, the consumed sample count: restoring it restores the data order exactly,
and at another dp the global stream is unchanged, only its split across ranks differs. Nothing
here keeps state besides a cache of the current epoch's permutation.
"""
from __future__ import annotations

import numpy as np
import torch

from nanotrain.data.dataset import TokenDataset
from nanotrain.data.errors import DataError


class GlobalSampler:
    """Maps (consumed samples, dp rank) to that rank's micro-batches; see the module docstring."""

    def __init__(self, dataset: TokenDataset, *, seed: int, dp: int, micro_batch_size: int,
                 batch_accumulation: int):
        self.dataset = dataset
        self.seed = int(seed)
        self.dp = dp
        self.micro_batch_size = micro_batch_size
        self.batch_accumulation = batch_accumulation
        self.per_rank = batch_accumulation * micro_batch_size
        self.global_batch_size = dp * self.per_rank
        if dataset.num_windows < self.global_batch_size:
            raise DataError(
                f"data: too little data for one global batch: {dataset.num_windows} windows of "
                f"training.sequence_length+1={dataset.seq_len + 1} tokens exist "
                f"({dataset.num_tokens} tokens), {self.global_batch_size} needed "
                f"(parallelism.dp={dp} x training.batch_accumulation_per_replica="
                f"{batch_accumulation} x training.micro_batch_size={micro_batch_size}); "
                f"add data or lower those fields")
        self._perms: dict[int, np.ndarray] = {}

    @property
    def samples_per_epoch(self) -> int:
        return self.dataset.num_windows

    def consumed_samples(self, step: int) -> int:
        """Global samples consumed before step `step` (= after `step` completed steps)."""
        return step * self.global_batch_size

    def epoch_of(self, consumed_samples: int) -> int:
        return consumed_samples // self.samples_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs
                self._perms.pop(min(self._perms))
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            self._perms[epoch] = rng.permutation(self.samples_per_epoch)
        return self._perms[epoch]

    def window_indices(self, start: int, count: int) -> np.ndarray:
        """Window ids of global samples [start, start+count), crossing epochs as needed."""
        if start < 0 or count < 0:
            raise ValueError(f"start={start} and count={count} must be >= 0")
        g = np.arange(start, start + count, dtype=np.int64)
        epochs, within = np.divmod(g, self.samples_per_epoch)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._permutation(int(e))[within[sel]]
        return out

    def samples(self, start: int, count: int) -> np.ndarray:
        """Global samples [start, start+count) as int64 windows [count, S+1]."""
        return self.dataset.windows(self.window_indices(start, count))

    def batch(self, consumed_samples: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """dp rank `dp_rank`'s m micro-batches of the step that starts at `consumed_samples`.

        Each is (input ids, targets), both int64 [micro_batch_size, sequence_length], targets
        being the inputs shifted left by one token.
        """
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, {self.dp})")
        w = torch.from_numpy(self.samples(consumed_samples + dp_rank * self.per_rank, self.per_rank))
        w = w.view(self.batch_accumulation, self.micro_batch_size, -1)
        return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in w]

    def batch_for_step(self, step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`batch(consumed_samples(step), dp_rank)`: step `step` (0-based) of a run that started
        at sample 0 with this global batch size."""
        return self.batch(self.consumed_samples(step), dp_rank)
