"""ZeRO-1: AdamW whose states are sharded across the data-parallel group (nanotron's ``optim/zero.py``).

Every dp rank holds the full parameters and, after the gradient all-reduce, the full averaged
gradients; only the optimizer states (exp_avg, exp_avg_sq: 2x the parameters in fp32) are split.

Partition. The parameters are laid end to end in one flat element space (in the order of the
param groups, then of the params within each group). That space is cut into ``dp`` contiguous
chunks of ``ceil(total / dp)`` elements; rank r owns ``[r * chunk, min((r + 1) * chunk, total))``.
A chunk may cut through a parameter, so a rank owns, per parameter, one contiguous range of that
parameter's flattened elements (or none). ``zero_partition`` computes this from the sizes alone,
for any dp, which is what a checkpoint resharder needs.

Update. For each owned range the optimizer holds a "shard": a view of the parameter's owned
elements whose ``.grad`` is the same slice of the parameter's (already averaged) gradient, a view
too. ``torch.optim.AdamW`` (this class IS an AdamW over the shards: the LR scheduler, param_groups
and state_dict work as usual) updates the shards in place, i.e. the owned slice of the real
parameters. Then one all-gather of the flat parameter buffer gives every rank the full updated
parameters. AdamW is elementwise, so this equals plain AdamW on every rank (tested).

Flat parameter buffer. To all-gather in one collective with no per-step copy, the parameters'
storage is moved into one flat buffer (padded to ``dp * chunk``) and each ``param.data`` becomes
a view into it: the Parameter objects (and the model, hooks, shard info) are unchanged. Load
weights with in-place copies (``param.copy_``); if ``param.data`` is replaced anyway, ``step()``
notices and re-binds it. Shards have the parameters' dtype: with fp32 parameters they are the fp32
shards of the design; fp32 master weights for bf16 parameters belong to the mixed-precision layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from nanotrain.parallel.collectives import all_gather_into


def zero_partition(numels: Sequence[int], dp: int) -> list[list[tuple[int, int, int]]]:
    """For each dp rank, the pieces it owns: (param index, start, stop) in the flattened param.

    ``numels`` are the parameter sizes in flat order. Ranks get equal chunks of
    ``ceil(total / dp)`` elements (the last one shorter), so the all-gather needs no sizes.
    """
    total = sum(numels)
    chunk = max(1, math.ceil(total / dp))
    out: list[list[tuple[int, int, int]]] = []
    for r in range(dp):
        lo, hi = min(r * chunk, total), min((r + 1) * chunk, total)
        pieces, offset = [], 0
        for i, n in enumerate(numels):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                pieces.append((i, a - offset, b - offset))
            offset += n
        out.append(pieces)
    return out


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


class ZeroOneOptimizer(torch.optim.AdamW):
    """AdamW with states sharded over ``group`` (ZeRO stage 1).

    ``param_groups``: AdamW-style group dicts whose ``"params"`` are the model parameters and
    ``"param_names"`` their names (same length), plus per-group options (``weight_decay``...).
    ``group``: the dp group (``pc.dp_cp_pg``: cp ranks are replicas too); None = default group if
    torch.distributed is initialised, else no sharding. ``defaults``: AdamW's keyword arguments.

    Every dp rank gets the same number of param groups (possibly empty), so ``param_groups`` and
    the LR scheduler's state have the same structure on every rank.
    """

    def __init__(self, param_groups: list[dict], group: Optional[dist.ProcessGroup] = None,
                 **defaults):
        initialised = dist.is_available() and dist.is_initialized()
        self.dp_group = group
        self.dp_size = dist.get_world_size(group) if initialised else 1
        self.dp_rank = dist.get_rank(group) if initialised else 0

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
        numels = [p.numel() for p in params]
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        self.total_numel = sum(numels)
        self.partition = zero_partition(numels, self.dp_size)
        if any(not pieces for pieces in self.partition):
            raise ValueError(f"ZeroOneOptimizer: {self.total_numel} elements cannot give each of "
                             f"{self.dp_size} dp ranks a non-empty shard")
        self.chunk = math.ceil(self.total_numel / self.dp_size)

        # One flat buffer holds every parameter, padded to dp equal chunks (see module doc).
        self.flat = torch.zeros(self.chunk * self.dp_size, dtype=params[0].dtype,
                                device=params[0].device)
        self._flat_views = []
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                view = self.flat[off:off + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                self._flat_views.append(view)

        self.pieces: list[ShardPiece] = []
        shard_groups = [dict(g, params=[], param_names=[]) for g in param_groups]
        for i, start, stop in self.partition[self.dp_rank]:
            off = self.offsets[i]
            shard = self.flat[off + start:off + stop]  # a leaf view (flat needs no grad)
            piece = ShardPiece(names[i], params[i], start, stop, shard)
            self.pieces.append(piece)
            shard_groups[group_of[i]]["params"].append(shard)
            shard_groups[group_of[i]]["param_names"].append(names[i])
        super().__init__(shard_groups, **defaults)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on this rank's shards, then all-gather so every rank has the full parameters.

        Gradients must already be averaged over the dp group (``BucketedGradSync``). A parameter
        whose ``.grad`` is None is skipped, as plain AdamW does.
        """
        self._rebind_if_replaced()
        for piece in self.pieces:
            g = piece.param.grad
            piece.shard.grad = None if g is None else g.reshape(-1)[piece.start:piece.stop]
        loss = super().step(closure)
        for piece in self.pieces:
            piece.shard.grad = None  # do not keep references to the model's grad buffers
        self._all_gather()
        return loss

    def _all_gather(self) -> None:
        if self.dp_size == 1:
            return
        mine = self.flat[self.dp_rank * self.chunk:(self.dp_rank + 1) * self.chunk].clone()
        all_gather_into(self.flat, mine, group=self.dp_group)

    def _rebind_if_replaced(self) -> None:
        for p, view in zip(self.params, self._flat_views):
            if p.data_ptr() != view.data_ptr():
                view.copy_(p.data)
                p.data = view

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
        rank). Parameters a rank owns nothing of are absent. Pure arithmetic: any rank can ask
        about any other, e.g. to write a global index of the optimizer checkpoint."""
        r = self.dp_rank if dp_rank is None else dp_rank
        return {self.names[i]: (a, b) for i, a, b in self.partition[r]}

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
            zeros = torch.zeros_like(piece.shard)
            out[piece.name] = {
                "start": piece.start, "stop": piece.stop, "numel": piece.param.numel(),
                "shape": tuple(piece.param.shape),
                "step": st.get("step", torch.tensor(0.0)),
                "exp_avg": st.get("exp_avg", zeros),
                "exp_avg_sq": st.get("exp_avg_sq", zeros.clone()),
            }
        return out

    def load_sharded_state(self, states: dict[str, dict]) -> None:
        """Inverse of ``sharded_state``: ``states[name]`` holds this rank's slices (the ranges of
        ``param_ranges()``) of "step", "exp_avg", "exp_avg_sq". A resharder cuts them from the
        merged per-parameter tensors with those ranges."""
        for piece in self.pieces:
            src = states[piece.name]
            for key in ("exp_avg", "exp_avg_sq"):
                if src[key].numel() != piece.numel:
                    raise ValueError(f"{piece.name}.{key}: {src[key].numel()} elements, this rank "
                                     f"owns [{piece.start}, {piece.stop})")
            self.state[piece.shard] = {
                "step": torch.as_tensor(src["step"], dtype=torch.float32).clone().reshape(()),
                "exp_avg": src["exp_avg"].to(piece.shard).reshape(-1).clone(),
                "exp_avg_sq": src["exp_avg_sq"].to(piece.shard).reshape(-1).clone(),
            }
