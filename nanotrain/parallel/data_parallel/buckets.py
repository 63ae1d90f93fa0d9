"""Gradient buckets and the ZeRO-1 partition they define: pure arithmetic on parameter sizes.

One rule, used by three parties that must agree without talking: ``BucketedGradSync`` (which
flat buffer each gradient lives in), ``ZeroOneOptimizer`` (which elements a dp rank updates) and
the offline resharder (``checkpoint/reshard.py``, which writes the ranges a run at another
topology will hold).

* Buckets: the parameters in REVERSE order (backward produces the output layers' gradients
  first), greedily filled up to ``cap_bytes``; a parameter larger than the cap, or of another
  dtype or device, starts a new bucket. ``alone`` gives some parameters a bucket of their own.
* Sharded over a group of n (ZeRO-1, Megatron's distributed optimizer): every bucket is padded
  to a multiple of n and cut into n equal contiguous pieces; rank r owns piece r of every bucket.
  The gradient bucket is then reduce-scattered into exactly that piece and the parameter bucket
  all-gathered from it. A parameter lies in one bucket, so a rank owns one contiguous range of
  each parameter's flattened elements, or none.

Why tied parameters go alone when sharding: the first and the last pipeline stage each hold a
copy of a tied embedding inside buckets of otherwise different parameters, and sum the copies'
gradients elementwise after the dp reduction. That sum is right only where both copies hold the
dp-reduced values, i.e. if rank r owns the same range of the parameter on both stages. In a bucket
of its own the range depends on the parameter's size alone (Megatron does the same).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from nanotrain.parallel.pipeline_parallel.tied import is_tied

DEFAULT_BUCKET_CAP_MB = 25.0  # build_grad_sync's, hence the trainer's (the resharder assumes it)


def cap_bytes(bucket_cap_mb: float) -> int:
    return max(1, int(bucket_cap_mb * 1024 * 1024))


def bucket_layout(
    params: Sequence[torch.Tensor],
    cap: int,
    alone: Optional[Callable[[torch.Tensor], bool]] = None,
    units: Optional[Sequence[str]] = None,
) -> list[list[int]]:
    """Indices into ``params`` of each bucket's parameters, in bucket order (see module doc).
    ``units`` (ZeRO-3: each parameter's gather unit, ``shard_params.unit_of_name``): a bucket
    never spans two units."""
    groups: list[list[int]] = []
    size = 0
    last_alone = False
    for i in reversed(range(len(params))):  # ~ the order backward produces gradients
        p = params[i]
        nbytes = p.numel() * p.element_size()
        own = bool(alone is not None and alone(p))
        if (
            not groups
            or own
            or last_alone
            or size + nbytes > cap
            or params[groups[-1][0]].dtype != p.dtype
            or params[groups[-1][0]].device != p.device
            or (units is not None and units[groups[-1][0]] != units[i])
        ):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
        last_alone = own
    return groups


def padded(numel: int, shards: int) -> int:
    """``numel`` rounded up to a multiple of ``shards`` (at least ``shards``: no empty buffer)."""
    return max(1, math.ceil(numel / shards)) * shards


def shard_pieces(
    bucket_numels: Sequence[Sequence[int]], sizes: Sequence[int], shards: int, rank: int
) -> list[tuple[int, int, int, int]]:
    """The pieces ``rank`` owns: (bucket, position in the bucket, start, stop) with [start, stop)
    a range of that parameter's flattened elements. ``bucket_numels``: the parameter sizes of each
    bucket in buffer order; ``sizes``: each bucket's (padded) length, a multiple of ``shards``."""
    out = []
    for k, (numels, size) in enumerate(zip(bucket_numels, sizes)):
        chunk = size // shards
        lo, hi = rank * chunk, (rank + 1) * chunk
        offset = 0
        for j, n in enumerate(numels):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out.append((k, j, a - offset, b - offset))
            offset += n
    return out


def sharded_layout(params: Sequence[torch.Tensor], cap: int, units: Optional[Sequence[str]] = None) -> list[list[int]]:
    """``bucket_layout`` for ZeRO-1/2/3: tied parameters alone (module doc); at ZeRO-3 cut at
    ``units`` too."""
    return bucket_layout(params, cap, alone=is_tied, units=units)


def zero_ranges(
    params: Sequence[torch.Tensor],
    shards: int,
    rank: int,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    units: Optional[Sequence[str]] = None,
) -> list[tuple[int, int, int]]:
    """(index into ``params``, start, stop) of what ``rank`` of ``shards`` owns when a
    ``BucketedGradSync`` over ``params`` (the trainable ones, in model order) is sharded for
    ZeRO-1: the ranges ``ZeroOneOptimizer`` holds, computed from the sizes alone (offline
    resharding). A group of one keeps the unsharded buckets, where rank 0 owns everything.
    ``units``: ZeRO-3's gather unit of each parameter (its buckets are cut at them)."""
    layout = (
        sharded_layout(params, cap_bytes(bucket_cap_mb), units)
        if shards > 1
        else bucket_layout(params, cap_bytes(bucket_cap_mb))
    )
    numels = [[params[i].numel() for i in bucket] for bucket in layout]
    lengths = [padded(sum(n), shards) if shards > 1 else sum(n) for n in numels]
    return [(layout[k][j], a, b) for k, j, a, b in shard_pieces(numels, lengths, shards, rank)]
