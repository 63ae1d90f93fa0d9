"""Pipeline parallelism: schedules, stage split, P2P, and pp in {2, 4} x every engine equal to the
1-process model (loss and every gradient, 1e-5), tied and untied embeddings; the engine's
activation meter shows 1f1b holding at most pp micro-batches per stage where afab holds all m.

Two process launches (pp=2, pp=4), each running every case; the schedule checks run in-process
on a small event simulator."""

from __future__ import annotations

import functools

import pytest
import torch

from nanotrain.config import ModelArgs
from nanotrain.parallel.pipeline_parallel import balanced_split, schedule_actions, theoretical_bubble

from helpers.dist import run_distributed

MODEL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,
    dtype="float32",
)
SEQ, MICRO_BATCH = 8, 2


def cases(pp: int) -> list[tuple[str, int, int, bool]]:
    """(engine, virtual stages, micro-batches, tied)."""
    out = []
    for tied in (False, True):
        out += [
            ("afab", 1, 3, tied),
            ("afab", 1, 8, tied),
            ("1f1b", 1, pp, tied),
            ("1f1b", 1, 8, tied),
            ("interleaved_1f1b", 2, pp, tied),
            ("interleaved_1f1b", 2, 2 * pp, tied),
        ]
    if pp == 2:
        out += [("interleaved_1f1b", 3, 4, True), ("interleaved_1f1b", 4, 6, False)]
    return out


