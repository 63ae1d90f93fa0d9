"""The whole Llama under tensor parallelism equals the single-process model: logits, loss and
every gradient, for tp=2 and tp=4, both tp modes, async on/off, tied and untied embeddings.
The vocabulary (258) is not divisible by 4, so padding is exercised too."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from nanotrain.config import ModelArgs
from nanotrain.parallel.sharding import get_shard_info

from helpers.dist import run_distributed
from helpers.models import full_grad

ARGS = dict(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=64,
    dtype="float32",
    init_std=0.02,
)
SEQ, BATCH = 16, 2
CASES = [
    (mode, async_comm, tied, kv)
    for mode in ("ALL_REDUCE", "REDUCE_SCATTER")
    for async_comm in (False, True)
    for tied in (False, True)
    for kv in (8, 4)
]


def full_logits(logits: torch.Tensor, tp_group, vocab: int) -> torch.Tensor:
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)[..., :vocab]


def model_outputs(tp: int) -> dict:
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.parallel.parallel_context import ParallelContext

    torch.manual_seed(0)
    pc = ParallelContext(tensor_parallel_size=tp)
    ids = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    results = {}
    for mode, async_comm, tied, kv in CASES:
        args = ModelArgs(**{**ARGS, "tie_word_embeddings": tied, "num_key_value_heads": kv})
        model = build_llama(args, pc.tp_pg, mode=mode, async_communication=async_comm, seed=7)
        logits = full_logits(model(ids), pc.tp_pg, args.vocab_size)
        loss = model(ids, targets)
        loss.backward()
        sp = set(map(id, model.sequence_parallel_params()))
        grads = {name: full_grad(p, pc.tp_pg, id(p) in sp) for name, p in model.named_parameters()}
        weights = {}
        for name, p in model.named_parameters():
            full = torch.zeros(get_shard_info(p).global_shape)
            for local, global_ in get_shard_info(p).pairs:
                full[global_] = p.detach()[local]
            if get_shard_info(p).is_sharded:
                dist.all_reduce(full, group=pc.tp_pg)
            weights[name] = full
        results[(mode, async_comm, tied, kv)] = {
            "logits": logits,
            "loss": loss.detach(),
            "grads": grads,
            "weights": weights,
        }
    rank = dist.get_rank()
    pc.destroy()
    return results if rank == 0 else {}


@functools.lru_cache(maxsize=None)
def outputs(tp: int) -> dict:
    return run_distributed(model_outputs, tp, tp, timeout=300)[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_model_equals_single_process(tp):
    reference, sharded = outputs(1), outputs(tp)
    failures = []
    for case in CASES:
        ref, got = reference[case], sharded[case]
        torch.testing.assert_close(
            got["logits"], ref["logits"], rtol=1e-5, atol=1e-5, msg=lambda m: f"logits {case}: {m}"
        )
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-6, atol=1e-6)
        assert got["grads"].keys() == ref["grads"].keys()
        for name, grad in ref["grads"].items():
            err = (got["grads"][name] - grad).abs().max().item()
            if err > 1e-5 + 1e-5 * grad.abs().max().item():
                failures.append(f"{case} {name}: max abs err {err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("tp", [2, 4])
def test_same_weights_at_step_zero(tp):
    """The shards of every tp put together are exactly (bitwise) the tp=1 parameters."""
    reference, sharded = outputs(1), outputs(tp)
    for case in CASES:
        for name, weight in reference[case]["weights"].items():
            assert torch.equal(sharded[case]["weights"][name], weight), (case, name)
