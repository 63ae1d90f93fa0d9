"""Shard metadata carried by every parameter: what full tensor it is a piece of, and which pieces.

Why on the parameter (as nanotron's NanotronParameter does): the checkpoint writer, the resharder,
the gradient-norm and the initialiser all need to know, for any parameter, its unsharded shape,
which slices of the full tensor this rank holds and where they sit in the local tensor, and over
which process-group axis the pieces differ. One record answers all of them with no model code.

A fused projection (QKV, gate/up) holds several pieces of one local tensor: its `pairs` list a
(local index, global index) per piece. A vocab-padded shard lists only its real rows, so padding
never reaches a checkpoint and a different tp re-pads as it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Index = tuple[slice, ...]

_ATTR = "_nanotrain_shard"


@dataclass(frozen=True)
class ShardInfo:
    global_shape: tuple[int, ...]
    pairs: tuple[tuple[Index, Index], ...]  # (index into the local tensor, index into the full tensor)
    axis: str | None = None  # group axis the pieces differ over ("tp"), None = replicated

    @property
    def is_sharded(self) -> bool:
        return self.axis is not None


def replicated_info(shape: tuple[int, ...] | torch.Size) -> ShardInfo:
    full = tuple(slice(0, n) for n in shape)
    return ShardInfo(tuple(shape), ((full, full),), None)


def set_shard_info(param: torch.Tensor, info: ShardInfo) -> None:
    setattr(param, _ATTR, info)


def get_shard_info(param: torch.Tensor) -> ShardInfo:
    """The parameter's record; a parameter nobody marked is a full replicated tensor."""
    info = getattr(param, _ATTR, None)
    return info if info is not None else replicated_info(tuple(param.shape))


def copy_from_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Fill this rank's pieces from the unsharded tensor (init, checkpoint load, tests)."""
    info = get_shard_info(param)
    if tuple(full.shape) != info.global_shape:
        raise ValueError(f"full tensor shape {tuple(full.shape)} != unsharded shape {info.global_shape}")
    with torch.no_grad():
        for local, global_ in info.pairs:
            param[local].copy_(full[global_])


def scatter_to_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's pieces into `full` (the inverse of `copy_from_full_`)."""
    info = get_shard_info(param)
    with torch.no_grad():
        for local, global_ in info.pairs:
            full[global_].copy_(param[local])


def row_shard_info(
    global_shape: tuple[int, ...],
    dim: int,
    chunks: tuple[int, ...],
    rank: int,
    world: int,
    axis: str = "tp",
    real_sizes: tuple[int, ...] | None = None,
) -> ShardInfo:
    """Pieces of a tensor split along `dim`, chunk by chunk (one chunk = a plain split).

    `chunks` are the global sizes of the chunks along `dim` (e.g. q, k, v output sizes); each is
    split into `world` equal parts and this rank's parts are stacked in the local tensor.
    `real_sizes` (default = chunks) lets a padded chunk declare only its first rows as real.
    """
    real_sizes = real_sizes or chunks
    pairs, local_offset, global_offset = [], 0, 0
    for size, real in zip(chunks, real_sizes):
        if size % world:
            raise ValueError(f"chunk of size {size} cannot be split evenly into {world} shards")
        part = size // world
        start = rank * part
        stop = min(start + part, real)
        if stop > start:
            local = _index(global_shape, dim, slice(local_offset, local_offset + stop - start))
            glob = _index(global_shape, dim, slice(global_offset + start, global_offset + stop))
            pairs.append((local, glob))
        local_offset += part
        global_offset += real
    true_shape = list(global_shape)
    true_shape[dim] = sum(real_sizes)
    return ShardInfo(tuple(true_shape), tuple(pairs), axis if world > 1 else None)


def _index(shape: tuple[int, ...], dim: int, along: slice) -> Index:
    return tuple(along if i == dim else slice(0, n) for i, n in enumerate(shape))


def gather_full(tensor: torch.Tensor, info: ShardInfo, group=None) -> torch.Tensor:
    """The unsharded tensor from every rank's pieces of `tensor` (a parameter or its gradient),
    put together with one all-reduce over the shard group (pieces are disjoint, so a sum places
    them). A replicated tensor is returned as a full copy with no communication."""
    full = torch.zeros(info.global_shape, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        for local, global_ in info.pairs:
            full[global_] = tensor[local]
        if info.is_sharded and group is not None and group.size() > 1:
            import torch.distributed as dist

            dist.all_reduce(full, group=group)
    return full
