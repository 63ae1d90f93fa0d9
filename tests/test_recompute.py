"""``training.recompute``: selective and full recomputation change what autograd keeps, never the
numbers. At one topology the losses, the gradients every optimizer step sees and the final
weights are bit-identical (``==``, CPU fp32 and bf16 autocast) to ``none``, under tp (both modes,
async communication), every pipeline engine (interleaved included), cp2 with sequence-parallel tp
and ZeRO-1, and an MoE model under ep2 x pp2 (its expert all-to-alls rerun in backward; the
routing statistics are recorded once per forward, as without recomputation); and ``full`` keeps
only each layer's input (autograd's saved tensors, counted).
Checkpoints are unaffected: a run preempted under ``none`` resumes under ``full`` bit-exactly."""

from __future__ import annotations

import subprocess

import pytest
import torch

from nanotrain.config import ModelArgs, OptimizerArgs

from helpers.dist import run_distributed
from helpers.runs import STEPS, cli, final_weights, tb_losses

MODES = ("none", "selective", "full")
MODEL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
OPTIM = OptimizerArgs(lr=3e-3, weight_decay=0.1, warmup_steps=1, min_lr=3e-4, clip_grad=0.5)
STEPS_HERE, SEQ, MICRO_BATCH, GLOBAL_BATCH = 2, 16, 1, 4


