"""The real PipelineEngine and P2P over a transport with NCCL's semantics (``helpers/nccl_sim.py``).

Every engine (afab, 1f1b, interleaved_1f1b) at pp 2 and 4 with every m up to 8 must finish
(a deadlock fails within seconds) and give the single-process loss and gradients; every matched
pair of messages must agree on tag, shape and dtype (NCCL matches by order only). Controls show
the simulation is sound: with buffered sends every schedule passes; posting receives ahead —
what the engine does on gloo — deadlocks on NCCL's in-order streams, so the engine does it only
on tag-matching transports; and one communicator for the whole pp group deadlocks interleaved
1f1b, which is why each flow gets its own (``ParallelContext.pipeline_flow_groups``).
"""
from __future__ import annotations

import functools

import pytest
import torch

from nanotrain.config import ModelArgs
from nanotrain.models.llama import LlamaModel
from nanotrain.parallel.pipeline_parallel import P2P, PipelineEngine

from helpers.nccl_sim import Deadlock, NcclSemanticsWorld, run_ranks

MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=8, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16, dtype="float32")
SEQ, MBS = 8, 2


def _cases() -> list[tuple[str, int, int, int]]:
    out = []
    for pp in (2, 4):
        for m in range(1, 9):
            out += [("afab", pp, 1, m), ("1f1b", pp, 1, m)]
            if m % pp == 0:
                out.append(("interleaved_1f1b", pp, 2, m))
    return out


def _data(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, MODEL["vocab_size"], (m, MBS, SEQ + 1), generator=torch.Generator().manual_seed(m))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@functools.lru_cache(maxsize=None)
def _reference(m: int, compute_dtype=None) -> tuple[float, dict]:
    model = LlamaModel(ModelArgs(**MODEL), None, seed=5, compute_dtype=compute_dtype)
    loss = sum(model(ids, targets) / m for ids, targets in _data(m))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _run(engine: str, pp: int, v: int, m: int, eager_sends: bool = False, post_ahead: bool = False,
         per_flow: bool = True, compute_dtype=None, timeout: float = 5.0) -> tuple[float, dict, NcclSemanticsWorld]:
    world = NcclSemanticsWorld(pp, timeout=timeout, eager_sends=eager_sends, per_flow=per_flow)
    data = _data(m)

    def rank_main(rank: int):
        torch.set_num_threads(1)
        model = LlamaModel(ModelArgs(**MODEL), None, pp_rank=rank, pp_size=pp, virtual_stages=v, seed=5,
                           compute_dtype=compute_dtype)
        transport = world.transport(rank)
        if post_ahead:
            transport.matches_by_tag = True  # the gloo strategy, on NCCL's semantics
        pipe = PipelineEngine(engine, p2p=P2P(transport))
        loss = pipe.forward_backward(model, data, None, model.pipeline_message(MBS, SEQ))
        return (loss.item() if torch.is_tensor(loss) else None,
                {n: p.grad.clone() for n, p in model.named_parameters()})

    results = run_ranks(pp, rank_main, timeout=60)
    grads = {n: g for _, rank_grads in results for n, g in rank_grads.items()}
    return results[-1][0], grads, world


@pytest.mark.parametrize("engine,pp,v,m", _cases(), ids=lambda x: str(x))
def test_engine_completes_and_matches_one_process_under_nccl_semantics(engine, pp, v, m):
    loss, grads, world = _run(engine, pp, v, m)
    ref_loss, ref_grads = _reference(m)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    stage_boundaries = pp * v - 1
    assert world.messages == 2 * stage_boundaries * m  # one message per activation and gradient


def test_bf16_messages_under_nccl_semantics():
    """Under autocast the hidden states cross stages in bf16 (half the bytes of fp32)."""
    loss, grads, world = _run("interleaved_1f1b", 2, 2, 4, compute_dtype=torch.bfloat16)
    ref_loss, _ = _reference(4, torch.bfloat16)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("engine,v,m", [("1f1b", 1, 4), ("interleaved_1f1b", 2, 4)])
def test_controls_buffered_sends_pass_and_receives_posted_ahead_deadlock(engine, v, m):
    for per_flow in (True, False):
        loss, _, _ = _run(engine, 2, v, m, eager_sends=True, per_flow=per_flow)
        assert loss == pytest.approx(_reference(m)[0], abs=1e-5)
    with pytest.raises(Deadlock):
        _run(engine, 2, v, m, post_ahead=True, per_flow=False, timeout=1.5)


def test_one_communicator_for_the_pp_group_deadlocks_interleaved():
    """Why the flows have communicators of their own: on one shared communicator, rank 0 and
    rank 1 each post a lone send the other will only receive after its next batch."""
    with pytest.raises(Deadlock, match="send to"):
        _run("interleaved_1f1b", 2, 2, 4, per_flow=False, timeout=1.5)
