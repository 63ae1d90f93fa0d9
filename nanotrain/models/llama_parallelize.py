"""The Llama's parallelize plan: a plain ``LlamaModel`` -> this rank's ``ModelPart``.

One function per step, applied in this order by ``parallelize_llama`` (torchtitan's
``parallelize_llama``, picotron's module swaps):

1. ``pipeline_stage``   — the model is built on ``meta``; this rank keeps the blocks of its
   (virtual) stages (``llama_arch.rank_blocks``: the cost-balanced split, plus the tied
   embedding's replica on the last stage);
2. ``tensor_parallel``  — the linears, the embedding and the loss become nanotrain's
   tensor-parallel modules (column: qkv, gate/up, LM head; row: o_proj, down; vocab-parallel
   embedding and cross-entropy); under sequence parallelism (REDUCE_SCATTER) the replicated
   norms, router and experts are marked as holding partial gradients (summed over tp after
   backward), and so are the q/k norms in both modes (each tp rank holds some of the heads);
3. ``context_parallel`` — each attention core gathers keys and values over cp and runs the
   zig-zag kernel;
4. ``expert_parallel``  — each MoE layer's experts are cut to this rank's and wrapped in the
   all-to-all dispatch;
5. placement            — storage on the device and the seeded initial values (every topology
   starts from the single-process weights);
6. ``compile_layers``   — ``torch.compile`` of each decoder layer, in place;
7. ``recompute``        — ``training.recompute`` as wrappers: ``full`` around each decoder layer,
   ``selective`` around the parameterless kernels (attention kernel, SwiGLU activations); and
   ``training.loss_chunk_tokens`` (resolved), the head's chunk of tokens (``chunked_loss.py``);
8. precision            — the compute dtype (autocast) the part runs its forward under.

Steps 1-4 run on the meta device, so no rank ever holds more than its own part. Names never
change: a checkpoint of any topology lists the single-process model's parameter names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from nanotrain.config import Config, ModelArgs
from nanotrain.models import llama_arch, llama_counts
from nanotrain.models.llama import Attention, CausalKernel, DecoderLayer, LlamaModel
from nanotrain.models.llama_parallelize_costs import check_recompute, head_chunk_rows, loss_chunk_tokens
from nanotrain.models.mlp import MLP, SwiGLU
from nanotrain.models.moe import MoEFeedForward
from nanotrain.parallel.context_parallel import ContextParallel, ContextParallelKernel, GatherKV
from nanotrain.parallel.expert_parallel import ExpertParallel
from nanotrain.parallel.part import placement
from nanotrain.parallel.part.model_part import ModelPart
from nanotrain.parallel.part.recompute import Recomputed, compile_layers_, recompute_modules_
from nanotrain.parallel.pipeline_parallel import keep_blocks_, mark_tied_, place_stages
from nanotrain.parallel.tensor_parallel import TensorParallelLinearMode, as_mode, group_size
from nanotrain.parallel.tensor_parallel.swap import (
    VocabParallelCrossEntropy,
    column_parallel,
    mark_sequence_parallel_,
    row_parallel,
    vocab_parallel_embedding,
)


@dataclass(frozen=True)
class ParallelPlan:
    """How one rank's part is cut, placed and run. ``tp_pg``/``cp_pg``/``ep_pg``: process groups
    or stand-ins with ``size()`` and ``rank()`` (``tp_pg`` None: the default group when one
    exists; ``cp_pg``/``ep_pg`` None: no cp / ep)."""

    tp_pg: Any = None
    mode: TensorParallelLinearMode = TensorParallelLinearMode.ALL_REDUCE
    async_communication: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    virtual_stages: int = 1
    cp_pg: Any = None
    cp_balance: str = "zigzag"  # or "documents": per-micro-batch token orders (context_parallel.py)
    ep_pg: Any = None
    recompute: str = "none"
    loss_chunk_tokens: int = 0  # the head's logits this many tokens at a time (0: in one piece)
    compile_layers: bool = False
    compute_dtype: Optional[torch.dtype] = None
    seed: int = 0
    device: Any = None  # None: torch's default device (``with torch.device(...)`` around the build)
    initialize: bool = True  # False: a skeleton on meta (names, shapes, shard records only)


def plan_from_config(config: Config, pc: Optional[Any] = None, device=None) -> ParallelPlan:
    """This rank's plan for ``config``: ``pc`` is a ParallelContext (or anything with its
    ``tp_pg``, ``pp_rank``, ``pp_size``, ``cp_pg`` and ``ep_pg``); None is one process.
    ``model.dtype`` is the compute dtype (autocast) on every device; weights, gradients and
    optimizer states stay fp32."""
    p = config.parallelism
    return ParallelPlan(
        tp_pg=pc.tp_pg if pc is not None else None,
        mode=as_mode(p.tp_mode),
        async_communication=p.tp_linear_async_communication,
        pp_rank=pc.pp_rank if pc is not None else 0,
        pp_size=pc.pp_size if pc is not None else 1,
        virtual_stages=p.pp_virtual_stages,
        cp_pg=pc.cp_pg if pc is not None else None,
        cp_balance=p.cp_balance,
        ep_pg=pc.ep_pg if pc is not None else None,
        recompute=config.training.recompute,
        loss_chunk_tokens=loss_chunk_tokens(config),
        compile_layers=config.training.compile,
        compute_dtype=getattr(torch, config.model.dtype),
        seed=config.training.seed,
        device=device,
    )


def parallelize_llama(model: LlamaModel, plan: ParallelPlan) -> ModelPart:
    """This rank's part of ``model`` (a plain ``LlamaModel`` on the meta device) under ``plan``."""
    check_recompute(plan.recompute)
    with placement.on_meta():
        chunks = pipeline_stage(model, plan)
        tensor_parallel(model, plan)
        tie_across_stages(model, chunks)
        cp = context_parallel(model, plan)
        expert_parallel(model, plan)
    device = torch.device(plan.device) if plan.device is not None else torch.get_default_device()
    if plan.initialize:
        placement.materialize_(model, device)
        placement.initialize_(model, lambda name: model.param_initializer(name, plan.seed))
    if plan.compile_layers:  # in place, before any wrapper: names and weights are unchanged
        compile_layers_(list(model.layers.values()), device.type)
    recompute(model, plan)
    model.loss_chunk_tokens = plan.loss_chunk_tokens
    sequence_shards = group_size(plan.tp_pg) if plan.mode is TensorParallelLinearMode.REDUCE_SCATTER else 1
    return ModelPart(
        model,
        chunks,
        cp=cp,
        sequence_shards=sequence_shards,
        mode=plan.mode,
        async_communication=plan.async_communication,
        compute_dtype=plan.compute_dtype,
    )