def global_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(77 + step)
    return torch.randint(0, MODEL["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=gen)


def train(grid: dict, cases: list[dict]) -> list:
    """Each case once per recompute mode on this rank; returns, per case and mode, the losses,
    the gradients each optimizer step saw (after clipping) and the final weights of this rank."""
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(
        tensor_parallel_size=grid.get("tp", 1),
        pipeline_parallel_size=grid.get("pp", 1),
        data_parallel_size=grid.get("dp", 1),
        context_parallel_size=grid.get("cp", 1),
        expert_parallel_size=grid.get("ep", 1),
    )
    results = [{mode: train_one(pc, case, mode) for mode in MODES} for case in cases]
    pc.destroy()  # train_one's model, sync and optimizer are gone: nothing holds the groups
    return results


def train_one(pc, case: dict, mode: str) -> dict:
    from nanotrain.config import MoEArgs
    from nanotrain.logging.moe_stats import step_scalars
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer, optimizer_groups
    from nanotrain.parallel.data_parallel import build_grad_sync
    from nanotrain.parallel.pipeline_parallel import PipelineEngine
    from nanotrain.training.step import train_step

    dtype = case.get("dtype", "float32")
    moe = MoEArgs(**case["moe"]) if "moe" in case else None
    model = build_llama(
        ModelArgs(**MODEL, tie_word_embeddings=case.get("tied", False), dtype=dtype, moe=moe),
        pc.tp_pg,
        mode=case.get("tp_mode", "ALL_REDUCE"),
        async_communication=case.get("async", False),
        pp_rank=pc.pp_rank,
        pp_size=pc.pp_size,
        virtual_stages=case.get("v", 1),
        seed=3,
        compute_dtype=dtype,
        cp_pg=pc.cp_pg,
        ep_pg=pc.ep_pg,
        recompute=mode,
    )
    grad_sync = build_grad_sync(list(model.parameters()), pc, bucket_cap_mb=0.01)
    optimizer = build_optimizer(model.named_parameters(), OPTIM, zero_stage=case.get("zero", 0), **optimizer_groups(pc))
    scheduler = build_lr_scheduler(optimizer, OPTIM, STEPS_HERE)
    seen, named = [], list(model.named_parameters())
    optimizer.register_step_pre_hook(
        lambda *_: seen.append({n: p.grad.clone() for n, p in named if p.grad is not None})
    )
    engine = PipelineEngine(case["engine"], pc.pp_pg) if pc.pp_size > 1 else None
    per_replica = GLOBAL_BATCH // pc.data_size
    losses, routing = [], []
    for step in range(STEPS_HERE):
        mine = global_batch(step)[pc.data_rank * per_replica : (pc.data_rank + 1) * per_replica]
        micro = [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO_BATCH)]
        losses.append(train_step(model, micro, grad_sync, optimizer, scheduler, pc, OPTIM.clip_grad, engine).loss)
        if moe is not None:  # one record per (micro-batch, MoE layer) forward of this stage
            routing.append((len(model.moe_state.stats), step_scalars(model.moe_state, pc.pp_pg)))
    return {"loss": losses, "grads": seen, "weights": {n: p.detach().clone() for n, p in named}, "routing": routing}


def assert_identical(runs: dict) -> None:
    ref = runs["none"]
    assert ref["grads"] and any(bool(g.any()) for g in ref["grads"][0].values())
    for mode in ("selective", "full"):
        got = runs[mode]
        assert got["loss"] == ref["loss"], mode
        assert len(got["grads"]) == len(ref["grads"]) == STEPS_HERE
        for a, b in zip(got["grads"], ref["grads"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), mode
        assert all(torch.equal(got["weights"][k], v) for k, v in ref["weights"].items()), mode
        assert got["routing"] == ref["routing"], mode


@pytest.mark.timeout(240)
def test_tp_pp_engines_bit_identical():
    """tp2 x pp2 (4 ranks): interleaved 1f1b under async sequence parallelism, 1f1b under async
    all-reduce tp with tied embeddings in bf16 autocast (recomputation replays autocast), afab."""
    cases = [
        {"engine": "interleaved_1f1b", "v": 2, "tp_mode": "REDUCE_SCATTER", "async": True},
        {"engine": "1f1b", "tp_mode": "ALL_REDUCE", "async": True, "tied": True, "dtype": "bfloat16"},
        {"engine": "afab", "tp_mode": "REDUCE_SCATTER"},
    ]
    for rank in run_distributed(train, 4, {"tp": 2, "pp": 2}, cases, timeout=220):
        for runs in rank:
            assert_identical(runs)


@pytest.mark.timeout(240)
def test_cp2_sequence_parallel_zero1_bit_identical():
    """cp2 x tp2 (4 ranks), REDUCE_SCATTER with async communication, ZeRO-1 over dp x cp."""
    cases = [{"tp_mode": "REDUCE_SCATTER", "async": True, "zero": 1}]
    for rank in run_distributed(train, 4, {"cp": 2, "tp": 2}, cases, timeout=220):
        for runs in rank:
            assert_identical(runs)


@pytest.mark.timeout(240)
def test_moe_ep2_pp2_zero1_bit_identical():
    """ep2 x pp2 (4 ranks), 1f1b, an MoE model with a dense first layer, a shared expert and both
    auxiliary losses, ZeRO-1 over the dense and expert groups."""
    moe = {
        "num_experts": 4,
        "top_k": 2,
        "expert_intermediate_size": 32,
        "num_shared_experts": 1,
        "first_dense_layers": 1,
        "aux_loss_coef": 0.1,
        "z_loss_coef": 0.01,
    }
    cases = [{"engine": "1f1b", "moe": moe, "zero": 1}]
    for rank in run_distributed(train, 4, {"ep": 2, "pp": 2}, cases, timeout=220):
        for runs in rank:
            assert_identical(runs)
            counts = [n for n, _ in runs["none"]["routing"]]
            assert counts and all(n == counts[0] > 0 for n in counts), counts  # each stage has MoE layers


def saved_storages(mode: str) -> tuple[int, list[int]]:
    """(bytes autograd holds after one forward of a 4-layer model, the element counts of what it
    keeps) — unique storages of the saved tensors, parameters left out."""
    from nanotrain.models.llama_parallelize import build_llama

    model = build_llama(ModelArgs(**MODEL), None, seed=3, recompute=mode)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = global_batch(0)[:, :SEQ].clone()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, ids)
    loss.backward()
    return sum(seen.values()), sorted(seen.values())


def test_full_keeps_one_input_per_layer_selective_keeps_less():
    none, _ = saved_storages("none")
    selective, _ = saved_storages("selective")
    full, sizes = saved_storages("full")
    layer_input = GLOBAL_BATCH * SEQ * MODEL["hidden_size"] * 4
    # full: the 4 layer inputs; the final norm keeps its input, x * rsqrt and its output (the
    # head matmul input); the rest is the logits, ids, targets, RoPE tables (shared by all layers)
    assert sizes.count(layer_input) == MODEL["num_layers"] + 3
    assert full < selective < none


@pytest.mark.timeout(900)
def test_checkpoint_from_none_resumes_under_full_bit_exactly(tmp_path, shared_runs):
    straight = shared_runs.straight("2-2-2")
    run_dir, stopped = shared_runs.preempted_copy("2-2-2", tmp_path / "interrupted")
    resumed = subprocess.run(
        cli("--resume", str(run_dir), "--local", "--set", "training.recompute=full"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"at step {stopped}" in resumed.stdout
    expected, got = tb_losses(straight), tb_losses(run_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert got == expected
    a, b = final_weights(straight), final_weights(run_dir)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
