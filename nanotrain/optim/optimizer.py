"""Build the AdamW optimizer: plain (ZeRO-0), with dp-sharded states (ZeRO-1), or with dp-sharded
states and gradients (ZeRO-2: the same optimizer, its gradients reduce-scattered every
micro-batch into an owned accumulator by the gradient sync).

Weight decay goes to parameters with 2 or more dimensions (linear weights, embeddings) and not to
1-D ones (RMSNorm weights, biases), the usual Llama / nanoGPT practice: decaying a norm's gain or a
bias towards zero only fights the normalisation and has no regularising value.

Both stages take the same param groups (the decay group first, then the no-decay group, each
keeping the caller's parameter order, always both groups even when one is empty) and the same
AdamW options, so ZeRO-1 reproduces ZeRO-0 exactly. On CUDA both use the fused kernel (one launch
for every tensor); on CPU torch's default (single-tensor). Every AdamW implementation is
elementwise, so slicing the parameters into shards does not change the arithmetic.

Checkpoint writers can use ``optimizer_state_by_name`` / ``load_optimizer_state_by_name``, which
give the same per-parameter layout for both stages (ZeRO-0 owns the whole range of each param).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from nanotrain.config.schema import OptimizerArgs
from nanotrain.parallel import accelerator
from nanotrain.parallel.data_parallel.expert_sync import is_expert_param
from nanotrain.parallel.data_parallel.hybrid import shard_groups
from nanotrain.parallel.data_parallel.zero import ZeroOneOptimizer, placed_state
from nanotrain.parallel.parallel_context import ParallelContext


def weight_decay_groups(named_params: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """[decay group (ndim >= 2), no-decay group (ndim < 2)], with names; trainable params only."""
    decay = {"params": [], "param_names": [], "weight_decay": weight_decay}
    no_decay = {"params": [], "param_names": [], "weight_decay": 0.0}
    seen: set[int] = set()
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:  # tied parameters are optimized once
            continue
        seen.add(id(p))
        g = decay if p.ndim >= 2 else no_decay
        g["params"].append(p)
        g["param_names"].append(name)
    return [decay, no_decay]


def build_optimizer(
    named_params: Iterable[tuple[str, nn.Parameter]],
    args: OptimizerArgs,
    dp_group: Optional[dist.ProcessGroup] = None,
    zero_stage: Optional[int] = None,
    expert_dp_group: Optional[dist.ProcessGroup] = None,
    fused: bool = False,
    gather_dtype: Optional[torch.dtype] = None,
) -> torch.optim.AdamW:
    """AdamW over ``named_params`` (``model.named_parameters()`` of this pp stage / tp shard).

    ``zero_stage`` (default ``args.zero_stage``): 0 = ``torch.optim.AdamW``; 1 =
    ``ZeroOneOptimizer`` (an AdamW subclass) sharding states over ``dp_group`` (pass
    ``pc.dp_cp_pg``); 2 = the same, the gradient sync (built first) turned into per-micro-batch
    reduce-scatters into owned shards (``data_parallel/shard_grads.py``); 3 = the parameters
    sharded too, each layer gathered when it computes (``data_parallel/shard_params.py``). Either way
    param_groups carry ``param_names`` and an LR scheduler drives ``param_groups[i]["lr"]``.
    Gradients must be dp-averaged before ``step()``.

    With experts (ep > 1) pass ``dp_group=pc.dense_replica_pg`` (dp x cp x ep) and
    ``expert_dp_group=pc.dp_cp_pg``: ZeRO-1 then shards the expert parameters over the latter
    (``ZeroOneOptimizer``'s domains); ZeRO-0 ignores both. ``optimizer_groups(pc)`` gives the pair.

    ``gather_dtype`` (stage 3): the model's compute dtype; below the parameters' (bf16 under
    autocast) training's gathers send the owned pieces in it, half the bytes.

    ``fused``: the fused kernel on the CPU too (always on accelerators): the only AdamW that
    takes a ``found_inf`` flag, which ``training.spike.policy: skip`` sets (``training/spike.py``).

    Raises:
        ValueError: no trainable parameter, or a ``zero_stage`` other than 0, 1, 2 and 3.
    """
    stage = args.zero_stage if zero_stage is None else zero_stage
    groups = weight_decay_groups(named_params, args.weight_decay)
    if not groups[0]["params"] and not groups[1]["params"]:
        raise ValueError("build_optimizer: no trainable parameters")
    kwargs = dict(lr=args.lr, betas=tuple(args.betas), eps=args.eps)
    params = groups[0]["params"] + groups[1]["params"]
    if fused or all(accelerator.of(p.device) is not None for p in params):
        kwargs["fused"] = True  # one kernel for all tensors (torch's default on CUDA is foreach)
    if stage == 0:
        return torch.optim.AdamW(groups, **kwargs)
    if stage in (1, 2, 3):
        return ZeroOneOptimizer(
            groups,
            dp_group,
            expert_group=expert_dp_group,
            is_expert=is_expert_param,
            stage=stage,
            gather_dtype=gather_dtype,
            **kwargs,
        )
    raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {stage!r}")


def optimizer_groups(pc: ParallelContext, shard_size: Optional[int] = None) -> dict:
    """``build_optimizer``'s group keywords for a ParallelContext: the data-parallel replicas of
    the dense parameters and, with ep > 1, of the expert shards; under hybrid sharding
    (``shard_size``, ``optimizer.zero_shard_size``) this rank's block of each
    (``data_parallel/hybrid.py``), as ``build_grad_sync`` was given."""
    dense = shard_groups(pc, "dp_cp_ep", shard_size).shard if shard_size else pc.dense_replica_pg
    if pc.ep_size == 1:
        return {"dp_group": dense}
    experts = shard_groups(pc, "dp_cp", shard_size).shard if shard_size else pc.dp_cp_pg
    return {"dp_group": dense, "expert_dp_group": experts}


def optimizer_state_by_name(optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """Per-parameter AdamW state in one layout for ZeRO-0 and ZeRO-1 (see
    ``ZeroOneOptimizer.sharded_state``): ``{name: {start, stop, numel, shape, step, exp_avg,
    exp_avg_sq}}`` where [start, stop) is the range of the flattened local parameter held here."""
    if isinstance(optimizer, ZeroOneOptimizer):
        return optimizer.sharded_state()
    out = {}
    for group in optimizer.param_groups:
        for name, p in zip(group["param_names"], group["params"]):
            st = optimizer.state.get(p, {})
            # Zeros only for a parameter without state (before the first step): a default
            # argument would allocate and fill them for every parameter at every save.
            out[name] = {
                "start": 0,
                "stop": p.numel(),
                "numel": p.numel(),
                "shape": tuple(p.shape),
                "step": st["step"] if "step" in st else torch.tensor(0.0),
                "exp_avg": (st["exp_avg"] if "exp_avg" in st else torch.zeros_like(p)).reshape(-1),
                "exp_avg_sq": (st["exp_avg_sq"] if "exp_avg_sq" in st else torch.zeros_like(p)).reshape(-1),
            }
    return out


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, states: dict[str, dict]) -> None:
    """Inverse of ``optimizer_state_by_name`` (each entry holds this rank's range only)."""
    if isinstance(optimizer, ZeroOneOptimizer):
        optimizer.load_sharded_state(states)
        return
    for group in optimizer.param_groups:  # where torch's load_state_dict puts them (placed_state)
        for name, p in zip(group["param_names"], group["params"]):
            src = states[name]
            optimizer.state[p] = {
                key: placed_state(src[key] if key == "step" else src[key].reshape(p.shape), p, group, key)
                for key in ("step", "exp_avg", "exp_avg_sq")
            }