def build_part(config: Config, pc: Optional[Any] = None, device=None, initialize: bool = True) -> ModelPart:
    """This rank's part for ``config`` (``ModelFamily.build_part``); ``initialize`` False: a
    skeleton on meta (names, shapes, shard records) for offline tools."""
    with placement.on_meta():
        model = LlamaModel(config.model)
    return parallelize_llama(model, dataclasses.replace(plan_from_config(config, pc, device), initialize=initialize))


def build_llama(args: ModelArgs, tp_pg=None, **plan: Any) -> ModelPart:
    """``parallelize_llama`` of a ``LlamaModel(args)`` built on meta; ``plan``: ``ParallelPlan``'s
    fields (``mode`` may be the config's string, ``compute_dtype`` a dtype name)."""
    if isinstance(plan.get("compute_dtype"), str):
        plan["compute_dtype"] = getattr(torch, plan["compute_dtype"])
    plan["mode"] = as_mode(plan.get("mode", TensorParallelLinearMode.ALL_REDUCE))
    with placement.on_meta():
        model = LlamaModel(args)
    return parallelize_llama(model, ParallelPlan(tp_pg=tp_pg, **plan))


# ----------------------------------------------------------------------------- the steps
def pipeline_stage(model: LlamaModel, plan: ParallelPlan):
    """Keep this rank's blocks; returns its chunks. With tied embeddings and pp > 1 the last
    stage keeps a replica of ``embed`` for its LM head (``pipeline_parallel/tied.py``)."""
    args = model.args
    blocks = llama_arch.pipeline_blocks(args)
    chunks = place_stages(
        [b.name for b in blocks],
        [b.cost for b in blocks],
        [b.attach for b in blocks],
        plan.pp_rank,
        plan.pp_size,
        plan.virtual_stages,
    )
    held = set(llama_arch.rank_blocks(args, plan.pp_size, plan.pp_rank, plan.virtual_stages))
    names = [b.name for b in blocks]
    if args.tie_word_embeddings:  # the head multiplies by embed.weight: it goes where final_norm goes
        names.append("lm_head")
        held |= {"lm_head"} if "final_norm" in held else set()
    keep_blocks_(model, names, held)
    return chunks


def tie_across_stages(model: LlamaModel, chunks) -> None:
    """With tied embeddings and pp > 1, mark the first stage's ``embed.weight`` and the last
    stage's replica, whose gradients are summed after backward (``pipeline_parallel/tied.py``)."""
    if model.args.tie_word_embeddings and chunks[0].num_virtual_stages > 1 and model.embed is not None:
        owner = any("embed" in chunk for chunk in chunks)
        mark_tied_(model.embed.weight, "embed.weight", replica=not owner)


