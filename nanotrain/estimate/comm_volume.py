"""Bytes one rank sends per optimizer step on each parallel axis: the communication part of
``--plan``'s cost model (``plan.step_time`` turns them into seconds) and what ``--rehearse``
measures on a rank, so the two are compared (``tests/test_estimate_rehearsed.py``). Pure
arithmetic on the config and the model's own stage split (``llama_arch.rank_summaries``).
"""

from __future__ import annotations

from nanotrain.config import Config
from nanotrain.models import llama_arch, llama_parallelize_costs


def tp_collectives_per_layer(recompute: str) -> int:
    """tp collectives of one layer and micro-batch: 2 row-parallel in forward, 2 column-parallel
    in backward; full recompute runs the forward's again in backward, all but the layer's last
    (torch's non-reentrant checkpoint stops once the saved tensors are rebuilt)."""
    return 5 if recompute == "full" else 4


def cp_collectives_per_layer(recompute: str) -> int:
    """cp collectives of one layer and micro-batch: the k/v all-gather (again under full
    recompute) and their gradients' reduce-scatter."""
    return 3 if recompute == "full" else 2


def traffic_bytes(config: Config, pp_rank: int | None = None) -> dict[str, float]:
    """Bytes one rank of pipeline rank ``pp_rank`` sends per optimizer step on each axis, under
    ring algorithms (default: the most of any pp rank, axis by axis).

    tp: per layer and micro-batch ``tp_collectives_per_layer`` collectives of the b x s/cp x h
    activation in the compute dtype (an all-reduce, or an all-gather and a reduce-scatter pair:
    the same bytes), plus the embedding's (first stage) and the LM head's (last stage; under
    sequence parallelism the chunked loss all-gathers each chunk's rows once more, half an
    all-reduce's bytes);
    cp: the k/v all-gathers and their gradients' reduce-scatter;
    pp: each micro-batch's activation forward and its gradient backward (the whole activation:
    tp ranks hold it replicated, a 1/tp shard with sequence parallelism); dp: the fp32 gradients
    of this rank's parameters over their replicas (dp x cp; experts over dp x cp, the dense
    rest over dp x cp x ep), 2 (d - 1)/d of them (ZeRO-1's reduce-scatter + all-gather too);
    ZeRO-2 reduce-scatters every micro-batch: (m + 1)(d - 1)/d of them (m reduce-scatters and
    the parameters' all-gather); ZeRO-3 3m (d - 1)/d (``dp_share``)."""
    p = config.parallelism
    ranks = llama_arch.rank_summaries(config.model, p.pp, p.pp_virtual_stages)
    if pp_rank is not None:
        return _rank_traffic(config, pp_rank, ranks[pp_rank])
    every = [
        _rank_traffic(config, r, ranks[r]) for r in llama_arch.distinct_ranks(config.model, p.pp, p.pp_virtual_stages)
    ]
    return {axis: max(e[axis] for e in every) for axis in every[0]}


