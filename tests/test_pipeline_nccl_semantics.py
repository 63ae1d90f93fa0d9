"""The real PipelineEngine and P2P over a transport with NCCL's semantics (``helpers/nccl_sim.py``).

Every engine (afab, 1f1b, interleaved_1f1b with v = 1 and 2) at pp 2 and 4, with every m <= 8
that config validation accepts, must finish (a deadlock fails within seconds) and give the
single-process loss and gradients; every matched pair of messages must agree on tag, shape and
dtype (NCCL matches by order only). It must do so in two modes: serialized — each rank runs its
NCCL batches strictly one after another, whatever the communicator, since CUDA does not promise
that two NCCL kernels of a GPU run at the same time — and today's per-communicator mode, every
flow on a communicator and stream of its own (with the transport's one communicator, the
default world, the two modes coincide).

Controls show the simulation can fail: with buffered sends every schedule passes; posting
receives ahead — what the engine does on gloo — deadlocks on NCCL's in-order streams, so the
engine does it only on tag-matching transports; the former layout (one communicator per flow,
one batch each) deadlocks 1f1b in the first steady-state exchange once batches run serially, and
so does interleaved 1f1b exchanging between the forward and the backward of a steady-state pair
(why its pairs communicate once, as Megatron's do: ``schedules.interleaved_1f1b_steps``).
"""

from __future__ import annotations

import functools

import pytest
import torch

import nanotrain.parallel.pipeline_parallel.engine as engine_module
from nanotrain.config import ModelArgs
from nanotrain.models.llama_parallelize import build_llama
from nanotrain.parallel.pipeline_parallel import P2P, PipelineEngine, schedule_actions

from helpers.nccl_sim import Deadlock, NcclSemanticsWorld, run_ranks

MODEL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,
    dtype="float32",
)
SEQ, MBS = 8, 2
MODES = {"serialized": dict(serialize=True), "per-communicator": dict(per_flow=True)}


def _cases() -> list[tuple[str, int, int, int]]:
    """(engine, pp, v, m) for every m <= 8 that ``config/validate.py`` accepts: 1f1b needs
    m >= pp, interleaved a multiple of pp (afab takes any)."""
    out = []
    for pp in (2, 4):
        for m in range(1, 9):
            out.append(("afab", pp, 1, m))
            if m >= pp:
                out.append(("1f1b", pp, 1, m))
            if m % pp == 0:
                out += [("interleaved_1f1b", pp, 1, m), ("interleaved_1f1b", pp, 2, m)]
    return out


def _data(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, MODEL["vocab_size"], (m, MBS, SEQ + 1), generator=torch.Generator().manual_seed(m))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@functools.lru_cache(maxsize=None)
def _reference(m: int, compute_dtype=None) -> tuple[float, dict]:
    model = build_llama(ModelArgs(**MODEL), None, seed=5, compute_dtype=compute_dtype)
    loss = sum(model(ids, targets) / m for ids, targets in _data(m))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _run(
    engine: str,
    pp: int,
    v: int,
    m: int,
    eager_sends: bool = False,
    post_ahead: bool = False,
    per_flow: bool = False,
    serialize: bool = False,
    compute_dtype=None,
    forward_only: bool = False,
    timeout: float = 5.0,
) -> tuple[float, dict, NcclSemanticsWorld]:
    world = NcclSemanticsWorld(pp, timeout=timeout, eager_sends=eager_sends, per_flow=per_flow, serialize=serialize)
    data = _data(m)

    def rank_main(rank: int):
        torch.set_num_threads(1)
        model = build_llama(
            ModelArgs(**MODEL), None, pp_rank=rank, pp_size=pp, virtual_stages=v, seed=5, compute_dtype=compute_dtype
        )
        transport = world.transport(rank)
        if post_ahead:
            transport.matches_by_tag = True  # the gloo strategy, on NCCL's semantics
        pipe = PipelineEngine(engine, p2p=P2P(transport))
        message = model.pipeline_message(MBS, SEQ)
        if forward_only:
            loss = pipe.forward_only(model, data, message)
        else:
            loss = pipe.forward_backward(model, data, None, message)
        return (
            loss.item() if torch.is_tensor(loss) else None,
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )

    results = run_ranks(pp, rank_main, timeout=60)
    grads = {n: g for _, rank_grads in results for n, g in rank_grads.items()}
    return results[-1][0], grads, world


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("engine,pp,v,m", _cases(), ids=lambda x: str(x))
def test_engine_completes_and_matches_one_process_under_nccl_semantics(engine, pp, v, m, mode):
    loss, grads, world = _run(engine, pp, v, m, **MODES[mode])
    ref_loss, ref_grads = _reference(m)
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    stage_boundaries = pp * v - 1
    assert world.messages == 2 * stage_boundaries * m  # one message per activation and gradient


@pytest.mark.parametrize("engine,pp,v", [("1f1b", 4, 1), ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 2)])
def test_forward_only_completes_serialized(engine, pp, v):
    """Evaluation (the schedule's forwards only) runs on NCCL too."""
    loss, grads, world = _run(engine, pp, v, 8, serialize=True, forward_only=True)
    assert loss == pytest.approx(_reference(8)[0], abs=1e-5)
    assert not grads and world.messages == (pp * v - 1) * 8


def test_bf16_messages_under_nccl_semantics():
    """Under autocast the hidden states cross stages in bf16 (half the bytes of fp32)."""
    loss, grads, world = _run("interleaved_1f1b", 2, 2, 4, serialize=True, compute_dtype=torch.bfloat16)
    ref_loss, _ = _reference(4, torch.bfloat16)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert dict(world.dtypes) == {torch.bfloat16: world.messages} and world.messages == 2 * 3 * 4


@pytest.mark.parametrize("engine,v,m", [("1f1b", 1, 4), ("interleaved_1f1b", 2, 4)])
def test_controls_buffered_sends_pass_and_receives_posted_ahead_deadlock(engine, v, m):
    for per_flow in (True, False):
        loss, _, _ = _run(engine, 2, v, m, eager_sends=True, per_flow=per_flow, serialize=True)
        assert loss == pytest.approx(_reference(m)[0], abs=1e-5)
    with pytest.raises(Deadlock):
        _run(engine, 2, v, m, post_ahead=True, timeout=1.5)


def test_control_per_flow_batches_deadlock_when_batches_run_serially():
    """The former layout: every flow on its own communicator, so a communication point is two
    batches (send the activation, then receive the gradient). It passes while every
    communicator progresses on its own, and hangs the first steady-state exchange of 1f1b at
    pp 2 once each rank runs one batch at a time: rank 0 sends act 1 while rank 1 sends grad 0."""
    assert _run("1f1b", 2, 1, 2, per_flow=True)[0] == pytest.approx(_reference(2)[0], abs=1e-5)
    with pytest.raises(Deadlock, match=r"rank \d batch #1 \(flow .*send to"):
        _run("1f1b", 2, 1, 2, per_flow=True, serialize=True, timeout=1.5)


def test_control_interleaved_exchanging_between_forward_and_backward_deadlocks(monkeypatch):
    """Interleaved 1f1b communicating around every action (as 1f1b does) instead of once per
    steady-state pair: neighbours each post a lone send the other receives only after its next
    batch, on one communicator (pp 2, v 2, m 4)."""
    monkeypatch.setattr(
        engine_module, "schedule_steps", lambda name, *args: [(a,) for a in schedule_actions(name, *args)]
    )
    with pytest.raises(Deadlock, match="send to"):
        _run("interleaved_1f1b", 2, 2, 4, serialize=True, timeout=1.5)
