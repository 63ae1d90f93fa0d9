"""Per-GPU memory estimate for `--dry-run`: will this layout fit before we wait in the queue?

Pure arithmetic on the config (a 512-node plan takes microseconds). The estimate is for the
busiest rank: the pipeline stage with the most layers plus the embedding (first stage) or the
LM head and its logits (last stage).
- weights: fp32 master copy (the bf16 copies autocast makes are saved for backward: they are
  counted in the activations, per micro-batch in flight);
- gradients: fp32 (accumulated in fp32 across micro-batches);
- optimizer: AdamW exp_avg + exp_avg_sq in fp32, divided by dp*cp under ZeRO-1;
- activations: what autograd keeps per layer in this implementation, for ``training.recompute``
  (``llama_activations.activation_bytes_per_layer``, measured by ``benchmarks/memory.py``), times the
  micro-batches a stage holds at once (``micro_batches_in_flight``: all m for afab, pp - rank for
  1f1b, ((v+1)pp - 2 rank - 1)/v interleaved), on the first stage or the last, whichever holds
  more; the last adds the head's saved tensors (final norm, fp32 logits): once (its virtual
  stage runs each backward right after the forward) or m times (afab); plus the logits'
  gradient; plus, under recompute, the one layer (one micro-batch) whose dropped tensors
  backward recomputes at a time.
- MoE (``model.moe``): a rank holds num_experts/ep experts of each MoE layer; its extra activations
  (k routed copies of each token, the experts' intermediates) are ``llama_activations.moe_extra_activation_bytes``.
It ignores allocator fragmentation, communication buffers and the CUDA context (~1-3 GB).
"""
from __future__ import annotations

from dataclasses import dataclass

from nanotrain.config import Config
from nanotrain.models import llama_activations, llama_arch

GB = 1024**3
# No accelerator holds this much (the largest have ~300 GB): an estimate above it means a model
# shape typo (hidden_size 10**12), and deserves a warning even without slurm.gpu_memory_gb.
ABSURD_GB = 1024.0


def _gb(value: float) -> str:
    return f"{value:.2f}" if value < 1e6 else f"{value:.3g}"


