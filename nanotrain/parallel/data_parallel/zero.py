"""ZeRO-1: AdamW whose states are sharded across the data-parallel group (nanotron's ``optim/zero.py``,
Megatron's distributed optimizer).

Every dp rank holds the full parameters; gradients are reduce-scattered, each rank updates only the
elements it owns (exp_avg, exp_avg_sq for 1/n of them) and the updated parameters are all-gathered:
per step the bytes of one DDP all-reduce.

Partition: the flat element space is cut into buckets padded to a multiple of the group size n,
and rank r owns piece r of every bucket (``buckets.py``), so per parameter one contiguous range of
its flattened elements, or none. The buckets are those of the ``BucketedGradSync`` over the same
ranks, found through the parameters and cut for this optimizer (``shard()``), so gradients are
reduce-scattered straight into the owned pieces; without one, one bucket of every parameter in
the optimizer's order (``zero_partition``). Both are arithmetic on the sizes, which the offline
resharder needs (``buckets.zero_ranges``).

Update: this class IS a ``torch.optim.AdamW`` over "shards", views of the owned elements whose
``.grad`` is the same slice of the averaged gradient (scheduler, param_groups and state_dict work
as usual); then one in-place all-gather per bucket of a flat parameter buffer, into which every
``param.data`` is a view (the Parameter objects are unchanged). Load weights with ``param.copy_``;
a replaced ``param.data`` is re-bound at ``step()``. AdamW is elementwise, so this equals plain
AdamW on every rank (tested). With ep > 1 dense parameters and expert shards are separate domains
(sync, buffer, partition) over dp x cp x ep and dp x cp.

ZeRO-2 (``stage=2``) is the same optimizer on the same partition; only its gradients come from
elsewhere: the sync is cut with ``shard(stage=2)``, reduce-scatters every micro-batch into an
accumulator of the owned pieces (``shard_grads.py``) and the parameters keep no ``.grad``, so
``step()`` reads each piece's gradient from ``sync.owned_grad``. Same states, same checkpoints.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from nanotrain.parallel import accelerator
from nanotrain.parallel.collectives import all_gather_into, wait
from nanotrain.parallel.data_parallel.buckets import padded, shard_pieces
from nanotrain.parallel.data_parallel.grad_sync import BucketedGradSync, grad_sync_of
from nanotrain.parallel.data_parallel.shard_params import ParamGather, ShardedStore, unit_of_name


def zero_partition(numels: Sequence[int], dp: int) -> list[list[tuple[int, int, int]]]:
    """For each dp rank, the pieces it owns of ONE bucket of parameters of sizes ``numels``:
    (param index, start, stop) in the flattened param. Ranks get equal chunks of
    ``ceil(total / dp)`` elements (the last one shorter, the rest is padding)."""
    size = padded(sum(numels), dp)
    return [[(j, a, b) for _, j, a, b in shard_pieces([numels], [size], dp, r)] for r in range(dp)]


def placed_state(value, param: torch.Tensor, group: dict, key: str) -> torch.Tensor:
    """A loaded AdamW state tensor for ``param`` where torch's own ``Optimizer.load_state_dict``
    puts it (``_process_value_according_to_param_policy``), as a fresh copy: ``step`` as a 0-d
    fp32 tensor, on the parameter's device when ``group`` is fused or capturable (their kernels
    read it through a device pointer: a host step there is an illegal memory access), else left
    on the host; every other state in the parameter's dtype (if floating) and on its device."""
    value = torch.as_tensor(value)
    if key == "step":
        value = value.to(torch.float32).reshape(())
        if group.get("fused", False) or group.get("capturable", False):
            value = value.to(dtype=torch.float32, device=param.device)
    elif param.is_floating_point():
        value = value.to(dtype=param.dtype, device=param.device)
    else:
        value = value.to(device=param.device)
    return value.clone()


