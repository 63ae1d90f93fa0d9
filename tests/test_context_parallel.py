"""Context parallelism equals the single-process model: loss, logits and every gradient, for
cp = 2 and 4, with GQA, tied and untied embeddings, and cp x tp in both tp modes; plus the zig-zag
split itself (every position once, balanced causal work)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from nanotrain.config import ModelArgs
from nanotrain.parallel.context_parallel import cp_positions

from helpers.dist import run_distributed
from helpers.models import full_grad

ARGS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    dtype="float32",
    init_std=0.02,
)
SEQ, BATCH = 32, 2
CASES = [(mode, tied) for mode in ("ALL_REDUCE", "REDUCE_SCATTER") for tied in (False, True)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_positions_cover_the_sequence_with_equal_causal_work(cp):
    seq = 2 * cp * 5
    parts = [cp_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    assert all(p.tolist() == sorted(p.tolist()) and len(p) == seq // cp for p in parts)
    work = [int((p + 1).sum()) for p in parts]  # keys a query at position i attends to: i + 1
    assert len(set(work)) == 1, work


def test_sequence_not_divisible_is_an_error():
    with pytest.raises(ValueError, match="divisible by 2\\*cp = 4"):
        cp_positions(30, 2, 0)


def model_outputs(cp: int, tp: int) -> dict:
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(tensor_parallel_size=tp, context_parallel_size=cp)
    ids = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    positions = cp_positions(SEQ, cp, pc.cp_rank)
    results = {}
    for mode, tied in CASES:
        model = build_llama(
            ModelArgs(**{**ARGS, "tie_word_embeddings": tied}), pc.tp_pg, mode=mode, seed=7, cp_pg=pc.cp_pg
        )
        logits = model(ids)  # [S/cp, B, V/tp] of this rank's tokens
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=pc.tp_pg)
        local = torch.cat(parts, dim=-1)[..., : ARGS["vocab_size"]]
        full_logits = torch.zeros(SEQ, BATCH, ARGS["vocab_size"])
        full_logits[positions] = local
        dist.all_reduce(full_logits, group=pc.cp_pg)  # each position is held by one cp rank

        loss = model(ids, targets)
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=pc.cp_pg)
        mean_loss /= cp
        sequence_parallel = set(map(id, model.sequence_parallel_params()))
        grads = {}
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad, group=pc.cp_pg)  # what the dp x cp gradient sync does (mean)
            p.grad /= cp
            grads[name] = full_grad(p, pc.tp_pg, id(p) in sequence_parallel)
        results[(mode, tied)] = {"logits": full_logits, "loss": mean_loss, "grads": grads}
    rank = dist.get_rank()
    pc.destroy()
    return results if rank == 0 else {}


@functools.lru_cache(maxsize=None)
def outputs(cp: int, tp: int) -> dict:
    return run_distributed(model_outputs, cp * tp, cp, tp, timeout=300)[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("cp,tp", [(2, 1), (4, 1), (2, 2)])
def test_cp_model_equals_single_process(cp, tp):
    reference, parallel = outputs(1, 1), outputs(cp, tp)
    for case in CASES:
        ref, got = reference[case], parallel[case]
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6, msg=f"loss {case}")
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-5, atol=1e-5, msg=f"logits {case}")
        assert got["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(
                got["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"grad {n} {case}: {m}"
            )


def loss_without_cp_group() -> float:
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(data_parallel_size=2)
    ids = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    model = build_llama(ModelArgs(**ARGS), pc.tp_pg, seed=7)  # no cp_pg: whole sequences, no collective
    loss = model(ids, ids).item()
    pc.destroy()
    return loss


@pytest.mark.timeout(120)
def test_no_cp_group_means_no_context_parallelism():
    """``cp_pg=None`` in a multi-rank world is one rank's whole sequence (it once meant the default
    group: every rank then split the sequence and waited in an all-gather)."""
    from nanotrain.models.llama_parallelize import build_llama

    ids = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    reference = build_llama(ModelArgs(**ARGS), None, seed=7)(ids, ids).item()
    assert run_distributed(loss_without_cp_group, 2, timeout=90) == [reference, reference]
