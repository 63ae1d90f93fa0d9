"""Which windows each dp rank trains on at each step, as a pure function of the position.

The run reads one endless *global sample stream*. With one source, global sample g is window
`perm_e[g % W]`, where W is the number of windows, e = g // W is the epoch, and `perm_e` is a
permutation drawn from `numpy.random.SeedSequence([seed, e])` (a fresh order every epoch; the
pair, unlike `seed + epoch`, never lets seed 1's second epoch repeat seed 2's first). With a
weighted mixture (`data.sources`), `mixture.MixturePattern` first maps g to (source k, j = the
rank of g among source k's samples), and j walks source k's windows the same way, each source
with its own epochs and shuffles (`SeedSequence([seed, e, k])`): a source that runs out starts a
new epoch on its own while the others go on.

Step s consumes the G = dp * m * micro_batch_size samples [s*G, (s+1)*G); dp rank d takes the
contiguous m*mbs of them starting at s*G + d*m*mbs, as m micro-batches. The position of a run is
therefore one integer, the consumed sample count: restoring it restores the data order exactly,
and at another dp the global stream is unchanged, only its split across ranks differs. Nothing
here keeps state besides a cache of the current epochs' permutations.

Document masking (`data.document_masking`): each micro-batch also carries its per-token document
ids, int64 [micro_batch_size, sequence_length], computed here on the host from the windows
(`document_ids`): the id of input token i is the number of separators among the window's inputs
before i, so a document is its tokens up to and including its separator, and the window's first
token starts document 0 (a document cut by a window's edge is a document of its own in each
window). `data.mask_boundary_loss` sets to -100 (ignored) the targets that cross a boundary: those
of the separator tokens, whose target is the next document's first token. Under
`parallelism.cp_balance: documents` each micro-batch also carries the token order over the cp
ranks that evens their masked attention work (`parallel/cp_balance.py`), chosen here on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from nanotrain.data.dataset import TokenDataset
from nanotrain.data.errors import DataError
from nanotrain.data.mixture import MixturePattern
from nanotrain.parallel.cp_balance import balanced_order

DEFAULT_NAME = "default"  # the TensorBoard name (data/tokens/default) of the `data.source` shorthand
IGNORE_INDEX = -100  # a target the loss skips (F.cross_entropy's and the vocab-parallel loss's default)


def document_ids(ids: torch.Tensor, separator_id: int) -> torch.Tensor:
    """Per-token document ids of input windows ``ids`` ``[..., S]``: the count of separators
    strictly before each token, so a separator belongs to the document it ends (int64, from 0)."""
    ends = (ids == separator_id).to(torch.int64)
    return ends.cumsum(-1) - ends


@dataclass(frozen=True)
class SourcePart:
    """Windows [lo, hi) of one tokenised source, as one member of a mixture.

    `lo`/`hi` carve a validation split out of a source (training takes the head, validation
    the tail); `shuffle=False` reads the windows in order (validation)."""

    name: str
    dataset: TokenDataset
    weight: float = 1.0
    lo: int = 0
    hi: Optional[int] = None
    shuffle: bool = True

    @property
    def num_windows(self) -> int:
        return (self.dataset.num_windows if self.hi is None else self.hi) - self.lo


class GlobalSampler:
    """Maps (consumed samples, dp rank) to that rank's micro-batches; see the module docstring.

    `dataset` is one `TokenDataset` (the `data.source` shorthand) or a list of `SourcePart`.
    `document_masking`: micro-batches are (ids, targets, document ids); `mask_boundary_loss`:
    the separators' targets are ignored (see the module docstring)."""

    def __init__(
        self,
        dataset: TokenDataset | Sequence[SourcePart],
        *,
        seed: int,
        dp: int,
        micro_batch_size: int,
        batch_accumulation: int,
        document_masking: bool = False,
        mask_boundary_loss: bool = False,
        cp_balance: int = 1,
    ):
        parts = [SourcePart(DEFAULT_NAME, dataset)] if isinstance(dataset, TokenDataset) else list(dataset)
        self.parts = parts
        self.dataset = parts[0].dataset
        self.document_masking, self.mask_boundary_loss = document_masking, mask_boundary_loss
        self.cp_balance = cp_balance if document_masking else 1
        self.separator_id = self.dataset.separator_id
        if (document_masking or mask_boundary_loss) and len({p.dataset.separator_id for p in parts}) > 1:
            raise DataError(
                "data: the sources' separator ids differ ("
                + ", ".join(f"{p.name}: {p.dataset.separator_id}" for p in parts)
                + "); data.document_masking and data.mask_boundary_loss need one separator"
            )
        self.seed = int(seed)
        self.dp = dp
        self.micro_batch_size = micro_batch_size
        self.batch_accumulation = batch_accumulation
        self.per_rank = batch_accumulation * micro_batch_size
        self.global_batch_size = dp * self.per_rank
        self.pattern = MixturePattern.of([p.weight for p in parts])
        for part in parts:  # a mixture's source (or a validation set) needs one window; a lone
            need = self.global_batch_size if len(parts) == 1 and part.shuffle else 1  # source a batch
            if part.num_windows < need:
                ds = part.dataset
                which = "" if len(parts) == 1 else f" in source {part.name!r}"
                raise DataError(
                    f"data: too little data{which} for one global batch: {part.num_windows} windows of "
                    f"training.sequence_length+1={ds.seq_len + 1} tokens exist ({ds.num_tokens} tokens), "
                    f"{need} needed (parallelism.dp={dp} x training.batch_accumulation_per_replica="
                    f"{batch_accumulation} x training.micro_batch_size={micro_batch_size}); "
                    f"add data or lower those fields"
                )
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def samples_per_epoch(self) -> int:
        """Windows of the first source (the one source of a `data.source` run)."""
        return self.parts[0].num_windows

    def consumed_samples(self, step: int) -> int:
        """Global samples consumed before step `step` (= after `step` completed steps)."""
        return step * self.global_batch_size

    def epoch_of(self, consumed_samples: int) -> int:
        """The epoch of the first source that the next sample is in."""
        return int(self.source_samples(consumed_samples)[0]) // self.samples_per_epoch

    def source_samples(self, consumed_samples: int) -> np.ndarray:
        """[K] samples each source contributed to global samples [0, consumed_samples)."""
        return self.pattern.count(consumed_samples)

    def source_epochs(self, consumed_samples: int) -> dict[str, float]:
        """Epochs of each source completed after `consumed_samples` (fractional: 1.5 = half-way
        through the second pass)."""
        used = self.source_samples(consumed_samples)
        return {p.name: float(n) / p.num_windows for p, n in zip(self.parts, used)}

    def source_tokens(self, consumed_samples: int) -> dict[str, int]:
        """Target tokens each source contributed (every sample has sequence_length of them)."""
        used = self.source_samples(consumed_samples)
        return {p.name: int(n) * p.dataset.seq_len for p, n in zip(self.parts, used)}

    def _permutation(self, k: int, epoch: int) -> np.ndarray:
        key = (k, epoch)
        if key not in self._perms:
            if len(self._perms) >= 2 * len(self.parts):  # a batch spans at most two epochs per source
                self._perms.pop(next(iter(self._perms)))
            parts = [self.seed, epoch] if len(self.parts) == 1 else [self.seed, epoch, k]
            rng = np.random.default_rng(np.random.SeedSequence(parts))
            self._perms[key] = rng.permutation(self.parts[k].num_windows)
        return self._perms[key]

    def locate(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source id, window id within that source's dataset) of global samples [start, start+count)."""
        if start < 0 or count < 0:
            raise ValueError(f"start={start} and count={count} must be >= 0")
        src, j = self.pattern.locate(np.arange(start, start + count, dtype=np.int64))
        out = np.empty(count, dtype=np.int64)
        for k in np.unique(src):
            part = self.parts[int(k)]
            sel = src == k
            epochs, within = np.divmod(j[sel], part.num_windows)
            if not part.shuffle:
                out[sel] = part.lo + within
                continue
            got = np.empty(int(sel.sum()), dtype=np.int64)
            for e in np.unique(epochs):
                here = epochs == e
                got[here] = self._permutation(int(k), int(e))[within[here]]
            out[sel] = part.lo + got
        return src, out

    def window_indices(self, start: int, count: int) -> np.ndarray:
        """Window ids of global samples [start, start+count) (one source), crossing epochs as needed."""
        return self.locate(start, count)[1]

    def samples(self, start: int, count: int) -> np.ndarray:
        """Global samples [start, start+count) as int64 windows [count, S+1]."""
        src, win = self.locate(start, count)
        if len(self.parts) == 1:
            return self.dataset.windows(win)
        out = np.empty((count, self.dataset.seq_len + 1), dtype=np.int64)
        for k in np.unique(src):
            sel = src == k
            out[sel] = self.parts[int(k)].dataset.windows(win[sel])
        return out

    def batch(self, consumed_samples: int, dp_rank: int) -> list[tuple[torch.Tensor, ...]]:
        """dp rank `dp_rank`'s m micro-batches of the step that starts at `consumed_samples`.

        Each is (input ids, targets), both int64 [micro_batch_size, sequence_length], targets
        being the inputs shifted left by one token; with `document_masking` (input ids, targets,
        document ids), the third of the same shape (`document_ids`). With `mask_boundary_loss`
        the separators' targets are -100. With `cp_balance` = cp > 1 (`parallelism.cp_balance:
        documents`) a fourth: the micro-batch's token order over the cp ranks, int64 [cp, S/cp]
        (`parallel/cp_balance.py`), which evens their masked attention work.
        """
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, {self.dp})")
        w = torch.from_numpy(self.samples(consumed_samples + dp_rank * self.per_rank, self.per_rank))
        w = w.view(self.batch_accumulation, self.micro_batch_size, -1)
        if not (self.document_masking or self.mask_boundary_loss):
            return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in w]
        out = []
        for mb in w:
            ids, targets = mb[:, :-1].contiguous(), mb[:, 1:].contiguous()
            if self.mask_boundary_loss:  # not in place: for one row, ids and targets share storage
                targets = targets.masked_fill(ids == self.separator_id, IGNORE_INDEX)
            if not self.document_masking:
                out.append((ids, targets))
                continue
            documents = document_ids(ids, self.separator_id)
            if self.cp_balance > 1:
                out.append((ids, targets, documents, torch.from_numpy(balanced_order(documents, self.cp_balance))))
            else:
                out.append((ids, targets, documents))
        return out

    def batch_for_step(self, step: int, dp_rank: int) -> list[tuple[torch.Tensor, ...]]:
        """`batch(consumed_samples(step), dp_rank)`: step `step` (0-based) of a run that started
        at sample 0 with this global batch size."""
        return self.batch(self.consumed_samples(step), dp_rank)