@dataclass
class ShardPiece:
    """This rank's piece of one parameter (for optimizers and checkpoint writers)."""

    name: str
    param: nn.Parameter
    start: int  # owned range [start, stop) of the flattened parameter
    stop: int
    shard: torch.Tensor  # the optimizer's tensor: param.view(-1)[start:stop]

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class _Domain:
    """Parameters sharded over one group: their flat buffer (``buckets``: the (start, length) of
    each bucket in it, lengths multiples of ``size``), their partition, this rank's place in the
    group and the gradient sync that reduce-scatters into this partition (None: gradients come
    in whole)."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    indices: list[int]  # positions in the optimizer's flat parameter order
    offsets: list[int]  # element offset of each of them in ``flat``
    partition: list[list[tuple[int, int, int]]]  # per group rank: (position in indices, start, stop)
    buckets: list[tuple[int, int]]
    flat: Optional[torch.Tensor]  # None at ZeRO-3: the parameters live in ``store``
    sync: Optional[BucketedGradSync] = None
    store: Optional[ShardedStore] = None  # ZeRO-3 (``shard_params.py``)

    def owned(self, j: int, start: int, stop: int) -> torch.Tensor:
        """The optimizer's tensor for elements [start, stop) of parameter ``j`` (owned here)."""
        if self.store is not None:
            return self.store.owned(j, start, stop)
        return self.flat[self.offsets[j] + start : self.offsets[j] + stop]

    def all_gather(self) -> None:
        """Every rank's pieces into every rank's buffer, in place, all buckets posted at once
        (ZeRO-3: nothing, each layer is gathered when it computes)."""
        if self.size == 1 or self.store is not None:
            return
        handles = []
        for start, length in self.buckets:
            chunk = length // self.size
            mine = self.flat[start + self.rank * chunk : start + (self.rank + 1) * chunk]
            handles.append(all_gather_into(self.flat[start : start + length], mine, group=self.group, async_op=True))
        for h in handles:
            wait(h)


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _sync_to_follow(params: list[nn.Parameter], group, size: int) -> Optional[BucketedGradSync]:
    """The one live ``BucketedGradSync`` holding the gradients of exactly ``params``, over the
    ranks of ``group``: its buckets become the partition. None when there is no such sync."""
    syncs = {id(s): s for s in map(grad_sync_of, params)}
    if len(syncs) != 1:
        return None
    sync = next(iter(syncs.values()))
    if sync is None or {id(p) for p in sync.params} != {id(p) for p in params} or sync.world_size != size:
        return None
    if size > 1 and _ranks(sync.group) != _ranks(group):
        return None
    return sync


