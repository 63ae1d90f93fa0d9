"""Document masking (``data.document_masking``, issue 30) under every parallel mode equals one
process: the first step's loss and every gradient of packed windows with per-document masks and
positions (boundary loss masked: -100 targets through the vocab-parallel loss too), in fp32.

Layouts, in two launches (each runs its layouts in turn on one process group):

* 2 ranks: tp2 (all-reduce), tp2 with sequence parallelism, cp2 (zig-zag queries over gathered
  keys) under selective recompute, cp2 under the balanced order (``parallelism.cp_balance:
  documents``: each micro-batch brings its token order from ``cp_balance.balanced_order``, single
  tokens dealt to the ranks, so every query and key is out of zig-zag's place) under selective
  recompute, pp2 interleaved (four virtual stages: the middle ones are
  handed the document ids too) under full recompute, ep2 (MoE);
* 8 ranks: dp2 x cp2 x tp2 (sequence parallel), tp2 x pp2 (1F1B) beside dp2 x ep2 (MoE), the
  batch split over the data ranks as a run splits it.

The model has GQA, a head width of its own, a qkv bias, q/k norms and a layer without RoPE, and
sharp attention (init_std 0.3), so a mask or a position wrong anywhere moves the step far beyond
the tolerance (checked: without the mask the loss moves by ~4%, 4e4 times the tolerance, and
some gradient by more than its own size).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nanotrain.config import ModelArgs, MoEArgs
from nanotrain.data.sampler import document_ids
from nanotrain.models.llama import param_seed
from nanotrain.models.llama_parallelize import build_llama
from nanotrain.parallel.context_parallel import zigzag_table
from nanotrain.parallel.cp_balance import balanced_order
from nanotrain.parallel.sharding import copy_from_full_, gather_full, get_shard_info

from helpers.dist import run_distributed

DENSE = ModelArgs(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    qkv_bias=True,
    qk_norm=True,
    no_rope_layers=[1],
    max_position_embeddings=32,
    dtype="float32",
    init_std=0.3,
)
MOE = dataclasses.replace(
    DENSE,
    num_layers=2,
    qkv_bias=False,
    no_rope_layers=[],
    moe=MoEArgs(num_experts=4, top_k=2, expert_intermediate_size=24, aux_loss_coef=0.0, z_loss_coef=0.01),
)
MODELS = {"dense": DENSE, "moe": MOE}
TWO = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, mode="REDUCE_SCATTER"),
    "cp2-selective": dict(cp=2, recompute="selective"),
    "cp2-balanced-selective": dict(cp=2, cp_balance="documents", recompute="selective"),
    "pp2-interleaved-full": dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, recompute="full"),
}
EIGHT = {
    "dp2-cp2-tp2-sp": dict(dp=2, cp=2, tp=2, mode="REDUCE_SCATTER"),
    "dp2-tp2-pp2": dict(dp=2, tp=2, pp=2, schedule="1f1b"),
}
RUNS_TWO = [("dense", lay) for lay in TWO] + [("moe", "ep2")]
RUNS_EIGHT = [("dense", lay) for lay in EIGHT] + [("moe", "dp2-tp2-ep2")]
LAYOUTS = {**TWO, **EIGHT, "ep2": dict(ep=2), "dp2-tp2-ep2": dict(dp=2, tp=2, ep=2)}
SEED, SEQ, MICRO, BATCH, SEP = 5, 16, 2, 8, 0


def set_options_(model) -> None:
    """Biases and q/k norm weights away from 0 and 1, the same full tensors on every topology."""
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(param_seed(SEED, name))
        shape = get_shard_info(p).global_shape
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            copy_from_full_(p, 0.5 + torch.rand(shape, generator=gen))
        elif name.endswith(".bias"):
            copy_from_full_(p, 0.5 * torch.randn(shape, generator=gen))


def microbatches(data_rank: int, data_size: int, masked: bool = True) -> list[tuple[torch.Tensor, ...]]:
    """This data rank's share of the fixed packed batch, as the sampler cuts it: (ids, targets
    with the separators' set to -100, document ids) micro-batches; ``masked`` False: (ids, targets)."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(1, DENSE.vocab_size, (BATCH, SEQ + 1), generator=gen)
    rows[torch.rand(rows.shape, generator=gen) < 0.2] = SEP  # documents of 1 to ~SEQ tokens
    rows[::2, 0] = SEP  # length-1 documents at the window's start
    rows[1::3, SEQ - 1] = SEP  # and separators ending windows
    ids, targets = rows[:, :-1], rows[:, 1:].masked_fill(rows[:, :-1] == SEP, -100)
    docs = document_ids(ids, SEP)
    per = BATCH // data_size
    mine = slice(data_rank * per, (data_rank + 1) * per)
    parts = (ids[mine], targets[mine], docs[mine]) if masked else (ids[mine], targets[mine])
    return list(zip(*(t.split(MICRO) for t in parts)))


