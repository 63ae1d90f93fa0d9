"""Per-GPU memory estimate for `--dry-run`: will this layout fit before we wait in the queue?

Pure arithmetic on the config (a 512-node plan takes microseconds). The estimate is for the
busiest rank: the pipeline stage with the most layers plus the embedding (first stage) or the
LM head and its logits (last stage).
- weights: fp32 master copy (bf16 compute copies are transient under autocast);
- gradients: fp32 (accumulated in fp32 across micro-batches);
- optimizer: AdamW exp_avg + exp_avg_sq in fp32, divided by dp*cp under ZeRO-1;
- activations: Megatron's per-layer count (Korthikanti et al. 2022, "Reducing Activation
  Recomputation"), s*b*h*(10 + 24/t) bytes with TP, s*b*h*34/t with sequence parallelism,
  at 2 bytes per value, attention scores not stored (flash/SDPA), times the micro-batches a stage
  holds at once: all m for afab, pp for 1f1b (first stage), pp*(1 + (pp-1)/(pp*v)) interleaved.
  Under context parallelism s is this rank's s/cp tokens, plus the whole sequence's keys and
  values that attention gathers and saves (2*s*b*kv_dim/t values per layer).
It ignores allocator fragmentation, communication buffers and the CUDA context (~1-3 GB).
"""
from __future__ import annotations

from dataclasses import dataclass

from nanotrain.config import Config

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

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def stage_parameters(config: Config) -> tuple[float, int]:
    """Parameters held by the busiest tp rank of the busiest stage, and that stage's layer count."""
    m, p = config.model, config.parallelism
    tp, h = p.tp, m.hidden_size
    kv = m.num_key_value_heads or m.num_attention_heads
    head_dim = h // m.num_attention_heads
    per_layer = (h * (m.num_attention_heads + 2 * kv) * head_dim / tp  # fused qkv
                 + m.num_attention_heads * head_dim * h / tp  # o_proj
                 + 3 * h * m.intermediate_size / tp  # gate, up, down
                 + 2 * h)  # norms (replicated)
    embedding = -(-m.vocab_size // tp) * h  # vocab-parallel rows (padded) of one tp rank
    layers = -(-m.num_layers // p.pp)
    # The last stage holds the head: its own matrix, or (pp > 1, tied) a copy of the embedding.
    head = 0 if (m.tie_word_embeddings and p.pp == 1) else embedding
    last_stage = layers * per_layer + h + head + (embedding if p.pp == 1 else 0)
    return last_stage, layers


def micro_batches_in_flight(config: Config) -> float:
    p, m = config.parallelism, config.training.batch_accumulation_per_replica
    if p.pp == 1:
        return 1.0
    if p.pp_engine == "afab":
        return float(m)
    if p.pp_engine == "interleaved_1f1b":
        return min(float(m), p.pp * (1 + (p.pp - 1) / (p.pp * p.pp_virtual_stages)))
    return float(min(m, p.pp))


def estimate_memory(config: Config) -> MemoryEstimate:
    p, t, mdl = config.parallelism, config.training, config.model
    params, layers = stage_parameters(config)
    weights = grads = 4 * params
    optimizer = 8 * params / (p.dp * p.cp if config.optimizer.zero_stage == 1 else 1)
    s, b, h, tp = t.sequence_length // p.cp, t.micro_batch_size, mdl.hidden_size, p.tp
    per_layer_values = s * b * h * (34 / tp if p.tp_mode == "REDUCE_SCATTER" else 10 + 24 / tp)
    if p.cp > 1:
        kv_dim = (mdl.num_key_value_heads or mdl.num_attention_heads) * (h // mdl.num_attention_heads)
        per_layer_values += 2 * t.sequence_length * b * kv_dim / tp
    in_flight = micro_batches_in_flight(config)
    activation_bytes = 2 * per_layer_values * layers * in_flight
    logits = s * b * (-(-mdl.vocab_size // tp)) * 4 * 2  # fp32 logits and their gradient
    return MemoryEstimate(weights / GB, grads / GB, optimizer / GB, (activation_bytes + logits) / GB,
                          in_flight, layers)


def describe(config: Config) -> list[str]:
    """Lines for --dry-run; the last one warns when the estimate exceeds slurm.gpu_memory_gb."""
    est = estimate_memory(config)
    p = config.parallelism
    over = f"dp{p.dp} x cp{p.cp}" if p.cp > 1 else f"dp{p.dp}"
    zero = f", ZeRO-1 over {over}" if config.optimizer.zero_stage == 1 else ""
    lines = [f"memory per GPU (estimate, busiest rank): weights {_gb(est.weights)} GB + grads {_gb(est.grads)} GB"
             f" + optimizer {_gb(est.optimizer)} GB{zero} + activations {_gb(est.activations)} GB "
             f"({est.in_flight:g} micro-batch(es) in flight x {est.layers_per_stage} layers) = {_gb(est.total)} GB"]
    limit = config.slurm.gpu_memory_gb
    if est.total > ABSURD_GB:
        lines.append(f"warning: the estimate {_gb(est.total)} GB per GPU is more than any accelerator holds "
                     f"(> {ABSURD_GB:g} GB): check model.hidden_size, intermediate_size, num_layers and "
                     "vocab_size, or raise tp/pp")
    elif limit is not None and est.total > limit:
        lines.append(f"warning: the estimate {est.total:.1f} GB exceeds slurm.gpu_memory_gb ({limit:g} GB): "
                     "raise tp/pp, use optimizer.zero_stage: 1, or lower training.micro_batch_size")
    return lines
