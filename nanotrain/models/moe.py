"""Mixture-of-Experts feed-forward: a router, routed SwiGLU experts, optional shared experts.

Routing (Mixtral's convention): fp32 router logits ``x @ W_r^T`` over all ``num_experts``, softmax,
top-k, the k weights renormalised to sum to 1. Each (token, slot) assignment goes to its expert;
the token's output is the weighted sum of its experts' outputs (plus the shared experts' output,
DeepSeek style, when ``num_shared_experts`` >= 1).

Expert parallelism: this rank holds experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` stacked in
two 3-D parameters (``experts.gate_up.weight`` ``[E/ep, 2F, H]``, ``experts.down.weight``
``[E/ep, H, F]``) whose ShardInfo places them on the expert axis ("ep") of the full ``[E, ...]``
tensors, so checkpoints and resharding see one tensor per layer. The exchange of tokens with
the other ep ranks is ``parallel/expert_parallel.py``. Routed experts are NOT split over tp: under
ALL_REDUCE every tp rank routes the same tokens and computes the same experts (redundantly);
under REDUCE_SCATTER each tp rank routes its own sequence shard, so the router's and experts'
gradients are partial over tp and are marked like the sequence-parallel norms. The shared
experts are an ordinary tensor-parallel SwiGLU (column gate/up, row down).

Capacity (``capacity_factor`` set): each expert takes at most
``C = ceil(capacity_factor * T * top_k / num_experts)`` assignments of this rank's T tokens. The
drop rule: assignments are served slot by slot (every token's first choice before any second
choice), and within a slot in token order (the flattened ``[S, B]`` index, sequence-major);
an expert's assignments beyond the first C are dropped. A dropped assignment contributes
nothing (the other slots keep their weights, not renormalised); a token all of whose
assignments are dropped passes through the residual only. Dropless (null) keeps every assignment.

Auxiliary losses, per MoE layer on this rank's tokens T (Switch/Mixtral; ST-MoE z-loss):
``aux = E * sum_e (n_e / T) * mean_t p_te`` (n_e: assignments to e, over all k slots: exactly
``transformers``' ``load_balancing_loss_func`` of this layer's router logits), and
``z = mean_t logsumexp(logits_t)^2``. The model adds ``aux_loss_coef * aux + z_loss_coef * z``
averaged over its MoE layers to each micro-batch's loss (under cp and REDUCE_SCATTER, where a
rank routes only its share of the tokens, the mean over the shares of the shards' losses: exact for
the z-loss, a mean of per-shard balancing losses for ``aux``), by injecting the gradient in backward
(``_AddAuxLoss``, Megatron's MoEAuxLossAutoScaler): this works on every pipeline stage, where
the loss itself only exists on the last one. The reported loss stays the language-model loss;
the auxiliary values go to TensorBoard (``moe/aux_loss``, ``moe/z_loss``).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as _dist
from torch import nn

from nanotrain.config import ModelArgs
from nanotrain.models import llama_arch
from nanotrain.models.mlp import MLP, swiglu
from nanotrain.models.recompute import recomputed
from nanotrain.parallel import accelerator, collectives
from nanotrain.parallel.expert_parallel import dispatch_to_experts
from nanotrain.parallel.sharding import row_shard_info, set_shard_info
from nanotrain.parallel.tensor_parallel import (
    TensorParallelLinearMode,
    group_rank,
    group_size,
    mark_sequence_parallel_partial_grad_,
)


@dataclass
class MoEState:
    """Shared by the model and its MoE layers: the gradient scale of the auxiliary losses (1 / the
    step's micro-batch count, as the engines divide the loss) and the detached statistics of the
    step so far, one entry per (micro-batch, layer) forward."""

    loss_scale: float = 1.0
    stats: list = field(default_factory=list)
    replay: bool = False  # inside a recomputation (training.recompute: full): record nothing

    def begin_step(self, microbatches: int) -> None:
        self.loss_scale = 1.0 / microbatches
        self.stats = []

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Around a layer's recomputation in backward: its forward ran already and was counted."""
        self.replay, before = True, self.replay
        try:
            yield
        finally:
            self.replay = before


class _AddAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, d(total loss)/d(aux) = ``scale``: aux's gradient joins
    the graph of the layer's output, wherever the loss is computed."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class _Stacked(nn.Module):
    """``weight`` [E/ep, out, in]: this rank's experts' matrices, stacked on the expert axis."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, ep_pg):
        super().__init__()
        ep, rank = group_size(ep_pg), group_rank(ep_pg)
        self.weight = nn.Parameter(torch.empty(num_experts // ep, out_features, in_features))
        set_shard_info(self.weight, row_shard_info((num_experts, out_features, in_features), 0,
                                                   (num_experts,), rank, ep, axis="ep"))


class Experts(nn.Module):
    """This rank's routed SwiGLU experts, gate and up fused (``[gate; up]`` rows)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, ep_pg, selective: bool = False):
        super().__init__()
        self.ffn, self.selective = ffn, selective
        self.gate_up = _Stacked(num_experts, 2 * ffn, hidden, ep_pg)
        self.down = _Stacked(num_experts, hidden, ffn, ep_pg)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` [N, H] grouped by local expert (``counts[e]`` rows each) -> [N, H]."""
        outs = []
        for e, xe in enumerate(x.split(counts)):
            gate, up = (xe @ self.gate_up.weight[e].t()).chunk(2, dim=-1)
            outs.append(recomputed(swiglu, gate, up, enabled=self.selective) @ self.down.weight[e].t())
        return torch.cat(outs) if outs else x[:0]


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


@dataclass
class Routing:
    """One layer's routing of T tokens: what the experts get and what the losses need."""

    order: torch.Tensor      # [N] kept assignments (index a = slot * T + token), grouped by expert
    counts: list[int]        # [E] kept assignments per expert
    weights: torch.Tensor    # [N] renormalised router weight of each kept assignment (fp32)
    aux: torch.Tensor        # load-balancing loss (differentiable)
    z: torch.Tensor          # router z-loss (differentiable)
    load: torch.Tensor       # [E] assignments per expert before any drop
    dropped: int


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None) -> Routing:
    """Top-k routing of fp32 ``logits`` [T, E] with the module docstring's drop rule."""
    tokens, num_experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top_w, top_e = torch.topk(probs, top_k, dim=-1)
    top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    load = torch.bincount(top_e.reshape(-1), minlength=num_experts)
    aux = num_experts * torch.sum(load.to(probs.dtype) / tokens * probs.mean(dim=0))
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    flat_e = top_e.t().reshape(-1)  # slot-major: a = slot * T + token
    order = torch.argsort(flat_e, stable=True)
    counts = load.tolist()
    dropped = 0
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * tokens * top_k / num_experts)
        starts = torch.cumsum(load, 0) - load
        position = torch.arange(order.numel(), device=order.device) - starts.repeat_interleave(load)
        order = order[position < cap]
        counts = [min(c, cap) for c in counts]
        dropped = int(flat_e.numel() - order.numel())
    return Routing(order, counts, top_w.t().reshape(-1)[order], aux, z, load, dropped)


class MoEFeedForward(nn.Module):
    """Drop-in for the dense ``MLP`` of an MoE decoder layer (see the module docstring)."""

    def __init__(self, args: ModelArgs, tp_pg, mode: TensorParallelLinearMode, async_comm: bool, ep_pg,
                 state: MoEState, selective: bool = False):
        super().__init__()
        moe = args.moe
        self.moe, self.ep_pg, self.state = moe, ep_pg, state
        ffn = llama_arch.expert_ffn(args)
        self.router = Router(moe.num_experts, args.hidden_size)
        self.experts = Experts(moe.num_experts, args.hidden_size, ffn, ep_pg, selective)
        # Always-on SwiGLU of num_shared_experts * F features, tensor-parallel like the dense MLP.
        self.shared = None if not moe.num_shared_experts else MLP(
            args, tp_pg, mode, async_comm, selective, width=moe.num_shared_experts * ffn)
        self.loss_weight = 1.0 / len(llama_arch.moe_layer_indices(args))
        if mode is TensorParallelLinearMode.REDUCE_SCATTER and group_size(tp_pg) > 1:
            # Each tp rank's losses are means over its sequence shard, and these gradients are
            # summed over tp (not averaged, as dp x cp are): weigh each shard 1/tp.
            self.loss_weight /= group_size(tp_pg)
            for p in (self.router.weight, self.experts.gate_up.weight, self.experts.down.weight):
                mark_sequence_parallel_partial_grad_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        with accelerator.autocast(x.device.type, enabled=False):
            logits = tokens.float() @ self.router.weight.float().t()
        r = route(logits, self.moe.top_k, self.moe.capacity_factor)
        num_tokens = tokens.shape[0]
        token_of = r.order % num_tokens
        y = dispatch_to_experts(tokens[token_of], r.counts, self.ep_pg, self.experts)
        combined = torch.zeros(tokens.shape, dtype=torch.promote_types(y.dtype, torch.float32), device=x.device)
        combined.index_add_(0, token_of, y * r.weights[:, None])
        out = combined.to(x.dtype).view(shape)
        if self.shared is not None:
            out = out + self.shared(x)
        loss = self.loss_weight * (self.moe.aux_loss_coef * r.aux + self.moe.z_loss_coef * r.z)
        if not self.state.replay:
            self.state.stats.append({"aux": r.aux.detach(), "z": r.z.detach(), "load": r.load.detach(),
                                     "dropped": r.dropped, "layer": id(self)})
        if torch.is_grad_enabled() and loss.requires_grad:
            out = _AddAuxLoss.apply(out, loss, self.state.loss_scale)
        return out


def _comm_device(pp_pg, reduce: bool) -> torch.device:
    """Where the statistics meet over ``pp_pg``: NCCL groups have no CPU backend (the device of
    this rank, as in ``checkpoint/comm.py``), other backends take CPU tensors."""
    acc = accelerator.of_backend(_dist.get_backend(pp_pg)) if reduce else None
    return acc.current_device() if acc is not None else torch.device("cpu")


def step_scalars(state: MoEState, pp_pg=None, capacity: bool = False) -> dict[str, float]:
    """TensorBoard scalars of one step's routing, over every MoE layer of the pipeline (summed
    over ``pp_pg``: each stage holds some layers) for this rank's tokens (its dp/ep replica; its
    sequence shard under cp or REDUCE_SCATTER). ``moe/aux_loss`` and ``moe/z_loss``: means over
    (micro-batch, layer); ``moe/load_max_over_mean``: per layer the busiest expert's assignments
    over the mean (1 = balanced), summed over the step's micro-batches, max over layers;
    ``moe/dropped_tokens`` (capacity set): assignments dropped in the step. Every rank of
    ``pp_pg`` must call it (one all-reduce of 4 values, one of 1). The statistics are summed on
    their device and read back once (one host sync per call)."""
    reduce = pp_pg is not None and _dist.is_initialized() and _dist.get_world_size(pp_pg) > 1
    stats = state.stats
    device = stats[0]["aux"].device if stats else _comm_device(pp_pg, reduce)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    if stats:
        aux, z = torch.stack([v for st in stats for v in (st["aux"], st["z"])]).view(-1, 2).double().sum(0)
    else:
        aux, z = zero, zero
    counts = [float(len(stats)), float(sum(st["dropped"] for st in stats))]  # host ints already
    sums = torch.cat([torch.stack([aux, z]), torch.tensor(counts, dtype=torch.float64, device=device)])
    by_layer: dict[int, list[torch.Tensor]] = {}
    for st in stats:
        by_layer.setdefault(st["layer"], []).append(st["load"])
    if by_layer:  # [L, E] assignments per (layer, expert) over the step's micro-batches
        loads = torch.stack([torch.stack(v).sum(0) for v in by_layer.values()]).double()
        ratio = torch.where(loads.sum(1) > 0, loads.amax(1) / loads.mean(1), zero)
        peak = ratio.max().reshape(1)  # ratios are >= 1 where counted: 0 = no assignment at all
    else:
        peak = zero.reshape(1)
    if reduce:
        comm = _comm_device(pp_pg, reduce)
        sums, peak = sums.to(comm), peak.to(comm)
        collectives.all_reduce(sums, group=pp_pg, what="all_reduce moe stats")
        collectives.all_reduce(peak, op=_dist.ReduceOp.MAX, group=pp_pg, what="all_reduce moe load peak")
    aux_sum, z_sum, n, dropped, worst = torch.cat([sums, peak]).tolist()
    count = max(n, 1.0)
    out = {"moe/aux_loss": aux_sum / count, "moe/z_loss": z_sum / count, "moe/load_max_over_mean": worst}
    if capacity:
        out["moe/dropped_tokens"] = dropped
    return out
