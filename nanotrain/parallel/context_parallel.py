"""Context parallelism: each of the cp ranks of a replica holds a part of every sequence.

Long sequences cost activation memory linearly and attention compute quadratically; cp splits
both. This is the all-gather variant (Llama 3's, torchtitan's ``allgather`` rotate method):

* Sharding is load-balanced ("zig-zag"): the sequence is cut into 2*cp equal chunks and rank r
  keeps chunks r and 2*cp-1-r. Under the causal mask a late chunk attends to far more keys than an
  early one; pairing the i-th earliest with the i-th latest gives every rank the same work.
* Every layer computes q, k, v for its own tokens only, rotates them with RoPE at their *global*
  positions, then all-gathers k and v (one collective: they travel concatenated) over ``cp_pg``
  and puts them back in position order. Each of the rank's two query chunks then attends to the
  keys up to its own end under a bottom-right-aligned causal mask
  (``torch.nn.attention.bias.causal_lower_right``: never materialised by the CUDA flash /
  memory-efficient kernels, so no S x S mask at long context), which is exactly attention over
  the whole sequence. The all-gather's backward is a reduce-scatter (sum): each rank's k/v
  gradient collects what every rank's queries sent it.
* The loss is each rank's mean over its tokens (all ranks hold the same count); gradients are
  averaged over dp x cp by the data-parallel sync (``pc.dp_cp_pg``), which gives the gradient of
  the mean over the whole sequence. cp ranks are replicas of the parameters and optimizer state,
  like dp ranks; they read the same samples (the data sampler is indexed by dp rank only).

* Document masking (``data.document_masking``, ``documents.py``): the rank's queries keep their
  zig-zag global positions; the mask ``[B, 1, S/cp, S]`` (built from the whole window's document
  ids, which every cp rank holds) lets query i see key j iff j <= its global position and both
  lie in the same document; RoPE rotates each token at its position within its document. Each
  chunk's keys are still cut at the chunk's end (the mask's later columns are all False there).

* Balanced order (``parallelism.cp_balance: documents``, ``cp_balance.py``): under document masks
  zig-zag no longer evens the work (a rank holding a long document's late part does most of it),
  so each micro-batch brings its own token order ``[cp, S/cp]`` (rank r holds the ascending global
  positions ``order[r]``), chosen on the host from the document ids with the batch. The gathered
  keys then stay in gather order (rank 0's, rank 1's, ...: no sort, which would need the order on
  every layer) and the mask's columns follow it (``document_attention(..., key_positions)``); each
  rank's queries attend once over all gathered keys under that mask. Through the materialised
  mask that is S/cp x S dense work per rank (zig-zag's cut chunks do about half): the balance
  pays with a kernel that skips masked blocks.
* Under ``model.attention_kernel: flex`` the mask is a FlexAttention block mask built for this
  rank's query positions over the gathered keys' positions (``document_blocks.py``): one flex
  call for both chunks, whatever the order, whose skipped tiles give zig-zag's causal cut and the
  documents' savings alike.

Everything outside attention (norms, MLP, LM head, loss, pipeline transfers) is per token and
runs unchanged on the local tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from nanotrain.parallel.sdpa import BlockMask, masked_sdpa, sdpa
from nanotrain.parallel.tensor_parallel import gather_along_dim0, group_rank, group_size


def cp_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (int64, ascending) of the tokens cp rank ``rank`` holds of a sequence of
    ``seq_len`` tokens: chunks ``rank`` and ``2*cp-1-rank`` of 2*cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2*cp = {2 * cp}")
    if cp == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


BALANCES = ("zigzag", "documents")


def zigzag_table(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """``[cp, S/cp]``: row r is ``cp_positions(seq_len, cp, r)``, the token order of zig-zag."""
    return torch.stack([cp_positions(seq_len, cp, r, device) for r in range(cp)])


class ContextParallel:
    """The cp group of a model and the per-length index tables derived from it (cached).

    ``cp_pg`` None or of size 1 means no context parallelism: ``local`` is the identity and the
    model's attention uses the plain causal mask."""

    def __init__(self, cp_pg, balance: str = "zigzag"):
        if balance not in BALANCES:
            raise ValueError(f"cp balance {balance!r}: one of {BALANCES}")
        self.group, self.balance = cp_pg, balance
        # None is "no cp group", not the default group (which group_size(None) would measure):
        # a model built without a cp_pg in a multi-rank world must not split its sequences.
        self.size, self.rank = (1, 0) if cp_pg is None else (group_size(cp_pg), group_rank(cp_pg))
        self._cache: dict = {}

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def balanced(self) -> bool:
        """Per-micro-batch token orders (``balance`` "documents") instead of the fixed zig-zag."""
        return self.enabled and self.balance == "documents"

    def positions(self, seq_len: int, device) -> torch.Tensor:
        """Global positions of this rank's tokens."""
        key = ("positions", seq_len, device)
        if key not in self._cache:
            self._cache[key] = cp_positions(seq_len, self.size, self.rank, device)
        return self._cache[key]

    def local(self, tokens: torch.Tensor, dim: int = 1, order: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's tokens of a full-length tensor (``[B, S]`` ids or targets: dim 1), under
        the token ``order`` ``[cp, S/cp]`` (None: zig-zag)."""
        if not self.enabled:
            return tokens
        mine = self.positions(tokens.shape[dim], tokens.device) if order is None else order[self.rank]
        return tokens.index_select(dim, mine)

    def _position_order(self, seq_len: int, device) -> torch.Tensor:
        """Index that sorts the gathered tokens (cp-rank order: rank 0's, rank 1's, ...) by position."""
        key = ("order", seq_len, device)
        if key not in self._cache:
            gathered = torch.cat([cp_positions(seq_len, self.size, r, device) for r in range(self.size)])
            self._cache[key] = torch.argsort(gathered)
        return self._cache[key]

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather ``[S/cp, B, kv_heads, d]`` keys and values along the sequence (one
        differentiable collective; backward reduce-scatters their gradients) and return them for
        the whole sequence in position order (gather order under a balanced order), ``[S, B,
        kv_heads, d]``."""
        both = gather_along_dim0(torch.cat([k, v], dim=-1), self.group)
        if self.balanced:  # gather order; the mask's columns follow it
            return both.split(k.shape[-1], dim=-1)
        both = both.index_select(0, self._position_order(both.shape[0], both.device))
        return both.split(k.shape[-1], dim=-1)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention of this rank's queries ``[B, heads, S/cp, d]`` (its two chunks) over
        the whole sequence's keys and values ``[B, heads, S, d]`` (position order); with a boolean
        ``mask`` ``[B, 1, S/cp, S]`` (document masking) attention under that mask instead; under a
        balanced order (keys in gather order) all queries at once under the mask."""
        if self.balanced or isinstance(mask, BlockMask):  # a block mask knows every query's keys
            if mask is None:
                raise ValueError("cp balance 'documents' needs document masking (data.document_masking)")
            return masked_sdpa(q, k, v, mask)
        chunk = q.shape[2] // 2
        outputs = []
        for half, index in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            rows = slice(half * chunk, (half + 1) * chunk)
            visible = (index + 1) * chunk  # keys up to the end of this chunk
            part, keys, values = q[:, :, rows], k[:, :, :visible], v[:, :, :visible]
            if mask is None:
                outputs.append(sdpa(part, keys, values, attn_mask=causal_lower_right(chunk, visible)))
            else:
                outputs.append(masked_sdpa(part, keys, values, mask[:, :, rows, :visible]))
        return torch.cat(outputs, dim=2)


class ContextParallelKernel(nn.Module):
    """The attention kernel under cp: this rank's two query chunks over the gathered keys and
    values (``ContextParallel.attention``). No parameters, no communication: what selective
    recompute redoes, as the plain causal kernel."""

    def __init__(self, cp: ContextParallel):
        super().__init__()
        self.cp = cp

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.cp.attention(q, k, v, mask)


class GatherKV(nn.Module):
    """Wraps an attention core (rotated ``q, k, v`` ``[S, B, heads, d]`` -> output): its keys and
    values become the whole sequence's, gathered over cp in position order, before it runs."""

    def __init__(self, core: nn.Module, cp: ContextParallel):
        super().__init__()
        self.inner, self.cp = core, cp

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        k, v = self.cp.gather_kv(k, v)
        return self.inner(q, k, v, mask)