def tensor_parallel(model: LlamaModel, plan: ParallelPlan) -> None:
    """Swap the linears, embedding and loss for tensor-parallel modules over ``plan.tp_pg``."""
    args, pg, mode, overlap = model.args, plan.tp_pg, plan.mode, plan.async_communication
    hd, kv = llama_arch.head_dim(args), llama_arch.kv_heads(args)
    q_out, kv_out = args.num_attention_heads * hd, kv * hd
    sequence_parallel = mode is TensorParallelLinearMode.REDUCE_SCATTER and group_size(pg) > 1
    if model.embed is not None:
        model.embed = vocab_parallel_embedding(model.embed, pg, mode)
    for layer in model.layers.values():
        layer.attn.qkv = column_parallel(layer.attn.qkv, pg, mode, overlap, chunks=(q_out, kv_out, kv_out))
        layer.attn.o_proj = row_parallel(layer.attn.o_proj, pg, mode, overlap)
        moe = layer.mlp if isinstance(layer.mlp, MoEFeedForward) else None
        for mlp in [m for m in ([layer.mlp] if moe is None else [moe.shared]) if isinstance(m, MLP)]:
            width = mlp.down.in_features
            mlp.gate_up = column_parallel(mlp.gate_up, pg, mode, overlap, chunks=(width, width))
            mlp.down = row_parallel(mlp.down, pg, mode, overlap)
        if moe is not None and sequence_parallel:
            # Routed experts are not split over tp: each tp rank routes its own sequence shard,
            # its losses are means over that shard and these gradients are summed over tp.
            moe.loss_weight /= group_size(pg)
            mark_sequence_parallel_([moe.router.weight, moe.experts.gate_up.weight, moe.experts.down.weight])
    if model.lm_head is not None:
        head = column_parallel(model.lm_head, pg, mode, overlap, pad_to_tp=True)
        if args.tie_word_embeddings:
            head.weight = model.embed.weight
        model.lm_head = head
    model.loss = VocabParallelCrossEntropy(pg, args.vocab_size)
    if sequence_parallel:  # every replicated norm sees this rank's sequence shard only
        mark_sequence_parallel_(p for n, p in model.named_parameters() if n.endswith("norm.weight"))
    elif args.qk_norm and group_size(pg) > 1:  # the q/k norms see this rank's heads only, in either mode
        qk_norms = ("q_norm.weight", "k_norm.weight")
        mark_sequence_parallel_(p for n, p in model.named_parameters() if n.endswith(qk_norms))


def context_parallel(model: LlamaModel, plan: ParallelPlan) -> ContextParallel:
    """Each attention core gathers k/v over ``plan.cp_pg`` and runs the zig-zag kernel (or, with
    ``plan.cp_balance`` "documents", the micro-batch's own token order under its mask)."""
    cp = ContextParallel(plan.cp_pg, plan.cp_balance)
    if cp.enabled:
        for layer in model.layers.values():
            layer.attn.core.kernel = ContextParallelKernel(cp)
            layer.attn.core = GatherKV(layer.attn.core, cp)
    return cp


def expert_parallel(model: LlamaModel, plan: ParallelPlan) -> None:
    """Each MoE layer keeps its E/ep experts and dispatches rows to the others over ``plan.ep_pg``."""
    if plan.ep_pg is None or group_size(plan.ep_pg) == 1:
        return
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoEFeedForward):
            layer.mlp.experts = ExpertParallel(layer.mlp.experts, plan.ep_pg)


def recompute(model: LlamaModel, plan: ParallelPlan) -> None:
    """``full``: each decoder layer keeps only its input (an MoE layer's routing statistics are
    not recorded again when it reruns); ``selective``: the attention kernels and SwiGLU
    activations rerun in backward."""
    if plan.recompute == "full":
        for key, layer in list(model.layers.items()):
            model.layers[key] = Recomputed(layer, replay=model.moe_state.replaying)
    elif plan.recompute == "selective":
        recompute_modules_(model, (CausalKernel, ContextParallelKernel, SwiGLU))


# ----------------------------------------------------------------------------- numbers
def flops_per_token(config: Config) -> tuple[int, int]:
    """(model, hardware) FLOPs of one training token, read from a plain meta model with this
    config's recompute wrappers: the model FLOPs (MFU), plus the forwards the wrappers rerun in
    backward (HFU): a whole decoder layer under ``full``, the attention kernel under
    ``selective`` (the SwiGLU activation is elementwise, not counted), and the LM head's under
    the chunked loss (``head_chunk_rows``: each chunk's logits are recomputed)."""
    with placement.on_meta():
        model = LlamaModel(config.model)
        recompute(model, ParallelPlan(recompute=config.training.recompute))
    seq = config.training.sequence_length
    rerun = 0
    for module in model.modules():
        if isinstance(module, Recomputed) and isinstance(module.inner, DecoderLayer):
            layer = module.inner
            rerun += 2 * llama_counts.matmul_parameters(layer) + llama_counts.attention_forward_flops(layer, seq)
        elif isinstance(module, Attention) and any(
            isinstance(m, Recomputed) and isinstance(m.inner, CausalKernel) for m in module.modules()
        ):
            rerun += llama_counts.attention_forward_flops(module, seq)
    if head_chunk_rows(config):
        rerun += 2 * config.model.hidden_size * config.model.vocab_size
    model_flops = llama_counts.training_flops_per_token(model, seq)
    return model_flops, model_flops + rerun