def with_orders(micro: list, cp: int) -> list:
    """Each micro-batch with its balanced token order (``[cp, S/cp]``, 2*cp*4 one-token chunks),
    as the sampler hands it out under ``parallelism.cp_balance: documents``."""
    orders = [torch.as_tensor(balanced_order(mb[2], cp, k=SEQ // (2 * cp))) for mb in micro]
    assert any((o != zigzag_table(SEQ, cp)).any() for o in orders), "the batch must leave zig-zag"
    return [(*mb, o) for mb, o in zip(micro, orders)]


def first_step(model_name: str, layout: dict) -> dict:
    """The first step's loss (averaged like a run's) and every held parameter's full gradient
    after the product's sums (dp/cp/ep sync, tp partial sums), on this rank of ``layout``."""
    from nanotrain.parallel.data_parallel import build_grad_sync
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.parallel.pipeline_parallel import PipelineEngine
    from nanotrain.parallel.tensor_parallel import allreduce_sequence_parallel_grads_
    from nanotrain.training.step import forward_backward, reduce_loss

    tp, pp, cp, ep, dp = (layout.get(k, 1) for k in ("tp", "pp", "cp", "ep", "dp"))
    pc = ParallelContext(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        context_parallel_size=cp,
        expert_parallel_size=ep,
        data_parallel_size=dp,
    )
    model = build_llama(
        MODELS[model_name],
        pc.tp_pg,
        mode=layout.get("mode", "ALL_REDUCE"),
        pp_rank=pc.pp_rank,
        pp_size=pp,
        virtual_stages=layout.get("virtual_stages", 1),
        seed=SEED,
        cp_pg=pc.cp_pg,
        cp_balance=layout.get("cp_balance", "zigzag"),
        ep_pg=pc.ep_pg,
        recompute=layout.get("recompute", "none"),
    )
    set_options_(model)
    sync = build_grad_sync(list(model.parameters()), pc)
    micro = microbatches(pc.data_rank, pc.data_size)  # every pp stage: the middle ones need the ids
    if layout.get("cp_balance") == "documents":
        micro = with_orders(micro, cp)
    model.begin_step(len(micro))
    if pp > 1:
        engine = PipelineEngine(layout["schedule"], pc.pp_pg)
        loss = engine.forward_backward(model, micro, sync, model.pipeline_message(MICRO, SEQ))
        del engine
    else:
        loss = forward_backward(model, micro, sync)
    sync.finish_grad_sync()
    allreduce_sequence_parallel_grads_(model.sequence_parallel_params(), pc.tp_pg)
    out = {
        "loss": float(reduce_loss(loss, pc)),
        "grads": {
            n: gather_full(p.grad, get_shard_info(p), pc.ep_pg if get_shard_info(p).axis == "ep" else pc.tp_pg)
            for n, p in model.named_parameters()
        },
    }
    del model, sync, loss
    pc.destroy()
    return out


def parallel_first_steps(runs: list[tuple[str, str]]) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return {run: first_step(run[0], LAYOUTS[run[1]]) for run in runs}


def one_process(model_name: str, masked: bool = True) -> tuple[dict, float]:
    """(full gradients, loss) of the first step in one process, on the whole batch."""
    from nanotrain.training.step import micro_loss

    model = build_llama(MODELS[model_name], None, seed=SEED)
    set_options_(model)
    micro = microbatches(0, 1, masked)
    model.begin_step(len(micro))
    loss = 0.0
    for mb in micro:
        part = micro_loss(model, mb) / len(micro)
        part.backward()
        loss += part.item()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, loss


def mismatches(run, ranks: list[dict], grads: dict, loss: float) -> list[str]:
    """What differs from the one-process step, at the tolerances of test_model_options."""
    failures, held = [], set()
    for rank, results in enumerate(ranks):
        got = results[run]
        if abs(got["loss"] - loss) > 1e-6 * abs(loss):
            failures.append(f"{run} rank {rank}: loss {got['loss']} != {loss}")
        for name, g in got["grads"].items():
            held.add(name)
            err = (g - grads[name]).abs().max().item()
            if err > 1e-7 + 1e-5 * grads[name].abs().max().item():
                failures.append(f"{run} rank {rank} {name}: max abs err {err:.2e}")
    if held != set(grads):
        failures.append(f"{run}: parameters held {sorted(held ^ set(grads))}")
    return failures


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: one_process(name) for name in MODELS}


@pytest.mark.timeout(200)
def test_two_rank_layouts_equal_one_process(references):
    ranks = run_distributed(parallel_first_steps, 2, RUNS_TWO, timeout=150)
    failures = [f for run in RUNS_TWO for f in mismatches(run, ranks, *references[run[0]])]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(300)
def test_eight_rank_layouts_equal_one_process(references):
    ranks = run_distributed(parallel_first_steps, 8, RUNS_EIGHT, timeout=240)
    failures = [f for run in RUNS_EIGHT for f in mismatches(run, ranks, *references[run[0]])]
    assert not failures, "\n".join(failures)


def test_the_tolerance_sees_the_mask(references):
    """The unmasked step (same ids and targets, no document ids) is far outside the tolerance."""
    grads, loss = references["dense"]
    plain_grads, plain_loss = one_process("dense", masked=False)
    assert abs(plain_loss - loss) > 1e-4 * abs(loss)
    worst = max((plain_grads[n] - grads[n]).abs().max().item() / grads[n].abs().max().item() for n in grads)
    assert worst > 1e-2
