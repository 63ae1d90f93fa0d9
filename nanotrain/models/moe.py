"""Mixture-of-Experts feed-forward: a router, routed SwiGLU experts, optional shared experts.

Routing (Mixtral's convention): router logits ``x @ W_r^T`` over all ``num_experts`` (in fp32 at
least: bf16 inputs are widened, a float64 model stays float64), softmax, top-k, the k weights
renormalised to sum to 1 (``norm_topk_prob``; false keeps the k softmax probabilities as they are,
transformers' ``Qwen3MoeSparseMoeBlock`` with ``norm_topk_prob: false``). Each (token, slot)
assignment goes to its expert; the token's output is the weighted sum of its experts' outputs
(plus the shared experts' output, DeepSeek style, when ``num_shared_experts`` >= 1).

The experts are stacked in two 3-D parameters (``experts.gate_up.weight`` ``[E, 2F, H]``,
``experts.down.weight`` ``[E, H, F]``): one tensor per layer for checkpoints and resharding.
Expert parallelism (``parallel/expert_parallel.py``) keeps a slice of them on each rank and
wraps ``experts`` in the exchange of tokens with the other ranks; ``experts(rows, counts)`` runs
whichever experts it holds on rows grouped by expert. The shared experts are an ordinary ``MLP``.

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
averaged over its MoE layers to each micro-batch's loss (``loss_weight``; where a rank routes only
a share of the tokens, the parallelize step weighs the shares: exact for the z-loss, a mean of
per-shard balancing losses for ``aux``), by injecting the gradient in backward
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
from torch import nn

from nanotrain.config import ModelArgs
from nanotrain.models import llama_arch
from nanotrain.models.mlp import MLP, SwiGLU
from nanotrain.parallel import accelerator


@dataclass
class MoEState:
    """Shared by the model and its MoE layers: the gradient scale of the auxiliary losses (1 / the
    step's micro-batch count, as the engines divide the loss) and the detached statistics of the
    step so far, one entry per (micro-batch, layer) forward."""

    loss_scale: float = 1.0
    stats: list = field(default_factory=list)
    replay: bool = False  # inside a recomputation of a layer's forward: record nothing

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
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class Stacked(nn.Module):
    """``weight`` [experts, out, in]: the experts' matrices stacked on the expert axis."""

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class Experts(nn.Module):
    """Routed SwiGLU experts, gate and up fused (``[gate; up]`` rows); as many as ``gate_up``
    stacks (all of them, or an expert-parallel rank's slice)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.ffn = ffn
        self.gate_up = Stacked(num_experts, 2 * ffn, hidden)
        self.act = SwiGLU()
        self.down = Stacked(num_experts, hidden, ffn)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` [N, H] grouped by held expert (``counts[e]`` rows each) -> [N, H]."""
        outs = []
        for e, xe in enumerate(x.split(counts)):
            gate, up = (xe @ self.gate_up.weight[e].t()).chunk(2, dim=-1)
            outs.append(self.act(gate, up) @ self.down.weight[e].t())
        return torch.cat(outs) if outs else x[:0]


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


@dataclass
class Routing:
    """One layer's routing of T tokens: what the experts get and what the losses need."""

    order: torch.Tensor  # [N] kept assignments (index a = slot * T + token), grouped by expert
    counts: list[int]  # [E] kept assignments per expert
    weights: torch.Tensor  # [N] router weight of each kept assignment (the logits' dtype)
    aux: torch.Tensor  # load-balancing loss (differentiable)
    z: torch.Tensor  # router z-loss (differentiable)
    load: torch.Tensor  # [E] assignments per expert before any drop
    dropped: int


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None, norm_topk_prob: bool = True) -> Routing:
    """Top-k routing of ``logits`` [T, E] (fp32 or wider) with the module docstring's drop rule;
    ``norm_topk_prob``: the k weights renormalised to sum to 1, else the softmax's own."""
    tokens, num_experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top_w, top_e = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
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

    def __init__(self, args: ModelArgs, state: MoEState):
        super().__init__()
        moe = args.moe
        self.moe, self.state = moe, state
        ffn = llama_arch.expert_ffn(args)
        self.router = Router(moe.num_experts, args.hidden_size)
        self.experts = Experts(moe.num_experts, args.hidden_size, ffn)
        # Always-on SwiGLU of num_shared_experts * F features, like the dense MLP.
        self.shared = None if not moe.num_shared_experts else MLP(args.hidden_size, moe.num_shared_experts * ffn)
        self.loss_weight = 1.0 / len(llama_arch.moe_layer_indices(args))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        wide = torch.promote_types(x.dtype, torch.float32)  # bf16 -> fp32; a float64 model stays float64
        with accelerator.autocast(x.device.type, enabled=False):
            logits = tokens.to(wide) @ self.router.weight.to(wide).t()
        r = route(logits, self.moe.top_k, self.moe.capacity_factor, self.moe.norm_topk_prob)
        num_tokens = tokens.shape[0]
        token_of = r.order % num_tokens
        y = self.experts(tokens[token_of], r.counts)
        combined = torch.zeros(tokens.shape, dtype=torch.promote_types(y.dtype, torch.float32), device=x.device)
        combined.index_add_(0, token_of, y * r.weights[:, None])
        out = combined.to(x.dtype).view(shape)
        if self.shared is not None:
            out = out + self.shared(x)
        loss = self.loss_weight * (self.moe.aux_loss_coef * r.aux + self.moe.z_loss_coef * r.z)
        if not self.state.replay:
            self.state.stats.append(
                {
                    "aux": r.aux.detach(),
                    "z": r.z.detach(),
                    "load": r.load.detach(),
                    "dropped": r.dropped,
                    "layer": id(self),
                }
            )
        if torch.is_grad_enabled() and loss.requires_grad:
            out = _AddAuxLoss.apply(out, loss, self.state.loss_scale)
        return out
