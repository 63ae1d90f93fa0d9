"""Dropless MoE under expert parallelism equals one process on the same global batch.

ep2, ep4, ep2·tp2, ep2·pp2, dp2·ep2·pp2 (8 ranks) and cp2·tp2(REDUCE_SCATTER)·ep2 (8): the first
step's loss, logits (not under cp: a rank has its tokens' only) and every gradient (after the
data-parallel sync: dense over dp x cp x ep, experts over dp x cp divided by
dp x cp x ep), then 10 training steps (loss, grad norm with clipping, final weights), fp32,
rel 1e-5. The auxiliary losses are on (coefficients large enough to matter) and the model has a
dense first layer and a shared expert. Every data rank's micro-batches are micro-batches of the
single process (ep ranks read different samples), so the per-micro-batch load-balancing loss is
the same function of the same tokens in both. ep4 and dp2·ep2·pp2 run ZeRO-1 (dense states
sharded over dp x cp x ep, the experts' over dp x cp), the others ZeRO-0.

One launch per topology; one 1-process launch computes the reference."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from nanotrain.config import ModelArgs, MoEArgs, OptimizerArgs

from helpers.dist import run_distributed

MOE = MoEArgs(
    num_experts=4,
    top_k=2,
    expert_intermediate_size=32,
    num_shared_experts=1,
    first_dense_layers=1,
    aux_loss_coef=0.1,
    z_loss_coef=0.01,
)
MODEL = ModelArgs(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    dtype="float32",
    moe=MOE,
)
OPTIM = OptimizerArgs(lr=3e-3, weight_decay=0.1, warmup_steps=2, min_lr=3e-4, clip_grad=0.3)
STEPS, SEQ, MICRO_BATCH, GLOBAL_BATCH = 10, 16, 2, 8
# (dp, tp, pp, ep, cp, tp_mode); ZERO1: the topologies trained with optimizer.zero_stage 1
TOPOLOGIES = [
    (1, 1, 1, 2, 1, "ALL_REDUCE"),
    (1, 1, 1, 4, 1, "ALL_REDUCE"),
    (1, 2, 1, 2, 1, "ALL_REDUCE"),
    (1, 1, 2, 2, 1, "ALL_REDUCE"),
    (2, 1, 2, 2, 1, "ALL_REDUCE"),
    # context parallel and sequence-parallel tp: the router sees this rank's tokens, so the
    # load-balancing loss (a product of two means over tokens) would differ: it is off
    # here; the z-loss (a mean over tokens) stays exact and on.
    (1, 2, 1, 2, 2, "REDUCE_SCATTER"),
]
ZERO1 = {(1, 1, 1, 4, 1, "ALL_REDUCE"), (2, 1, 2, 2, 1, "ALL_REDUCE")}


def global_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2000 + step)
    start = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % MODEL.vocab_size


def _full(tensor, param, pc):
    """The unsharded tensor (a weight or its gradient) on every rank of its shard group."""
    from nanotrain.parallel.sharding import gather_full, get_shard_info

    info = get_shard_info(param)
    group = pc.ep_pg if info.axis == "ep" else pc.tp_pg
    return gather_full(tensor.detach(), info, group)


def _model(aux: bool) -> ModelArgs:
    return MODEL if aux else dataclasses.replace(MODEL, moe=dataclasses.replace(MOE, aux_loss_coef=0.0))


def train(
    dp: int, tp: int, pp: int, ep: int, cp: int = 1, mode: str = "ALL_REDUCE", aux: bool = True, zero: int = 0
) -> dict:
    import torch.distributed as dist

    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer, optimizer_groups
    from nanotrain.parallel.data_parallel import ZeroOneOptimizer, build_grad_sync
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.parallel.pipeline_parallel import PipelineEngine
    from nanotrain.parallel.tensor_parallel import allreduce_sequence_parallel_grads_
    from nanotrain.training.step import forward_backward, train_step

    pc = ParallelContext(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        expert_parallel_size=ep,
        context_parallel_size=cp,
    )
    per_rank = GLOBAL_BATCH // (dp * ep)
    model = build_llama(
        _model(aux), pc.tp_pg, mode=mode, pp_rank=pc.pp_rank, pp_size=pp, seed=11, ep_pg=pc.ep_pg, cp_pg=pc.cp_pg
    )
    grad_sync = build_grad_sync(list(model.parameters()), pc, bucket_cap_mb=0.01)
    optimizer = build_optimizer(model.named_parameters(), OPTIM, zero_stage=zero, **optimizer_groups(pc))
    if zero == 1 and ep > 1:  # two domains: dense states over dp x cp x ep, experts' over dp x cp
        assert isinstance(optimizer, ZeroOneOptimizer)
        assert [d.size for d in optimizer.domains] == [dp * cp * ep, dp * cp]
    scheduler = build_lr_scheduler(optimizer, OPTIM, STEPS)
    engine = PipelineEngine("afab", pc.pp_pg) if pp > 1 else None

    def mine(step):
        rows = global_batch(step)[pc.data_rank * per_rank : (pc.data_rank + 1) * per_rank]
        return [(mb[:, :-1], mb[:, 1:]) for mb in rows.split(MICRO_BATCH)]

    # step 0's gradients, synced, without an optimizer step
    micro = mine(0)
    model.begin_step(len(micro))
    if engine is not None:
        engine.forward_backward(model, micro, grad_sync, model.pipeline_message(MICRO_BATCH, SEQ))
    else:
        forward_backward(model, micro, grad_sync)
    grad_sync.finish_grad_sync()
    allreduce_sequence_parallel_grads_(model.sequence_parallel_params(), pc.tp_pg)
    grads = {n: _full(p.grad, p, pc) for n, p in model.named_parameters()}
    grad_sync.zero_grad()
    # logits of the first micro-batch on the last stage (vocab shards gathered over tp)
    logits = None
    with torch.no_grad():
        if cp > 1:
            pass  # a rank's logits are those of its tokens: loss, gradients and weights are compared
        elif pp == 1:
            logits = model(micro[0][0])
        else:  # run the stages by hand: first stage sends its hidden state
            if pc.is_pipeline_first_stage:
                hidden = model(micro[0][0])
                dist.send(hidden.contiguous(), pc.pp_next_rank)
            else:
                hidden = torch.empty(SEQ, MICRO_BATCH, MODEL.hidden_size)
                dist.recv(hidden, pc.pp_prev_rank)
                logits = model(hidden=hidden)
        if logits is not None and tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=pc.tp_pg)
            logits = torch.cat(parts, dim=-1)[..., : MODEL.vocab_size]
    stats = [
        train_step(model, mine(step), grad_sync, optimizer, scheduler, pc, OPTIM.clip_grad, engine)
        for step in range(STEPS)
    ]
    weights = {n: _full(p, p, pc) for n, p in model.named_parameters()}
    out = {
        "loss": [s.loss for s in stats],
        "grad_norm": [s.grad_norm for s in stats],
        "grads": grads,
        "weights": weights,
        "logits": logits,
    }
    keep = pc.dp_rank == 0 and pc.tp_rank == 0 and pc.ep_rank == 0 and pc.cp_rank == 0
    pc.destroy()
    return out if keep else {}


@functools.lru_cache(maxsize=None)
def reference(aux: bool) -> dict:
    return run_distributed(train, 1, 1, 1, 1, 1, 1, "ALL_REDUCE", aux, timeout=300)[0]


@functools.lru_cache(maxsize=None)
def parallel(topology, aux: bool) -> list[dict]:
    dp, tp, pp, ep, cp, _ = topology
    return run_distributed(train, dp * tp * pp * ep * cp, *topology, aux, int(topology in ZERO1), timeout=400)


def _merged(per_rank: list[dict], key: str) -> dict:
    merged = {}
    for r in per_rank:
        for name, t in r.get(key, {}).items():
            merged.setdefault(name, t)
    return merged


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "topology",
    TOPOLOGIES,
    ids=[
        f"dp{a}-tp{b}-pp{c}-ep{d}-cp{e}-{m[0]}" + ("-zero1" if (a, b, c, d, e, m) in ZERO1 else "")
        for a, b, c, d, e, m in TOPOLOGIES
    ],
)
def test_expert_parallel_equals_single_process(topology):
    aux = topology[-1] == "ALL_REDUCE" and topology[4] == 1
    ref = reference(aux)
    assert ref["loss"][-1] < ref["loss"][0]
    assert any(n > OPTIM.clip_grad for n in ref["grad_norm"]), "clipping never triggered"
    per_rank = [r for r in parallel(topology, aux) if r]
    got = per_rank[-1]  # the last stage's keeper holds the loss like every rank
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(ref["grad_norm"]), rtol=1e-5, atol=0)
    if topology[4] == 1:
        logits = next(r["logits"] for r in per_rank if r["logits"] is not None)
        torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-6)
    grads, weights = _merged(per_rank, "grads"), _merged(per_rank, "weights")
    assert grads.keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{topology} {name}: {m}")
    for name, w in ref["weights"].items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=1e-5, msg=lambda m: f"{topology} {name}: {m}")
