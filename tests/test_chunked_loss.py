"""``training.loss_chunk_tokens``: the head (final norm, LM head, cross-entropy) a chunk of tokens
at a time equals the head in one piece, and holds a chunk's logits instead of all of them.

* Equal: the loss and every gradient, chunked against one piece at the same layout, each gradient
  within ``TOL`` of its largest entry (fp32 1e-6, fp64 1e-12), targets with the ignore index:
  one process (tied and untied, the three recompute modes, an MoE model whose auxiliary losses
  take their own path), evaluation under ``no_grad``, and one 4-rank launch of tp2 x cp2 (both tp
  modes, async communication) and tp2 x pp2 (1f1b, tied embeddings: the last stage's replica).
  Chunks that do not divide the rows (7) and chunks of one row per tp rank are among them. In
  bf16 autocast the LM head weight's gradient is as far from fp32's as the one-piece head's is
  (the chunks' gradients are summed in fp32).
* Smaller: at a 32k vocabulary (hidden 32, 2 x 1024 tokens) the peak bytes the head allocates in
  forward and backward, measured on CPU (``benchmarks/memory.py``'s ``head_peak``), fall by the
  chunk count, beyond the bytes that do not scale with the chunk (the fp32 sum of the LM head
  weight's gradients, a chunk's weight copy under autocast, two hidden states); and
  ``head_saved_bytes + head_backward_bytes`` (what ``--dry-run`` adds for the head) is within 2%
  of each measurement.
* Configured: null resolves to 2048 tokens from a 32000-token vocabulary where the estimate says
  chunks lower the head's peak, else off; the layout's plan carries it; ``--dry-run`` names it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nanotrain.config import ModelArgs, MoEArgs, load_config
from nanotrain.estimate.memory import describe, estimate_memory
from nanotrain.models import llama_parallelize_costs as costs
from nanotrain.models.llama_parallelize import build_llama, plan_from_config

from helpers.dist import run_distributed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from memory import LOSS_BATCH, LOSS_MODEL, LOSS_SEQ, head_peak  # noqa: E402

MODEL = dict(
    vocab_size=301,  # odd: tp2 pads the LM head
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
SEQ, BATCH = 32, 2
TOL = {"float32": 1e-6, "float64": 1e-12}


def batch(seed: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and targets ``[rows, SEQ]``; some targets are the ignore index."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL["vocab_size"], (rows, SEQ), generator=gen)
    targets = torch.randint(0, MODEL["vocab_size"], (rows, SEQ), generator=gen)
    targets[torch.rand(rows, SEQ, generator=gen) < 0.2] = -100
    return ids, targets


def build(dtype: str, chunk: int, tied: bool = False, moe: MoEArgs | None = None, tp_pg=None, **plan):
    args = ModelArgs(**MODEL, tie_word_embeddings=tied, moe=moe, dtype="float32" if dtype == "float64" else dtype)
    part = build_llama(args, tp_pg, seed=5, loss_chunk_tokens=chunk, compute_dtype=args.dtype, **plan)
    return part.double() if dtype == "float64" else part


def loss_and_grads(part, ids, targets) -> tuple[torch.Tensor, dict]:
    part.begin_step(1)
    loss = part(ids, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in part.named_parameters() if p.grad is not None}


def worst(got: dict, ref: dict) -> float:
    """The largest difference of any gradient, relative to that gradient's largest entry."""
    assert got.keys() == ref.keys() and ref
    assert all(bool(g.any()) for g in ref.values())
    return max(((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs() / b.abs()).item()


# ----------------------------------------------------------------------------- one process
@pytest.mark.parametrize(
    "dtype, tied, recompute, moe",
    [
        ("float32", False, "none", False),
        ("float32", True, "full", False),
        ("float64", True, "selective", False),
        ("float64", False, "none", True),
        ("float32", False, "full", True),
    ],
)
def test_one_process_equals_the_head_in_one_piece(dtype, tied, recompute, moe):
    moe_args = MoEArgs(num_experts=4, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01) if moe else None
    ids, targets = batch(1)
    ref_loss, ref = loss_and_grads(build(dtype, 0, tied, moe_args, recompute=recompute), ids, targets)
    for chunk in (7, 16):  # 7: chunks of 7 rows and a last one of 1; 16: four equal chunks
        part = build(dtype, chunk, tied, moe_args, recompute=recompute)
        loss, grads = loss_and_grads(part, ids, targets)
        assert relative(loss, ref_loss) <= TOL[dtype], (chunk, loss, ref_loss)
        assert worst(grads, ref) <= TOL[dtype], chunk
        with torch.no_grad():
            assert relative(part(ids, targets), ref_loss) <= TOL[dtype]


def test_bf16_weight_gradient_as_close_to_fp32_as_in_one_piece():
    ids, targets = batch(2)
    _, fp32 = loss_and_grads(build("float32", 0), ids, targets)
    errors = {}
    for chunk in (0, 16):
        loss, grads = loss_and_grads(build("bfloat16", chunk), ids, targets)
        errors[chunk] = (
            (grads["lm_head.weight"] - fp32["lm_head.weight"]).norm() / fp32["lm_head.weight"].norm()
        ).item()
    assert errors[16] <= 1.1 * errors[0], errors


# ----------------------------------------------------------------------------- 4 ranks
def parallel_worst() -> list[tuple[str, str, float, float]]:
    """(case, dtype, loss error, worst gradient error) of this rank for every case: tp2 x cp2,
    then tp2 x pp2 (1f1b over two micro-batches)."""
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.parallel.pipeline_parallel import PipelineEngine

    out = []
    pc = ParallelContext(tensor_parallel_size=2, context_parallel_size=2)
    ids, targets = batch(3)
    for mode, overlap, tied, dtype, chunk in [
        ("ALL_REDUCE", False, False, "float32", 7),
        ("REDUCE_SCATTER", False, True, "float32", 8),  # 4 rows of each tp rank a chunk
        ("REDUCE_SCATTER", True, False, "float64", 2),  # one row of each tp rank
        ("ALL_REDUCE", True, True, "float64", 7),
    ]:
        runs = [
            loss_and_grads(
                build(dtype, c, tied, None, pc.tp_pg, mode=mode, async_communication=overlap, cp_pg=pc.cp_pg),
                ids,
                targets,
            )
            for c in (0, chunk)
        ]
        name = f"tp2 {mode} cp2 async={overlap} tied={tied} chunk={chunk}"
        out.append((name, dtype, relative(runs[1][0], runs[0][0]), worst(runs[1][1], runs[0][1])))
    pc.destroy()

    pc = ParallelContext(tensor_parallel_size=2, pipeline_parallel_size=2)
    ids, targets = batch(4, rows=4)
    micro = list(zip(ids.split(2), targets.split(2)))
    for mode, tied, dtype, chunk in [
        ("REDUCE_SCATTER", True, "float32", 8),
        ("ALL_REDUCE", True, "float64", 7),
        ("ALL_REDUCE", False, "float32", 16),
    ]:
        runs = []
        for c in (0, chunk):
            part = build(dtype, c, tied, None, pc.tp_pg, mode=mode, pp_rank=pc.pp_rank, pp_size=2)
            part.begin_step(len(micro))
            loss = PipelineEngine("1f1b", pc.pp_pg).forward_backward(part, micro, None)
            grads = {n: p.grad.clone() for n, p in part.named_parameters() if p.grad is not None}
            runs.append((loss.detach() if isinstance(loss, torch.Tensor) else None, grads))
            del part, loss  # nothing may hold the groups when they are destroyed
        loss_error = relative(runs[1][0], runs[0][0]) if runs[0][0] is not None else 0.0
        out.append((f"tp2 {mode} pp2 1f1b tied={tied} chunk={chunk}", dtype, loss_error, worst(runs[1][1], runs[0][1])))
    pc.destroy()
    return out


@pytest.mark.timeout(300)
def test_tp_cp_pp_equal_the_head_in_one_piece():
    failures = []
    for rank, cases in enumerate(run_distributed(parallel_worst, 4, timeout=240)):
        for name, dtype, loss_error, grad_error in cases:
            if loss_error > TOL[dtype] or grad_error > TOL[dtype]:
                failures.append(f"rank {rank} {name} {dtype}: loss {loss_error:.2e}, gradients {grad_error:.2e}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- memory
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_falls_by_the_chunk_count_and_the_estimate_follows(dtype):
    tokens = LOSS_SEQ * LOSS_BATCH
    value = 2 if dtype == "bfloat16" else 4
    weight = LOSS_MODEL["vocab_size"] * LOSS_MODEL["hidden_size"]
    fixed = weight * (4 + (value if value < 4 else 0)) + 2 * tokens * LOSS_MODEL["hidden_size"] * value
    whole, estimate = head_peak(dtype, 0)
    assert estimate == pytest.approx(whole, rel=0.02)
    for chunks in (4, 8) if dtype == "float32" else (4,):
        measured, estimate = head_peak(dtype, tokens // chunks)
        print(f"{dtype}: one piece {whole / 2**20:.1f} MiB, {chunks} chunks {measured / 2**20:.1f} MiB")
        assert measured <= whole / chunks + fixed, (chunks, measured, whole, fixed)
        assert estimate == pytest.approx(measured, rel=0.02)


# ----------------------------------------------------------------------------- configuration
def config(*overrides: str):
    return load_config(
        ROOT / "configs" / "3d_16gpu.yaml",
        ["parallelism.dp=4", "parallelism.tp=2", "parallelism.pp=2", "training.micro_batch_size=4", *overrides],
    )


def test_null_resolves_from_the_vocabulary_and_the_estimate():
    assert costs.loss_chunk_tokens(config()) == 2048  # 32000 tokens, 8192 a micro-batch
    assert costs.loss_chunk_tokens(config("model.vocab_size=31999")) == 0
    assert costs.loss_chunk_tokens(config("training.loss_chunk_tokens=0")) == 0
    assert costs.loss_chunk_tokens(config("model.vocab_size=256", "training.loss_chunk_tokens=512")) == 512
    # 2048 tokens a micro-batch: no chunk to cut; hidden 16384 at 4096 tokens: the fp32 sum of the
    # weight gradients outweighs what two chunks save
    assert costs.loss_chunk_tokens(config("training.micro_batch_size=1")) == 0
    wide = ["model.hidden_size=16384", "model.num_attention_heads=128", "model.num_key_value_heads=8"]
    assert costs.loss_chunk_tokens(config(*wide, "training.micro_batch_size=2")) == 0
    assert costs.loss_chunk_tokens(config(*wide, "training.micro_batch_size=8")) == 2048
    assert plan_from_config(config()).loss_chunk_tokens == 2048


def test_dry_run_estimate_falls_and_names_the_chunks():
    """An 8B shape cut to 2 layers on one stage (8192 tokens, a 128k vocabulary): the head's
    logits and gradients dominate the activations; four chunks take 7 of their 17 GB."""
    shape = [
        "model.vocab_size=128256",
        "model.hidden_size=4096",
        "model.intermediate_size=14336",
        "model.num_attention_heads=32",
        "model.num_key_value_heads=8",
        "model.num_layers=2",
        "model.max_position_embeddings=8192",
        "training.sequence_length=8192",
        "training.micro_batch_size=1",
        "training.batch_accumulation_per_replica=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "parallelism.dp=16",
    ]
    chunked, whole = config(*shape), config(*shape, "training.loss_chunk_tokens=0")
    assert estimate_memory(chunked).activations < estimate_memory(whole).activations - 6
    assert "loss in chunks of 2048 tokens" in describe(chunked)[0]
    assert "chunks" not in describe(whole)[0]