# ----------------------------------------------------------------------------- simulator
def simulate(name: str, pp: int, m: int, v: int, f: float = 1.0, b: float = 2.0) -> dict:
    """Run every rank's action list against the data dependencies with compute times f and b per
    chunk (v chunks share one stage's work) and free communication. Fails on a deadlock."""
    plans = [schedule_actions(name, pp, r, m, v) for r in range(pp)]
    stages = pp * v
    done: dict[tuple[str, int, int], float] = {}  # (op, virtual stage, mb) -> finish time
    clock, pos, live, peak = [0.0] * pp, [0] * pp, [0] * pp, [0] * pp
    while any(pos[r] < len(plans[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(plans[r]):
                op, chunk, mb = plans[r][pos[r]]
                s = chunk * pp + r
                deps = [("F", s - 1, mb)] if op == "F" and s > 0 else []
                if op == "B":
                    deps = [("F", s, mb)] + ([("B", s + 1, mb)] if s < stages - 1 else [])
                if any(d not in done for d in deps):
                    break
                assert (op, s, mb) not in done, f"{name}: {op}{s},{mb} twice"
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + (f if op == "F" else b) / v
                done[(op, s, mb)] = clock[r]
                live[r] += 1 if op == "F" else -1
                peak[r] = max(peak[r], live[r])
                pos[r] += 1
                progressed = True
        assert progressed, f"{name} pp={pp} m={m} v={v} deadlocks at {pos}"
    assert len(done) == 2 * stages * m and all(n == 0 for n in live)
    total = max(clock)
    return {"peak": peak, "bubble": 1 - (f + b) * m / total}


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_schedules_complete_with_expected_memory_and_bubble(pp):
    for m in range(1, 13):
        for name in ("afab", "1f1b"):
            sim = simulate(name, pp, m, 1)
            assert sim["bubble"] == pytest.approx(theoretical_bubble(name, pp, m)), (name, m)
            expected = [m] * pp if name == "afab" else [min(pp - r, m) for r in range(pp)]
            assert sim["peak"] == expected, (name, m)
        if m % pp == 0:
            for v in (1, 2, 3, 4):
                sim = simulate("interleaved_1f1b", pp, m, v)
                assert sim["bubble"] <= theoretical_bubble("interleaved_1f1b", pp, m, v) + 1e-9, (m, v)
                assert max(sim["peak"]) <= m * v


def test_interleaved_matches_megatron_order():
    # pp=2, v=2, m=4, rank 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards, then 1F1B, chunks in groups of pp.
    got = [(a.op, a.chunk, a.microbatch) for a in schedule_actions("interleaved_1f1b", 2, 0, 4, 2)]
    assert got[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1)]
    assert got[4:8] == [("F", 0, 2), ("B", 1, 0), ("F", 0, 3), ("B", 1, 1)]
    assert got[-2:] == [("B", 0, 2), ("B", 0, 3)]


def test_balanced_split_counts_head_and_embedding():
    assert balanced_split([1, 1, 1, 1], 2) == [2, 2]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]  # a heavy first unit (embedding) stays alone
    assert balanced_split([1, 1, 1, 1, 1, 3], 3)[-1] == 1  # a heavy LM head takes a stage to itself
    assert balanced_split([2, 2, 2], 3) == [1, 1, 1]
    assert balanced_split([1] * 7 + [3], 4) == [2, 2, 3, 1]  # not [1, 3, 3, 1]: same max, less even
    with pytest.raises(ValueError):
        balanced_split([1, 1], 3)


def test_llama_stage_split_balances_lm_head():
    from nanotrain.models.llama import LlamaModel
    from nanotrain.models.llama_arch import block_costs, pipeline_blocks
    from nanotrain.parallel.pipeline_parallel import keep_blocks_, place_stages

    # A vocabulary large enough that the head costs about two layers: the last stage gets fewer layers.
    args = ModelArgs(**{**MODEL, "vocab_size": 640, "num_layers": 8})
    cost = block_costs(args)
    assert 1.5 < cost["head"] / cost["layer"] < 2.5
    blocks = pipeline_blocks(args)
    names, costs, attaches = [b.name for b in blocks], [b.cost for b in blocks], [b.attach for b in blocks]
    stage_of = {
        name: chunk.virtual_stage
        for r in range(4)
        for chunk in place_stages(names, costs, attaches, r, 4)
        for name in chunk.blocks
    }
    per_stage = [sum(1 for i in range(8) if stage_of[f"layers.{i}"] == s) for s in range(4)]
    assert per_stage in ([2, 2, 3, 1], [2, 3, 2, 1])  # head ~ 2 layers: max stage cost 3 layers, evenly
    assert stage_of["embed"] == 0 and stage_of["lm_head"] == 3
    with torch.device("meta"):
        model = LlamaModel(args)
    (chunk,) = place_stages(names, costs, attaches, 0, 4)
    keep_blocks_(model, names, chunk.blocks)
    assert model.embed is not None and model.lm_head is None  # rank 0 builds only its own blocks
    assert sorted(model.layers) == sorted(n.split(".")[1] for n in chunk.blocks if n.startswith("layers."))


def test_adopting_wrapper_keeps_names_and_follows_dtype_moves():
    from nanotrain.parallel.part.adopt import Adopting

    block = Adopting(torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False)))
    assert list(dict(block.named_parameters())) == ["0.weight"]  # the module's own names, no prefix
    lone = Adopting(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    lone.double()
    assert lone.inner[0].weight is getattr(lone, "0").weight and lone.inner[0].weight.dtype == torch.float64
    assert lone(torch.ones(1, 3, dtype=torch.float64)).shape == (1, 2)
    with pytest.raises(ValueError, match="directly"):
        Adopting(torch.nn.Linear(3, 2))  # a module's own tensors cannot be adopted


# ----------------------------------------------------------------------------- distributed
def microbatches(m: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + m)
    tokens = torch.randint(0, vocab, (m, MICRO_BATCH, SEQ + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def check_p2p(pc) -> None:
    """Tensors of every wire dtype and several shapes, sent both ways at once (the batched
    exchange must not deadlock), several per call, received into buffers allocated from specs
    both sides know; a non-contiguous send; then a shape mismatch is refused before sending."""
    from nanotrain.parallel.pipeline_parallel import P2P, MessageSpec
    from nanotrain.parallel.pipeline_parallel.p2p import Recv, Send, check_message

    p2p = P2P.over(pc.pp_pg)
    rank, pp = pc.pp_rank, pc.pp_size

    def payload(src: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(src)
        return [
            torch.randn(3, 4, generator=g).requires_grad_(),
            torch.tensor(2.5 + src, dtype=torch.float64),
            torch.randn(2, 3, 5, generator=g).to(torch.bfloat16),
            torch.arange(7) + src,
            torch.randn(4, 6, generator=g).t(),  # not contiguous
            torch.randn(*([1] * 7 + [3]), generator=g, dtype=torch.float16),
            torch.randint(0, 100, (3, 2), generator=g, dtype=torch.int32),
            torch.randint(0, 100, (5,), generator=g, dtype=torch.uint8),
        ]

    nxt, prev = (rank + 1) % pp, (rank - 1) % pp
    mine, theirs = payload(rank), payload(prev)
    got = p2p.communicate(
        sends=[Send(t, nxt, i) for i, t in enumerate(mine)],
        recvs=[Recv(prev, i, MessageSpec(tuple(t.shape), t.dtype), requires_grad=i == 0) for i, t in enumerate(theirs)],
    )
    for index, (sent, received) in enumerate(zip(theirs, got)):
        assert received.dtype == sent.dtype and received.shape == sent.shape
        assert received.requires_grad == (index == 0) and received.is_contiguous()
        assert torch.equal(received.detach(), sent.detach())
    p2p.wait_sends()
    with pytest.raises(ValueError):
        p2p.communicate(sends=[Send(torch.zeros(1), nxt, 2**30)])
    with pytest.raises(RuntimeError, match="expects"):
        check_message(torch.zeros(2, 3), MessageSpec((3, 2), torch.float32), "x")
    with pytest.raises(TypeError, match="NCCL"):
        check_message(torch.zeros(2, dtype=torch.bool), MessageSpec((2,), torch.bool), "x")


def full_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def run_cases(pp: int) -> dict:
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.parallel.data_parallel import BucketedGradSync
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.parallel.pipeline_parallel import PipelineEngine, allreduce_tied_grads_, is_tied_replica

    pc = ParallelContext(pipeline_parallel_size=pp)
    check_p2p(pc)
    results = {}
    for engine_name, v, m, tied in cases(pp):
        args = ModelArgs(**{**MODEL, "tie_word_embeddings": tied})
        data = microbatches(m, args.vocab_size)
        model = build_llama(args, pc.tp_pg, pp_rank=pc.pp_rank, pp_size=pp, virtual_stages=v, seed=3)
        sync = BucketedGradSync(list(model.parameters()), pc.dp_cp_pg, bucket_cap_mb=0.01)
        engine = PipelineEngine(engine_name, pc.pp_pg)
        loss = engine.forward_backward(model, data, sync, model.pipeline_message(MICRO_BATCH, SEQ))
        sync.finish_grad_sync()
        if pc.embedding_pg is not None:
            allreduce_tied_grads_(model.parameters(), pc.embedding_pg)
        grads = full_grads(model)
        # evaluation through the same engine: forward-only, the same loss, no graph, grads untouched
        eval_loss = engine.forward_only(model, data, model.pipeline_message(MICRO_BATCH, SEQ))
        untouched = all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
        no_graph = not torch.is_tensor(eval_loss) or eval_loss.grad_fn is None
        replicas = [n for n, p in model.named_parameters() if is_tied_replica(p)]
        stats = engine.last_stats
        results[(engine_name, v, m, tied)] = {
            "eval_loss": eval_loss.item() if torch.is_tensor(eval_loss) else None,
            "eval_clean": untouched and no_graph,
            "loss": None if not torch.is_tensor(loss) else loss.item(),
            "grads": grads,
            "replicas": replicas,
            "live": stats.peak_live_microbatches,
            "bytes": stats.peak_activation_bytes,
            "bubble": stats.bubble,
        }
        if pc.pp_rank == 0:  # the single-process reference, same seed and data
            ref = build_llama(args, pc.tp_pg, seed=3)
            ref_loss = sum(ref(ids, targets) / m for ids, targets in data)
            ref_loss.backward()
            results[(engine_name, v, m, tied)]["reference"] = {"loss": ref_loss.item(), "grads": full_grads(ref)}
    results["config_api"] = config_driven_steps(pc)
    results["nccl_posting"] = nccl_posting_steps(pc)
    pc.destroy()
    return results


def nccl_posting_steps(pc) -> dict:
    """The posting NCCL gets — receives posted only when needed, one batch per communication
    point on the pp group — run for real here on gloo (and the gloo posting, every receive
    ahead, beside it): same loss as one process."""
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.parallel.pipeline_parallel import P2P, PipelineEngine, TorchP2PTransport

    args, m = ModelArgs(**MODEL), 2 * pc.pp_size
    data = microbatches(m, args.vocab_size)
    out = {}
    for posts_ahead in (True, False):
        model = build_llama(args, pc.tp_pg, pp_rank=pc.pp_rank, pp_size=pc.pp_size, virtual_stages=2, seed=3)
        transport = TorchP2PTransport(pc.pp_pg)
        transport.matches_by_tag = posts_ahead
        loss = PipelineEngine("interleaved_1f1b", p2p=P2P(transport)).forward_backward(model, data, None)
        out[posts_ahead] = loss.item() if torch.is_tensor(loss) else None
    if pc.is_pipeline_first_stage:
        ref = build_llama(args, pc.tp_pg, seed=3)  # tp group of size 1 (None would mean the world)
        out["reference"] = sum(ref(ids, targets) / m for ids, targets in data).item()
    return out


def config_driven_steps(pc) -> dict:
    """The trainer's entry points (``training.builder.build_model`` / ``build_engine``, and
    ``train_step`` with no data on middle stages and the model's ``pipeline_message``) give the
    losses of a hand-built model and engine, bit for bit."""
    from nanotrain.config.loader import config_from_dict
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer
    from nanotrain.parallel.data_parallel import BucketedGradSync
    from nanotrain.parallel.pipeline_parallel import PipelineEngine
    from nanotrain.training.builder import build_engine, build_model
    from nanotrain.training.step import train_step

    m = 2 * pc.pp_size
    config = config_from_dict(
        {
            "parallelism": {"pp": pc.pp_size, "pp_engine": "interleaved_1f1b", "pp_virtual_stages": 2},
            "model": {**MODEL, "tie_word_embeddings": True},
            "training": {
                "sequence_length": SEQ,
                "micro_batch_size": MICRO_BATCH,
                "batch_accumulation_per_replica": m,
                "seed": 3,
                "train_steps": 3,
            },
            "optimizer": {"warmup_steps": 1, "lr": 1e-2},
        }
    )
    losses = {}
    for api in ("config", "explicit"):
        if api == "config":
            model, engine = build_model(config, pc), build_engine(config, pc)
        else:
            model = build_llama(
                ModelArgs(**{**MODEL, "tie_word_embeddings": True}),
                pc.tp_pg,
                pp_rank=pc.pp_rank,
                pp_size=pc.pp_size,
                virtual_stages=2,
                seed=3,
            )
            engine = PipelineEngine("interleaved_1f1b", pc.pp_pg)
        sync = BucketedGradSync(list(model.parameters()), pc.dp_cp_pg)
        optimizer = build_optimizer(model.named_parameters(), config.optimizer, pc.dp_cp_pg)
        scheduler = build_lr_scheduler(optimizer, config.optimizer, 3)
        losses[api] = []
        for step in range(3):
            data = microbatches(m, MODEL["vocab_size"])  # the same batch: the loss must fall
            if api == "config":  # as the trainer does: no data on middle stages, the message from the model
                middle = not (pc.is_pipeline_first_stage or pc.is_pipeline_last_stage)
                stats = train_step(
                    model,
                    [None] * m if middle else data,
                    sync,
                    optimizer,
                    scheduler,
                    pc,
                    config.optimizer.clip_grad,
                    engine,
                    model.pipeline_message(MICRO_BATCH, SEQ),
                )
            else:
                stats = train_step(model, data, sync, optimizer, scheduler, pc, config.optimizer.clip_grad, engine)
            losses[api].append(stats.loss)
    return losses


@functools.lru_cache(maxsize=None)
def launch(pp: int) -> list[dict]:
    return run_distributed(run_cases, pp, pp, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_equals_single_process(pp):
    per_rank = launch(pp)
    for case in cases(pp):
        label = f"pp{pp} {case}"
        engine_name, v, m, tied = case
        ref = per_rank[0][case]["reference"]
        losses = [r[case]["loss"] for r in per_rank]
        assert losses[:-1] == [None] * (pp - 1), label  # the loss lives on the last stage only
        assert losses[-1] == pytest.approx(ref["loss"], rel=1e-5, abs=0), label
        assert [r[case]["eval_loss"] for r in per_rank] == losses, label  # forward_only: same loss
        assert all(r[case]["eval_clean"] for r in per_rank), label  # no graph, no gradient touched
        merged: dict[str, torch.Tensor] = {}
        for rank, r in enumerate(per_rank):
            for name, grad in r[case]["grads"].items():
                if name in r[case]["replicas"]:
                    assert tied and rank == pp - 1 and name == "embed.weight", label
                    torch.testing.assert_close(grad, ref["grads"][name], rtol=0, atol=1e-5)
                    continue
                assert name not in merged, f"{label}: {name} on two stages"
                merged[name] = grad
        assert merged.keys() == ref["grads"].keys(), label
        for name, grad in merged.items():
            torch.testing.assert_close(
                grad, ref["grads"][name], rtol=0, atol=1e-5, msg=lambda msg: f"{label} grad {name}: {msg}"
            )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_activation_memory_1f1b_vs_afab(pp):
    per_rank = launch(pp)
    for tied in (False, True):
        for rank, r in enumerate(per_rank):
            afab, one = r[("afab", 1, 8, tied)], r[("1f1b", 1, 8, tied)]
            assert afab["live"] == 8, (rank, afab["live"])  # afab holds every micro-batch
            assert one["live"] == pp - rank <= pp, (rank, one["live"])  # 1f1b at most pp
            per_microbatch = afab["bytes"] / 8
            assert per_microbatch > 0
            assert one["bytes"] == pytest.approx(one["live"] * per_microbatch, rel=1e-6)
            inter = r[("interleaved_1f1b", 2, 2 * pp, tied)]
            sim = simulate("interleaved_1f1b", pp, 2 * pp, 2)
            assert inter["live"] == sim["peak"][rank]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_config_driven_entry_points(pp):
    per_rank = launch(pp)
    for r in per_rank:  # every rank holds the loss, and both APIs agree exactly
        assert r["config_api"]["config"] == r["config_api"]["explicit"] == per_rank[-1]["config_api"]["config"]
    assert per_rank[0]["config_api"]["config"][-1] < per_rank[0]["config_api"]["config"][0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", [2, 4])
def test_nccl_posting_on_gloo(pp):
    """The NCCL posting (receives when needed), and gloo's (receives ahead), equal one process."""
    per_rank = launch(pp)
    reference = per_rank[0]["nccl_posting"]["reference"]
    assert per_rank[-1]["nccl_posting"][True] == pytest.approx(reference, abs=1e-5)
    assert per_rank[-1]["nccl_posting"][False] == pytest.approx(reference, abs=1e-5)
