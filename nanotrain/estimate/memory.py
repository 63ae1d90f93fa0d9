"""Per-GPU memory estimate for `--dry-run`: will this layout fit before we wait in the queue?

Pure arithmetic on the config (a 512-node plan takes microseconds). The estimate is for the
busiest rank: each pipeline rank's blocks are those the pipeline step keeps there (the model's
own cost-balanced split, ``llama_arch.rank_blocks``), and the largest total is reported.
- weights: fp32 master copy (the bf16 copies autocast makes are saved for backward: they are
  counted in the activations, per micro-batch in flight); under ZeRO-3 only this rank's shard
  persists, plus the units gathered at once (``zero3_gathered_bytes``);
- gradients: fp32 (accumulated in fp32 across micro-batches); under ZeRO-2 only this rank's
  shard persists (divided like the optimizer states), plus the full-size bucket buffers alive at
  once during backward (``zero2_bucket_bytes``: the one being reduce-scattered and the one
  filling, each the bucket cap or the rank's largest parameter, whichever is larger); ZeRO-3
  the same;
- optimizer: AdamW exp_avg + exp_avg_sq in fp32, divided by dp*cp under ZeRO-1, 2 and 3;
- activations: what autograd keeps per layer in this implementation, for ``training.recompute``
  (``llama_parallelize_costs.activation_bytes_per_layer``, measured by ``benchmarks/memory.py``), times the
  micro-batches a stage holds at once (``micro_batches_in_flight``: all m for afab, pp - rank for
  1f1b, ((v+1)pp - 2 rank - 1)/v interleaved); the last stage adds the head's saved tensors
  (final norm, fp32 logits): once (its virtual stage runs each backward right after the
  forward) or m times (afab), and what its backward adds (``head_backward_bytes``: the logits'
  gradients, the LM head weight's copy in bf16), which is over before the layers' backward
  begins. Under the chunked loss (``training.loss_chunk_tokens``, ``head_chunk_rows``) the head
  keeps only its input, and its backward holds one chunk's logits and gradients at a time;
  plus, under recompute, the one layer
  (one micro-batch) whose dropped tensors backward recomputes at a time.
- MoE (``model.moe``): a rank holds num_experts/ep experts of each MoE layer; its extra activations
  (k routed copies of each token, the experts' intermediates) are
  ``llama_parallelize_costs.moe_extra_activation_bytes``.
It ignores allocator fragmentation, communication buffers and the CUDA context (~1-3 GB).
Attention is counted as the causal kernel holds it (inputs, output, log-sum-exp). Under
``data.document_masking`` (``attention_accounting`` says it in --dry-run, --plan and the run's
first lines): the FlexAttention kernel (``model.attention_kernel`` flex, auto's choice on a GPU)
holds the same plus tile lists of ``B * S/cp/128 * S/128`` entries (left out); the materialised
mask (sdpa_mask, auto's on a CPU cluster) adds its boolean mask per micro-batch in flight
(``micro_batch_size * S/cp * S`` bytes, shared by the layers: 64 MiB at S = 8192), counted here.
Per-sample RoPE tables are left out (``parallel/documents.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanotrain.config import Config
from nanotrain.config.schema_model import attention_kernel_on
from nanotrain.logging.flops import attention_accounting
from nanotrain.models import llama_arch, llama_parallelize_costs

GB = 1024**3
# The trainer's gradient bucket size (``parallel/data_parallel/buckets.DEFAULT_BUCKET_CAP_MB``,
# equal by test): that module imports torch, which the estimate never does (``--plan`` speed).
BUCKET_CAP_BYTES = 25 * 1024 * 1024
# No accelerator holds this much (the largest have ~300 GB): an estimate above it means a model
# shape typo (hidden_size 10**12), and deserves a warning even without slurm.gpu_memory_gb.
ABSURD_GB = 1024.0


def _gb(value: float) -> str:
    return f"{value:.2f}" if value < 1e6 else f"{value:.3g}"


@dataclass(frozen=True)
class MemoryEstimate:
    """One pipeline rank's memory in GB (1e9 bytes) by category: fp32 weights, gradients, AdamW
    states, activations at the peak (``in_flight`` micro-batches of ``layers_per_stage`` layers,
    plus backward's largest working set); ``total`` is their sum."""

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


def stage_parameters(config: Config, pp_rank: int | None = None) -> tuple[int, int]:
    """Parameters held by one tp (and ep) rank of pipeline rank ``pp_rank`` (default: the
    busiest, ``busiest_stage``), and that rank's decoder-layer count: the blocks
    the pipeline step keeps there (``llama_arch.rank_blocks``, the model's own split)."""
    p = config.parallelism
    r = busiest_stage(config) if pp_rank is None else pp_rank
    rank = llama_arch.rank_summaries(config.model, p.pp, p.pp_virtual_stages)[r]
    return llama_arch.rank_parameters(config.model, rank, p.tp, p.ep)[0], len(rank.layers)


def busiest_stage(config: Config) -> int:
    """The pipeline rank whose estimate is the largest (ties: the first)."""
    p = config.parallelism
    ranks = llama_arch.rank_summaries(config.model, p.pp, p.pp_virtual_stages)
    bytes_of = _per_layer_bytes(config)
    totals = {
        r: _stage_estimate(config, r, ranks[r], bytes_of).total
        for r in llama_arch.distinct_ranks(config.model, p.pp, p.pp_virtual_stages)
    }
    return max(totals, key=lambda r: (totals[r], -r))


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
    """The estimate of the busiest pipeline rank (the largest total of any stage), from the config
    alone (no torch). Leaves out the CUDA context, communication buffers and fragmentation.

    Raises:
        ValueError: the layout cannot shard the model (a size not divisible by tp); a validated
            config never does.
    """
    p = config.parallelism
    ranks = llama_arch.rank_summaries(config.model, p.pp, p.pp_virtual_stages)
    bytes_of = _per_layer_bytes(config)
    return max(
        (
            _stage_estimate(config, r, ranks[r], bytes_of)
            for r in llama_arch.distinct_ranks(config.model, p.pp, p.pp_virtual_stages)
        ),
        key=lambda e: e.total,
    )


def _per_layer_bytes(config: Config) -> dict[str, float]:
    """What every stage's estimate shares: one layer's saved activations under the config's
    recompute and without, an MoE layer's extra, the head's."""
    p, t, mdl = config.parallelism, config.training, config.model
    common = dict(tp=p.tp, tp_mode=p.tp_mode, cp=p.cp)
    local = t.sequence_length // p.cp
    out = {
        f"layer/{mode}": llama_parallelize_costs.activation_bytes_per_layer(
            mdl, t.sequence_length, t.micro_batch_size, recompute=mode, cpu=config.slurm.gpus_per_node == 0, **common
        )
        for mode in {"none", t.recompute}
    }
    if mdl.moe:
        out.update(
            {
                f"moe/{mode}": llama_parallelize_costs.moe_extra_activation_bytes(
                    mdl, t.sequence_length, t.micro_batch_size, recompute=mode, **common
                )
                for mode in {"none", t.recompute}
            }
        )
    chunk = llama_parallelize_costs.head_chunk_rows(config)  # the chunked loss: one chunk's logits at a time
    out["head"] = llama_parallelize_costs.head_saved_bytes(mdl, local, t.micro_batch_size, p.tp, p.tp_mode, chunk)
    out["logits_grad"] = llama_parallelize_costs.head_backward_bytes(
        mdl, local, t.micro_batch_size, p.tp, p.tp_mode, chunk
    )
    return out


def zero2_bucket_bytes(config: Config, rank: llama_arch.RankSummary) -> float:
    """The full-size gradient buckets ZeRO-2 holds at once during backward on a rank holding
    ``rank``'s blocks: two (one reduce-scattering, one filling; ``shard_grads.py``), each the
    bucket cap or the largest parameter (a parameter never splits across buckets)."""
    m, p = config.model, config.parallelism
    largest = 2 * (m.intermediate_size // p.tp) * m.hidden_size  # the fused gate/up matrix
    if any(name in ("embed", "lm_head") for name in rank.others):
        largest = max(largest, llama_arch.vocab_rows_per_rank(m, p.tp) * m.hidden_size)
    if m.moe is not None and rank.moe_layers:  # the stacked experts' gate/up
        largest = max(largest, m.moe.num_experts // p.ep * 2 * llama_arch.expert_ffn(m) * m.hidden_size)
    return 2 * max(BUCKET_CAP_BYTES, 4 * largest)


def zero3_gathered_bytes(config: Config, rank: llama_arch.RankSummary) -> float:
    """The full-size fp32 weights ZeRO-3 holds gathered at once on a rank holding ``rank``'s blocks
    (``shard_params.py``): two adjacent units, the one computing and the one prefetched (forward:
    the next of its pipeline chunk; backward: the previous), since a unit is released once its
    forward, or its gradients, are done. Counted: the larger of the rank's two largest decoder
    layers and its largest layer beside its largest other unit, the embedding or the head (final
    norm and LM head; tied, the norm and the embedding it gathers as its LM head). The buckets'
    padding (under n elements each) is left out."""
    m, p = config.model, config.parallelism
    sizes = []
    if rank.first_moe is not None:
        moe = llama_arch.layer_parameters(m, p.tp, rank.first_moe, p.ep)
        if p.dp * p.cp == 1:  # the experts' group is one rank: kept whole (in the shard), never gathered
            moe -= llama_arch.routed_expert_parameters(m, p.ep)
        sizes += [moe] * min(rank.moe_layers, 2)
    if rank.first_dense is not None:
        dense = len(rank.layers) - rank.moe_layers
        sizes += [llama_arch.layer_parameters(m, p.tp, rank.first_dense, p.ep)] * min(dense, 2)
    sizes = sorted(sizes, reverse=True) + [0, 0]
    names = rank.others
    embed = llama_arch.block_parameters(m, "embed", p.tp) if "embed" in names else 0
    head = 0
    if "final_norm" in names:
        head = m.hidden_size + (llama_arch.block_parameters(m, "lm_head", p.tp) if "lm_head" in names else embed)
    return 4.0 * max(sizes[0] + sizes[1], sizes[0] + max(embed, head))


def _stage_estimate(config: Config, pp_rank: int, rank, bytes_of: dict[str, float]) -> MemoryEstimate:
    """The estimate of pipeline rank ``pp_rank``, whose blocks ``rank`` (a RankSummary) says."""
    p, t, mdl = config.parallelism, config.training, config.model
    layers, names = len(rank.layers), rank.others
    # MoE layers (model.moe) add the routed token copies and the experts' intermediates.
    moe_layers = rank.moe_layers
    params, experts = llama_arch.rank_parameters(mdl, rank, p.tp, p.ep)
    weights = grads = 4 * params
    # ZeRO-1 shards the dense states over dp x cp x ep (their replicas) and the routed experts'
    # over dp x cp (each expert shard's replicas); ZeRO-2 the gradients the same way.
    # Hybrid sharding (optimizer.zero_shard_size): over a block of that many replicas instead.
    block = config.optimizer.zero_shard_size
    sharded = (params - experts) / (block or p.dp * p.cp * p.ep) + experts / (block or p.dp * p.cp)
    stage = config.optimizer.zero_stage
    optimizer = 8 * (sharded if stage >= 1 else params)
    if stage >= 2:  # ZeRO-3's gradients are ZeRO-2's (buckets cut at the gather units: no larger)
        grads = 4 * sharded + zero2_bucket_bytes(config, rank)
    if stage == 3 and p.dp * p.cp * p.ep > 1:  # the parameters sharded like the states, each unit
        weights = 4 * sharded + zero3_gathered_bytes(config, rank)  # gathered around its use
    mode = t.recompute
    stack = layers * bytes_of[f"layer/{mode}"] + (moe_layers * bytes_of[f"moe/{mode}"] if moe_layers else 0.0)
    in_flight = micro_batches_in_flight(config, pp_rank)
    saved = in_flight * (stack + (mask_bytes(config) if layers else 0.0))
    # One layer's dropped tensors, rebuilt in backward (an MoE layer's when the stage has one).
    recomputing = bytes_of["layer/none"] - bytes_of[f"layer/{mode}"]
    if moe_layers:
        recomputing += bytes_of["moe/none"] - bytes_of[f"moe/{mode}"]
    working = recomputing  # the largest of backward's working sets, beside what stays saved
    head_kept = 0.0  # the head's saved tensors (autograd's, for saved_activations)
    if "final_norm" in names:  # the head: final norm, fp32 logits, and its backward's gradients
        # The head sits in the last virtual stage, which runs each micro-batch's backward right
        # after its forward (1f1b, interleaved): one in flight; afab holds all m. Its backward
        # (logits' gradients) ends before the layers' backward (and recomputation) begins.
        heads = float(t.batch_accumulation_per_replica) if p.pp > 1 and p.pp_engine == "afab" else 1.0
        saved += (heads - 1) * bytes_of["head"]
        head_kept = bytes_of["head"]
        working = max(working, bytes_of["head"] + bytes_of["logits_grad"])
    return MemoryEstimate(
        weights / GB, grads / GB, optimizer / GB, (saved + working) / GB, in_flight, layers, (saved + head_kept) / GB
    )


def mask_bytes(config: Config) -> float:
    """Bytes of the materialised document mask one micro-batch's layers share (0 unless
    ``data.document_masking`` runs the ``sdpa_mask`` kernel on this cluster)."""
    t, cuda = config.training, config.slurm.gpus_per_node != 0
    if not config.data.document_masking or attention_kernel_on(config.model, cuda) != "sdpa_mask":
        return 0.0
    return float(t.micro_batch_size * (t.sequence_length // config.parallelism.cp) * t.sequence_length)


def describe(config: Config) -> list[str]:
    """Lines for --dry-run; the last one warns when the estimate exceeds slurm.gpu_memory_gb."""
    est = estimate_memory(config)
    p = config.parallelism
    over = " x ".join(f"{axis}{n}" for axis, n in (("dp", p.dp), ("cp", p.cp), ("ep", p.ep)) if n > 1 or axis == "dp")
    if p.ep > 1:
        over += f" (experts over dp{p.dp}" + (f" x cp{p.cp})" if p.cp > 1 else ")")
    stage, block = config.optimizer.zero_stage, config.optimizer.zero_shard_size
    if block:
        over = f"blocks of {block} of {over} (hybrid: replicated across the blocks)"
    zero = f", ZeRO-{stage} over {over}" if stage else ""
    m = config.training.batch_accumulation_per_replica
    if stage == 2:
        zero += f" (grads too, reduce-scattered in each of {m} micro-batch(es))"
    elif stage == 3:
        zero += (
            f" (grads and weights too: each layer all-gathered in forward and backward of each of {m} "
            "micro-batch(es), two at a time)"
        )
    recompute = f", recompute {config.training.recompute}" if config.training.recompute != "none" else ""
    if llama_parallelize_costs.head_chunk_rows(config):
        recompute += f", loss in chunks of {llama_parallelize_costs.loss_chunk_tokens(config)} tokens"
    lines = [
        f"memory per GPU (estimate, busiest rank): weights {_gb(est.weights)} GB + grads {_gb(est.grads)} GB"
        f" + optimizer {_gb(est.optimizer)} GB{zero} + activations {_gb(est.activations)} GB "
        f"({est.in_flight:g} micro-batch(es) in flight x {est.layers_per_stage} layers{recompute})"
        f" = {_gb(est.total)} GB"
    ]
    lines += attention_accounting(config)
    if config.model.moe is not None:
        count, moe = llama_arch.parameter_count(config.model), config.model.moe
        lines.append(
            f"parameters: total {count.total:,}, active per token {count.active:,} "
            f"(top_k {moe.top_k} of {moe.num_experts} experts in {count.moe_layers} MoE layers); "
            f"each ep rank holds {moe.num_experts // p.ep} experts per MoE layer; gradients: dense "
            f"averaged over dp*cp*ep = {p.dp * p.cp * p.ep}, experts over dp*cp = {p.dp * p.cp}"
        )
    limit = config.slurm.gpu_memory_gb
    if est.total > ABSURD_GB:
        lines.append(
            f"warning: the estimate {_gb(est.total)} GB per GPU is more than any accelerator holds "
            f"(> {ABSURD_GB:g} GB): check model.hidden_size, intermediate_size, num_layers and "
            "vocab_size, or raise tp/pp"
        )
    elif limit is not None and est.total > limit:
        lines.append(
            f"warning: the estimate {est.total:.1f} GB exceeds slurm.gpu_memory_gb ({limit:g} GB): "
            f"raise tp/pp, {_zero_hint(config)}or lower training.micro_batch_size"
        )
    return lines


def _zero_hint(config: Config) -> str:
    """The ZeRO stages above the config's that shard more ("" at stage 3 or with one replica)."""
    p, stage = config.parallelism, config.optimizer.zero_stage
    if stage == 3 or p.dp * p.cp * p.ep == 1:
        return ""
    higher = [str(z) for z in range(stage + 1, 4)]
    return f"use optimizer.zero_stage: {', '.join(higher[:-1]) + ' or ' if len(higher) > 1 else ''}{higher[-1]}, "