@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    grads: float
    optimizer: float
    activations: float
    in_flight: float
    layers_per_stage: int
    saved_activations: float = 0.0  # the part of `activations` autograd keeps (benchmarks/memory.py)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def stage_parameters(config: Config) -> tuple[int, int]:
    """Parameters held by one tp rank of the busiest stage, and that stage's layer count.

    The stage assumed busiest is the last one given the most layers any stage could hold
    (ceil(L/pp)), plus its final norm and LM head — its own matrix, or (pp > 1, tied) the
    embedding's replica — and the embedding itself when pp = 1. Counts per block: llama_arch."""
    m, p = config.model, config.parallelism
    layers = -(-m.num_layers // p.pp)
    names = [f"layers.{i}" for i in range(m.num_layers - layers, m.num_layers)] + ["final_norm"]
    names += ["embed"] if (m.tie_word_embeddings or p.pp == 1) else []
    names += [] if m.tie_word_embeddings else ["lm_head"]
    return sum(llama_arch.block_parameters(m, name, p.tp, p.ep) for name in names), layers


def micro_batches_in_flight(config: Config, pp_rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at its peak, in units of
    its whole share of layers: afab all m; 1f1b ``pp - rank`` (the first stage the most);
    interleaved (v chunks) ``((v + 1) pp - 2 rank - 1) / v`` chunk-forwards (Megatron's warm-up
    plus the one in steady state). Capped at m."""
    p, m = config.parallelism, config.training.batch_accumulation_per_replica
    if p.pp == 1:
        return 1.0
    if p.pp_engine == "afab":
        return float(m)
    if p.pp_engine == "interleaved_1f1b":
        v = p.pp_virtual_stages
        return min(float(m), ((v + 1) * p.pp - 2 * pp_rank - 1) / v)
    return float(min(m, p.pp - pp_rank))


def estimate_memory(config: Config) -> MemoryEstimate:
    p, t, mdl = config.parallelism, config.training, config.model
    params, layers = stage_parameters(config)
    weights = grads = 4 * params
    # MoE layers (model.moe) add the routed token copies and the experts' intermediates.
    moe_layers = sum(llama_arch.is_moe_layer(mdl, i) for i in range(mdl.num_layers - layers, mdl.num_layers))
    # ZeRO-1 shards the dense states over dp x cp x ep (their replicas) and the routed experts'
    # over dp x cp (each expert shard's replicas).
    experts = moe_layers * llama_arch.routed_expert_parameters(mdl, p.ep) if mdl.moe else 0
    if config.optimizer.zero_stage == 1:
        optimizer = 8 * ((params - experts) / (p.dp * p.cp * p.ep) + experts / (p.dp * p.cp))
    else:
        optimizer = 8 * params

    def per_layer(recompute: str) -> float:
        return llama_activations.activation_bytes_per_layer(mdl, t.sequence_length, t.micro_batch_size, tp=p.tp,
                                                     tp_mode=p.tp_mode, cp=p.cp, recompute=recompute,
                                                     cpu=config.slurm.gpus_per_node == 0)

    def moe_extra(recompute: str) -> float:
        return llama_activations.moe_extra_activation_bytes(mdl, t.sequence_length, t.micro_batch_size, tp=p.tp,
                                                     tp_mode=p.tp_mode, cp=p.cp, recompute=recompute)

    per_layer_moe = moe_extra(t.recompute)
    stack = layers * per_layer(t.recompute) + moe_layers * per_layer_moe
    local = t.sequence_length // p.cp
    head = llama_activations.head_saved_bytes(mdl, local, t.micro_batch_size, p.tp, p.tp_mode)
    # The busiest of the first stage (most micro-batches in flight) and the last (plus the head),
    # each given the most layers a stage holds.
    first, last = micro_batches_in_flight(config, 0), micro_batches_in_flight(config, p.pp - 1)
    # The head sits in the last virtual stage, which runs each micro-batch's backward right after
    # its forward (1f1b, interleaved): one in flight; afab holds all m.
    heads = float(config.training.batch_accumulation_per_replica) if p.pp > 1 and p.pp_engine == "afab" else 1.0
    candidates = [(first * stack + (head if p.pp == 1 else 0), first),
                  (last * stack + heads * head, last)]
    saved, in_flight = max(candidates)
    logits_grad = llama_activations.logits_bytes(mdl, local, t.micro_batch_size, p.tp) / 2
    # One layer's dropped tensors, rebuilt in backward (an MoE layer's when the stage has one).
    recomputing = per_layer("none") - per_layer(t.recompute)
    if moe_layers:
        recomputing += moe_extra("none") - per_layer_moe
    return MemoryEstimate(weights / GB, grads / GB, optimizer / GB, (saved + logits_grad + recomputing) / GB,
                          in_flight, layers, saved / GB)


def describe(config: Config) -> list[str]:
    """Lines for --dry-run; the last one warns when the estimate exceeds slurm.gpu_memory_gb."""
    est = estimate_memory(config)
    p = config.parallelism
    over = " x ".join(f"{axis}{n}" for axis, n in (("dp", p.dp), ("cp", p.cp), ("ep", p.ep))
                      if n > 1 or axis == "dp")
    if p.ep > 1:
        over += f" (experts over dp{p.dp}" + (f" x cp{p.cp})" if p.cp > 1 else ")")
    zero = f", ZeRO-1 over {over}" if config.optimizer.zero_stage == 1 else ""
    recompute = f", recompute {config.training.recompute}" if config.training.recompute != "none" else ""
    lines = [f"memory per GPU (estimate, busiest rank): weights {_gb(est.weights)} GB + grads {_gb(est.grads)} GB"
             f" + optimizer {_gb(est.optimizer)} GB{zero} + activations {_gb(est.activations)} GB "
             f"({est.in_flight:g} micro-batch(es) in flight x {est.layers_per_stage} layers{recompute})"
             f" = {_gb(est.total)} GB"]
    if config.model.moe is not None:
        count, moe = llama_arch.parameter_count(config.model), config.model.moe
        lines.append(f"parameters: total {count.total:,}, active per token {count.active:,} "
                     f"(top_k {moe.top_k} of {moe.num_experts} experts in {count.moe_layers} MoE layers); "
                     f"each ep rank holds {moe.num_experts // p.ep} experts per MoE layer; gradients: dense "
                     f"averaged over dp*cp*ep = {p.dp * p.cp * p.ep}, experts over dp*cp = {p.dp * p.cp}")
    limit = config.slurm.gpu_memory_gb
    if est.total > ABSURD_GB:
        lines.append(f"warning: the estimate {_gb(est.total)} GB per GPU is more than any accelerator holds "
                     f"(> {ABSURD_GB:g} GB): check model.hidden_size, intermediate_size, num_layers and "
                     "vocab_size, or raise tp/pp")
    elif limit is not None and est.total > limit:
        lines.append(f"warning: the estimate {est.total:.1f} GB exceeds slurm.gpu_memory_gb ({limit:g} GB): "
                     "raise tp/pp, use optimizer.zero_stage: 1, or lower training.micro_batch_size")
    return lines