def _rank_traffic(config: Config, pp_rank: int, rank: llama_arch.RankSummary) -> dict[str, float]:
    m, p, t = config.model, config.parallelism, config.training
    names = rank.others
    acc = t.batch_accumulation_per_replica
    local = t.micro_batch_size * (t.sequence_length // p.cp)  # tokens of one micro-batch on one rank
    layer_ids = rank.layers
    c = llama_parallelize_costs.compute_bytes(m)  # the wire's dtype: bf16 under autocast, else fp32
    activation = local * m.hidden_size * c  # one micro-batch on one rank
    ring = lambda group: 2 * (group - 1) / group  # noqa: E731 - of the bytes, per rank
    tp_ops = tp_collectives_per_layer(t.recompute) * len(layer_ids)
    tp_ops += ("embed" in names and pp_rank == 0) + ("final_norm" in names)  # embedding fwd, head's input grad
    if "final_norm" in names and p.tp_mode == "REDUCE_SCATTER" and llama_parallelize_costs.head_chunk_rows(config):
        tp_ops += 0.5  # the chunked loss gathers each chunk's rows again when it recomputes them
    kv = 2 * local * llama_arch.kv_heads(m) * llama_arch.head_dim(m) * c / p.tp
    v = p.pp_virtual_stages
    chunks = [s for s in range(pp_rank, p.pp * v, p.pp)]  # this rank's virtual stages
    sends = sum((s < p.pp * v - 1) + (s > 0) for s in chunks) * acc if p.pp > 1 else 0
    message = activation / (p.tp if p.tp_mode == "REDUCE_SCATTER" else 1)
    total, experts = llama_arch.rank_parameters(m, rank, p.tp, p.ep)
    dense = total - experts
    return {
        "tp": tp_ops * acc * ring(p.tp) * activation,
        "cp": cp_collectives_per_layer(t.recompute) * (p.cp - 1) * kv * len(layer_ids) * acc,
        "pp": sends * message,
        "dp": 4 * (dp_share(config, p.dp * p.cp * p.ep) * dense + dp_share(config, p.dp * p.cp) * experts)
        - 4
        * acc
        * gather_share(config, p.dp * p.cp * p.ep)
        * zero3_gathered_once(config, names)
        * _gather_weight(config),
    }


def _block(config: Config, group: int) -> int:
    """The ranks ZeRO shards over within ``group``: all, or a hybrid block (``zero_shard_size``)."""
    s = config.optimizer.zero_shard_size
    return s if s and config.optimizer.zero_stage >= 1 and group % s == 0 else group


def gather_share(config: Config, group: int) -> float:
    """One ZeRO collective's share of the bytes, (d - 1)/d over the ranks it runs on."""
    d = _block(config, group)
    return (d - 1) / d


def dp_share(config: Config, group: int) -> float:
    """Bytes a rank sends per step over a data-parallel group of ``group`` ranks, per byte of its
    fp32 gradients (= its fp32 parameters): ``dp_rounds`` collectives of (d - 1)/d of them each;
    under hybrid sharding d is a block's size, plus one all-reduce of the 1/d owned across the
    g/d blocks (``data_parallel/hybrid.py``)."""
    d = _block(config, group)
    outer = group // d
    o, m = config.optimizer, config.training.batch_accumulation_per_replica
    reduces = 2 if o.zero_stage == 0 else 1 if o.zero_stage == 1 else m  # of dp_rounds' collectives
    gathers = 2 * m if o.zero_stage == 3 else 0  # stage 3's per-unit gathers
    rounds = dp_rounds(config) - reduces - gathers  # the rest: ZeRO-1/2's parameter all-gather (fp32)
    rounds += reduces * (0.5 if o.grad_reduce_dtype == "bfloat16" else 1.0) + gathers * _gather_weight(config)
    return rounds * (d - 1) / d + (2 * (outer - 1) / outer / d if outer > 1 else 0.0)


def _gather_weight(config: Config) -> float:
    """ZeRO-3's training gathers send the compute dtype (bf16 under autocast): its bytes per 4."""
    return llama_parallelize_costs.compute_bytes(config.model) / 4


def zero3_gathered_once(config: Config, names: tuple[str, ...]) -> int:
    """Parameters of this rank that ZeRO-3 gathers once per micro-batch, not twice: the
    embedding (its backward reads no weights) and the head (kept from its forward into its
    backward), ``shard_params.ParamGather.after_forward``; with tied embeddings on one stage the
    head's forward gathers the embedding again, so it saves nothing there. 0 below stage 3."""
    m = config.model
    if config.optimizer.zero_stage != 3:
        return 0
    tied_here = m.tie_word_embeddings and "embed" in names and "final_norm" in names
    heads = ("final_norm", "lm_head") + (() if tied_here else ("embed",))
    return sum(llama_arch.block_parameters(m, n, config.parallelism.tp) for n in names if n in heads)


def dp_rounds(config: Config) -> int:
    """The data-parallel collectives of one step, each moving (d - 1)/d of the rank's parameter
    bytes (an all-reduce counts two: reduce-scatter + all-gather): ZeRO-0's all-reduce and
    ZeRO-1's reduce-scatter + all-gather, 2; ZeRO-2's reduce-scatter per micro-batch and the
    updated parameters' all-gather, m + 1; ZeRO-3's all-gather of every unit in each micro-batch's
    forward and again in its backward (no gathered weights are kept across micro-batches) and
    its reduce-scatter per micro-batch, 3m, and nothing after the update (each rank keeps only
    the piece it updated)."""
    m, stage = config.training.batch_accumulation_per_replica, config.optimizer.zero_stage
    return {2: m + 1, 3: 3 * m}.get(stage, 2)