class ZeroOneOptimizer(torch.optim.AdamW):
    """AdamW with states sharded over ``group`` (ZeRO stage 1; ``stage=2``: gradients sharded too,
    module doc).

    ``param_groups``: AdamW-style group dicts whose ``"params"`` are the model parameters and
    ``"param_names"`` their names (same length), plus per-group options (``weight_decay``...).
    ``group``: the dp group (``pc.dp_cp_pg``: cp ranks are replicas too); None = default group if
    torch.distributed is initialised, else no sharding. ``defaults``: AdamW's keyword arguments.
    Build the ``BucketedGradSync`` (``build_grad_sync``) first: the optimizer then takes its
    partition from the sync's buckets and turns the sync's all-reduces into reduce-scatters
    (module doc).

    Expert parallelism: with ``expert_group`` (``pc.dp_cp_pg``; ``group`` is then
    ``pc.dp_cp_ep_pg``, over which the dense parameters are replicas) the parameters that
    ``is_expert`` selects form a second domain, sharded over ``expert_group`` with its own
    gradient sync, flat buffer and all-gathers: an expert shard exists once per (dp, cp)
    coordinate, so only those ranks hold copies of it. The partition rule is the same in both
    domains (module docstring).

    Every dp rank gets the same number of param groups (possibly empty), so ``param_groups`` and
    the LR scheduler's state have the same structure on every rank.
    """

    def __init__(
        self,
        param_groups: list[dict],
        group: Optional[dist.ProcessGroup] = None,
        expert_group: Optional[dist.ProcessGroup] = None,
        is_expert=None,
        stage: int = 1,
        gather_dtype: Optional[torch.dtype] = None,
        **defaults,
    ):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroOneOptimizer: stage must be 1, 2 or 3, got {stage!r}")
        self.stage = stage
        self.gather_dtype = gather_dtype  # ZeRO-3: the dtype training's gathers send (shard_params.py)
        names, params, group_of = [], [], []
        for gi, g in enumerate(param_groups):
            ps, ns = list(g["params"]), list(g["param_names"])
            if len(ps) != len(ns):
                raise ValueError("each param group needs one name per parameter in 'param_names'")
            params += ps
            names += ns
            group_of += [gi] * len(ps)
        if len({id(p) for p in params}) != len(params):
            raise ValueError("ZeroOneOptimizer: a parameter appears twice")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"ZeroOneOptimizer needs one dtype and device, got {dtypes} {devices}")
        self.names, self.params = names, params
        split = expert_group is not None and is_expert is not None
        expert = [bool(split and is_expert(p)) for p in params]
        self.domains = [self._domain(group, [i for i, e in enumerate(expert) if not e], "")]
        if any(expert):
            self.domains.append(self._domain(expert_group, [i for i, e in enumerate(expert) if e], "expert "))

        self.pieces: list[ShardPiece] = []
        self._grad_syncs: list[Optional[BucketedGradSync]] = []  # per piece: its ZeRO-2 sync
        shard_groups = [dict(g, params=[], param_names=[]) for g in param_groups]
        owned = {}  # flat position -> (domain, start, stop): pieces keep the optimizer's order
        for d in self.domains:
            for j, start, stop in d.partition[d.rank]:
                owned[d.indices[j]] = (d, j, start, stop)
        for i in sorted(owned):
            d, j, start, stop = owned[i]
            shard = d.owned(j, start, stop)  # a leaf view (the buffers need no grad)
            self.pieces.append(ShardPiece(names[i], params[i], start, stop, shard))
            self._grad_syncs.append(d.sync if d.sync is not None and d.sync.accumulator is not None else None)
            shard_groups[group_of[i]]["params"].append(shard)
            shard_groups[group_of[i]]["param_names"].append(names[i])
        super().__init__(shard_groups, **defaults)
        self.param_gather = self._param_gather() if stage == 3 else None

    def _domain(self, group, indices: list[int], what: str) -> _Domain:
        """Move ``indices``' parameters into one flat buffer (see module doc) sharded over ``group``."""
        initialised = dist.is_available() and dist.is_initialized()
        size = dist.get_world_size(group) if initialised else 1
        rank = dist.get_rank(group) if initialised else 0
        ps = [self.params[i] for i in indices]
        sync = _sync_to_follow(ps, group, size)
        if sync is None and self.stage >= 2 and size > 1:
            raise ValueError(
                f"ZeRO-{self.stage} reduce-scatters the {what}gradients through their BucketedGradSync over the "
                "same ranks: build it (build_grad_sync) before the optimizer"
            )
        if sync is not None:  # the sync's buckets, padded to a multiple of size
            position = {id(p): j for j, p in enumerate(ps)}
            units = {id(p): unit_of_name(self.names[i]) for i, p in zip(indices, ps)}
            layout = [[position[id(p)] for p in b.params] for b in sync.shard(self.stage, units)]
            lengths = [b.size for b in sync.buckets]
        else:
            layout, lengths = [list(range(len(ps)))], [padded(sum(p.numel() for p in ps), size)]
        numels = [[ps[j].numel() for j in bucket] for bucket in layout]
        partition = [
            [(layout[k][j], a, b) for k, j, a, b in shard_pieces(numels, lengths, size, r)] for r in range(size)
        ]
        if indices and any(not pieces for pieces in partition):
            raise ValueError(
                f"ZeroOneOptimizer: {sum(p.numel() for p in ps)} {what}elements cannot give "
                f"each of {size} dp ranks a non-empty shard"
            )
        offsets, buckets, start = [0] * len(ps), [], 0
        for bucket, length in zip(layout, lengths):
            off = start
            for j in bucket:
                offsets[j] = off
                off += ps[j].numel()
            buckets.append((start, length))
            start += length
        if self.stage == 3 and size > 1:  # each bucket its own buffer, released until gathered
            store = ShardedStore(ps, layout, lengths, group, size, rank, self.gather_dtype)
            return _Domain(group, size, rank, indices, offsets, partition, buckets, None, sync, store)
        ref = self.params[0]
        flat = torch.zeros(start, dtype=ref.dtype, device=ref.device)
        with torch.no_grad():
            for p, off in zip(ps, offsets):
                view = flat[off : off + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
        return _Domain(group, size, rank, indices, offsets, partition, buckets, flat, sync)

    def _param_gather(self) -> Optional[ParamGather]:
        """ZeRO-3: the gather units (one per decoder layer, the embedding, the head) over the
        domains' buckets, released after each backward round of the gradient syncs."""
        units: dict[str, list] = {}
        params: dict[str, list] = {}
        for d in self.domains:
            if d.store is None:
                continue
            for k, positions in enumerate(d.store.layout):
                name = unit_of_name(self.names[d.indices[positions[0]]])
                units.setdefault(name, []).append((d.store, k))
                params.setdefault(name, []).extend(self.params[d.indices[j]] for j in positions)
        if not units:
            return None
        gather = ParamGather(units, params)
        ref = weakref.ref(gather)
        for d in self.domains:
            if d.store is not None:
                d.sync.accumulator.after_round.append(lambda ref=ref: ref() is not None and ref().end_round())
        return gather

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on this rank's shards, then all-gather so every rank has the full parameters.

        Gradients must already be averaged over the dp group on this rank's pieces at least
        (``BucketedGradSync.finish_grad_sync``). A parameter whose ``.grad`` is None is skipped,
        as plain AdamW does.
        """
        self._rebind_if_replaced()
        for piece, sync in zip(self.pieces, self._grad_syncs):
            if sync is not None:  # ZeRO-2: the accumulator's view of exactly [start, stop)
                g = sync.owned_grad(piece.param)
            else:
                g = piece.param.grad
                g = None if g is None else g.reshape(-1)[piece.start : piece.stop]
            piece.shard.grad = None if g is None else g.to(piece.shard.dtype)
        loss = super().step(closure)
        for piece in self.pieces:
            piece.shard.grad = None  # do not keep references to the model's grad buffers
        for d in self.domains:
            d.all_gather()
            if d.store is not None:  # ZeRO-3: the compute-dtype copy the next gathers send
                d.store.refresh()
            if d.sync is not None:  # from now on the gradients stay on their owners' pieces
                d.sync.stop_gathering_grads()
        return loss

    def _rebind_if_replaced(self) -> None:
        for d in self.domains:
            if d.store is not None:  # ZeRO-3: the parameters are views of the store for good
                continue
            for i, off in zip(d.indices, d.offsets):
                p = self.params[i]
                view = d.flat[off : off + p.numel()]
                if not accelerator.same_memory(p.data.reshape(-1), view):
                    view.copy_(p.data.reshape(-1))
                    p.data = view.view_as(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the MODEL's gradients (prefer ``BucketedGradSync.zero_grad`` when one is used)."""
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # ------------------------------------------------------------------ checkpoint accessors
    def param_ranges(self, dp_rank: Optional[int] = None) -> dict[str, tuple[int, int]]:
        """name -> [start, stop) of the flattened parameter owned by ``dp_rank`` (default: this
        rank; with experts, the rank in each domain's group). Parameters a rank owns nothing of
        are absent. Pure arithmetic: any rank can ask about any other, e.g. to write a global
        index of the optimizer checkpoint."""
        out = {}
        for d in self.domains:
            r = d.rank if dp_rank is None else dp_rank
            out.update({self.names[d.indices[j]]: (a, b) for j, a, b in d.partition[r]})
        return out

    def sharded_state(self) -> dict[str, dict]:
        """This rank's optimizer state per parameter name.

        ``{name: {"start", "stop", "numel" (of the whole param), "shape" (local, unflattened),
        "step" (0-d fp32), "exp_avg", "exp_avg_sq" (1-D, stop - start elements)}}``. The tensors
        are the live state (no copy); before the first step they are fresh zeros, which load
        back to the same behaviour as AdamW's lazy initialisation.
        """
        out = {}
        for piece in self.pieces:
            st = self.state.get(piece.shard, {})
            out[piece.name] = {  # zeros only where there is no state yet (not at every save)
                "start": piece.start,
                "stop": piece.stop,
                "numel": piece.param.numel(),
                "shape": tuple(piece.param.shape),
                "step": st["step"] if "step" in st else torch.tensor(0.0),
                "exp_avg": st["exp_avg"] if "exp_avg" in st else torch.zeros_like(piece.shard),
                "exp_avg_sq": st["exp_avg_sq"] if "exp_avg_sq" in st else torch.zeros_like(piece.shard),
            }
        return out

    def load_sharded_state(self, states: dict[str, dict]) -> None:
        """Inverse of ``sharded_state``: ``states[name]`` holds this rank's slices (the ranges of
        ``param_ranges()``) of "step", "exp_avg", "exp_avg_sq". A resharder cuts them from the
        merged per-parameter tensors with those ranges."""
        group_of = {id(s): g for g in self.param_groups for s in g["params"]}
        for piece in self.pieces:
            src = states[piece.name]
            for key in ("exp_avg", "exp_avg_sq"):
                if src[key].numel() != piece.numel:
                    raise ValueError(
                        f"{piece.name}.{key}: {src[key].numel()} elements, this rank owns [{piece.start}, {piece.stop})"
                    )
            group = group_of[id(piece.shard)]
            self.state[piece.shard] = {
                key: placed_state(src[key] if key == "step" else src[key].reshape(-1), piece.shard, group, key)
                for key in ("step", "exp_avg", "exp_avg_sq")
            }
