"""The Hugging Face families' ``model:`` options (``head_dim``, ``qkv_bias``, ``qk_norm``,
``no_rope_layers``, ``moe.norm_topk_prob``) under every parallel mode, what they change, and the
one-line refusals of ``model.family``, ``sliding_window`` and ``no_rope_layers``.

One dense model with every dense option on (non-zero q/k/v biases, q/k norm weights away from 1,
heads of 12 features at hidden 32, GQA, layer 1 without RoPE) and one MoE model (q/k norms,
``norm_topk_prob: false``): the first step's loss and every gradient at tp2 (both modes), cp2,
pp2 and (MoE) ep2 equal the one-process model's in fp32, all from ONE launch of two ranks. The
q/k norm weights are shared by heads that tp splits: their gradient is summed over tp in both tp
modes, exactly once (the test reads the product's own sum, ``allreduce_sequence_parallel_grads_``).
The dense tp2 run also saves a checkpoint whose assembled tensors are the one-process ones (the
qkv bias's tp shards put back in [q | k | v] order)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from nanotrain.config import Config, ModelArgs, MoEArgs, TrainingArgs, validate
from nanotrain.models import moe as moe_module
from nanotrain.models.llama import param_seed
from nanotrain.models.llama_parallelize import build_llama
from nanotrain.parallel.sharding import copy_from_full_, gather_full, get_shard_info

from helpers.dist import run_distributed

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"  # (helpers.runs: heavy for the ranks)

DENSE = ModelArgs(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,  # 48 query features at hidden 32
    qkv_bias=True,
    qk_norm=True,
    no_rope_layers=[1],
    max_position_embeddings=32,
    dtype="float32",
)
MOE = dataclasses.replace(
    DENSE,
    num_layers=2,
    qkv_bias=False,
    no_rope_layers=[],
    moe=MoEArgs(
        num_experts=4,
        top_k=2,
        expert_intermediate_size=24,
        norm_topk_prob=False,
        # the load-balancing loss is a product of two means over a rank's tokens: under cp and
        # sequence parallelism it is not the one-process value (test_moe_parallel); the z-loss is
        aux_loss_coef=0.0,
        z_loss_coef=0.01,
    ),
)
MODELS = {"dense": DENSE, "moe": MOE}
LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, mode="REDUCE_SCATTER"),
    "cp2": dict(cp=2),
    "pp2": dict(pp=2),
    "ep2": dict(ep=2),
}
RUNS = [(m, lay) for m in MODELS for lay in LAYOUTS if lay != "ep2" or MODELS[m].moe]
SAVED = ("dense", "tp2")
SEED, SEQ, MICRO, BATCH = 5, 16, 2, 4


def set_options_(model) -> None:
    """Give the q/k/v biases and q/k norm weights values that matter (they start at 0 and 1), the
    same full tensors on every topology (seeded by name), each rank taking its own shard."""
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(param_seed(SEED, name))
        shape = get_shard_info(p).global_shape
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            copy_from_full_(p, 0.5 + torch.rand(shape, generator=gen))
        elif name.endswith(".bias"):
            copy_from_full_(p, 0.5 * torch.randn(shape, generator=gen))


def microbatches(data_rank: int, data_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data rank's share of the fixed batch ([BATCH, SEQ + 1] ids), in micro-batches."""
    rows = torch.randint(0, DENSE.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    per = BATCH // data_size
    mine = rows[data_rank * per : (data_rank + 1) * per]
    return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO)]


def first_step(model_name: str, layout: dict, save_to: str | None) -> dict:
    """On every rank of one layout: the first step's loss (averaged like a run's) and every held
    parameter's full gradient after the product's sums (dp/cp/ep sync, tp partial sums)."""
    from nanotrain.checkpoint import save_checkpoint
    from nanotrain.parallel.data_parallel import build_grad_sync
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.parallel.pipeline_parallel import PipelineEngine
    from nanotrain.parallel.tensor_parallel import allreduce_sequence_parallel_grads_
    from nanotrain.training.step import forward_backward, reduce_loss

    tp, pp, cp, ep = (layout.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    pc = ParallelContext(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, context_parallel_size=cp, expert_parallel_size=ep
    )
    model = build_llama(
        MODELS[model_name],
        pc.tp_pg,
        mode=layout.get("mode", "ALL_REDUCE"),
        pp_rank=pc.pp_rank,
        pp_size=pp,
        seed=SEED,
        cp_pg=pc.cp_pg,
        ep_pg=pc.ep_pg,
    )
    set_options_(model)
    sync = build_grad_sync(list(model.parameters()), pc)
    micro = microbatches(pc.data_rank, pc.data_size)
    model.begin_step(len(micro))
    if pp > 1:
        engine = PipelineEngine("afab", pc.pp_pg)
        loss = engine.forward_backward(model, micro, sync, model.pipeline_message(MICRO, SEQ))
        del engine
    else:
        loss = forward_backward(model, micro, sync)
    sync.finish_grad_sync()
    allreduce_sequence_parallel_grads_(model.sequence_parallel_params(), pc.tp_pg)
    summed = {id(p) for p in model.sequence_parallel_params()}
    out = {
        "loss": float(reduce_loss(loss, pc)),
        "grads": {
            n: gather_full(p.grad, get_shard_info(p), pc.ep_pg if get_shard_info(p).axis == "ep" else pc.tp_pg)
            for n, p in model.named_parameters()
        },
        "summed_over_tp": sorted(n for n, p in model.named_parameters() if id(p) in summed),
    }
    if save_to is not None:
        save_checkpoint(save_to, 1, model, pc=pc)
    del model, sync, loss
    pc.destroy()
    return out


def parallel_first_steps(runs: list[tuple[str, str]], save_to: str) -> dict:
    """Every (model, layout) of ``runs`` in turn on these two ranks, one process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return {run: first_step(run[0], LAYOUTS[run[1]], save_to if run == SAVED else None) for run in runs}


def one_process(model_name: str) -> tuple[dict, dict, float]:
    """(full gradients, parameters, loss) of the first step in one process, on the whole batch."""
    model = build_llama(MODELS[model_name], None, seed=SEED)
    set_options_(model)
    micro = microbatches(0, 1)
    model.begin_step(len(micro))
    loss = 0.0
    for ids, targets in micro:
        part = model(ids, targets) / len(micro)
        part.backward()
        loss += part.item()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.grad.clone() for n, p in model.named_parameters()}, params, loss


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    save_to = tmp_path_factory.mktemp("options-ckpt")
    ranks = run_distributed(parallel_first_steps, 2, RUNS, str(save_to), timeout=120)
    return ranks, save_to


@pytest.mark.timeout(180)
@pytest.mark.parametrize("model_name", MODELS)
def test_every_layout_equals_one_process(model_name, launched):
    ranks, _ = launched
    grads, _, loss = one_process(model_name)
    failures = []
    for run in [r for r in RUNS if r[0] == model_name]:
        held = set()
        for rank, results in enumerate(ranks):
            got = results[run]
            if abs(got["loss"] - loss) > 1e-6 * abs(loss):
                failures.append(f"{run} rank {rank}: loss {got['loss']} != {loss}")
            for name, g in got["grads"].items():
                held.add(name)
                err = (g - grads[name]).abs().max().item()
                if err > 1e-7 + 1e-5 * grads[name].abs().max().item():
                    failures.append(f"{run} rank {rank} {name}: max abs err {err:.2e}")
        assert held == set(grads), (run, set(grads) ^ held)
    assert not failures, "\n".join(failures)
    assert all(grads[n].abs().max() > 0 for n in grads if "norm" in n or n.endswith(".bias")), "an option unused"


def test_qk_norms_are_summed_over_tp_in_both_modes(launched):
    """Under ALL_REDUCE only the q/k norms hold partial gradients; under REDUCE_SCATTER every norm
    does (the q/k ones marked once, not twice: the gradients above would be doubled)."""
    ranks, _ = launched
    qk = {n for n in one_process("dense")[0] if n.endswith(("q_norm.weight", "k_norm.weight"))}
    assert set(ranks[0][("dense", "tp2")]["summed_over_tp"]) == qk
    assert qk < set(ranks[0][("dense", "tp2-sp")]["summed_over_tp"])


def test_checkpoint_of_tp2_holds_the_one_process_tensors(launched):
    from nanotrain.checkpoint.reshard import read_full_state

    _, save_to = launched
    _, params, _ = one_process("dense")
    _, saved, _ = read_full_state(save_to)  # the latest complete checkpoint
    assert saved.keys() == params.keys()
    for name, p in params.items():
        assert torch.equal(saved[name], p), name


# ----------------------------------------------------------------------------- what they change
def _logits(args: ModelArgs, ids: torch.Tensor) -> torch.Tensor:
    model = build_llama(args, None, seed=SEED)
    set_options_(model)
    with torch.no_grad():
        return model(ids)


IDS = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(9))


def test_no_rope_layers_rotate_nothing():
    """A model with every layer in no_rope_layers does not depend on rope_theta; one with a single
    no-RoPE layer does, and differs from the all-rotating model."""
    plain = dataclasses.replace(DENSE, no_rope_layers=[])
    none = dataclasses.replace(DENSE, no_rope_layers=[0, 1, 2])
    theta = lambda a: dataclasses.replace(a, rope_theta=123.0)  # noqa: E731
    assert torch.equal(_logits(none, IDS), _logits(theta(none), IDS))
    assert not torch.allclose(_logits(DENSE, IDS), _logits(theta(DENSE), IDS))
    assert not torch.allclose(_logits(DENSE, IDS), _logits(plain, IDS))


def test_fresh_biases_are_zero_and_norms_one():
    """A fresh qkv_bias model computes what the bias-free one does; q/k norms start at 1 but still
    normalise (the function differs from the model without them)."""
    model = build_llama(DENSE, None, seed=SEED)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert not p.any(), name
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            assert torch.equal(p, torch.ones_like(p)), name
    no_bias = build_llama(dataclasses.replace(DENSE, qkv_bias=False), None, seed=SEED)
    with torch.no_grad():
        assert torch.equal(model(IDS), no_bias(IDS))
        assert not torch.allclose(
            model(IDS), build_llama(dataclasses.replace(DENSE, qk_norm=False), None, seed=SEED)(IDS)
        )


def test_norm_topk_prob():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits, -1)
    kept = moe_module.route(logits, 2, None, norm_topk_prob=False)
    renormed = moe_module.route(logits, 2, None)
    top = probs.topk(2, -1).values.t().reshape(-1)[kept.order]
    torch.testing.assert_close(kept.weights, top, rtol=0, atol=0)
    torch.testing.assert_close(renormed.weights, top / probs.topk(2, -1).values.sum(-1).repeat(2)[kept.order])
    on = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, norm_topk_prob=True))
    assert not torch.allclose(_logits(MOE, IDS), _logits(on, IDS))


def test_float64_model_routes_in_float64(monkeypatch):
    """The router's logits, the weights and the combined output of a float64 model stay float64:
    the MoE layer equals its formula in float64 to 1e-12 (an fp32 router would be ~1e-7 off)."""
    seen = []
    route = moe_module.route
    monkeypatch.setattr(moe_module, "route", lambda logits, *a: seen.append(logits.dtype) or route(logits, *a))
    model = build_llama(MOE, None, seed=SEED).double()
    layer = model.inner.layers["0"].mlp
    x = torch.randn(SEQ, 2, MOE.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out = layer(x)
    assert seen == [torch.float64] and out.dtype == torch.float64
    tokens = x.reshape(-1, MOE.hidden_size)
    w, e = torch.softmax(tokens @ layer.router.weight.t(), -1).topk(MOE.moe.top_k, -1)
    expected = torch.zeros_like(tokens)
    for k in range(MOE.moe.top_k):
        gate, up = torch.einsum("th,tfh->tf", tokens, layer.experts.gate_up.weight[e[:, k]]).chunk(2, -1)
        y = torch.einsum("tf,thf->th", torch.nn.functional.silu(gate) * up, layer.experts.down.weight[e[:, k]])
        expected += w[:, k, None] * y
    torch.testing.assert_close(out.reshape(-1, MOE.hidden_size), expected, rtol=0, atol=1e-12)
    out.sum().backward()
    assert layer.router.weight.grad.dtype == torch.float64


# ----------------------------------------------------------------------------- refusals
BAD = [
    ("window-short", ["model.family=mistral", "model.sliding_window=8"], ["model.sliding_window (8)", "set it to 64"]),
    ("no-rope-range", ["model.family=smollm3", "model.no_rope_layers=[4]"], ["model.no_rope_layers[0]: 4", "0 .. 3"]),
    ("no-rope-twice", ["model.family=smollm3", "model.no_rope_layers=[2,2]"], ["model.no_rope_layers[1]", "twice"]),
    ("qk-norm-llama", ["model.qk_norm=true"], ["model.qk_norm: true", "model.family llama", "model.family: qwen3"]),
    ("bias-qwen3", ["model.family=qwen3", "model.qkv_bias=true"], ["model.qkv_bias", "qwen3", "model.family: qwen2"]),
    (
        "window-llama",
        ["model.sliding_window=64"],
        ["model.sliding_window (64)", "llama", "mistral or qwen2 or qwen3 or smollm3"],
    ),
    ("moe-qwen2", ["model.family=qwen2", "model.moe.num_experts=4"], ["model.moe", "qwen2", "has no experts"]),
    ("qwen3-moe-dense", ["model.family=qwen3_moe"], ["model.family qwen3_moe needs a model.moe", "qwen3"]),
    ("mixtral-dense", ["model.family=mixtral"], ["model.family mixtral needs a model.moe", "mistral"]),
    (
        "mixtral-shared",
        ["model.family=mixtral", "model.moe.num_experts=4", "model.moe.num_shared_experts=1"],
        ["model.moe.num_shared_experts (1)", "mixtral", "set it to 0"],
    ),
    ("odd-head-dim", ["model.family=qwen3", "model.head_dim=7"], ["model.head_dim (7) must be even"]),
]


@pytest.mark.parametrize("sets, fragments", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_option_is_one_error_line(sets, fragments, tmp_path, capsys):
    from helpers.cli import dry_run_error_line  # the command line: imported here, not by every rank

    line = dry_run_error_line(TINY, sets, tmp_path, capsys)
    for fragment in fragments:
        assert fragment in line, (fragment, line)


GOOD = {
    "llama+moe": dict(moe=MoEArgs(num_experts=4, num_shared_experts=1), rope_scaling=None),
    "mistral": dict(family="mistral", sliding_window=64),
    "qwen2": dict(family="qwen2", qkv_bias=True, sliding_window=4096, tie_word_embeddings=True),
    "qwen3": dict(family="qwen3", qk_norm=True, head_dim=64),
    "smollm3": dict(family="smollm3", no_rope_layers=[3]),
    "mixtral": dict(family="mixtral", moe=MoEArgs(num_experts=4), sliding_window=64),
    "qwen3_moe": dict(family="qwen3_moe", moe=MoEArgs(num_experts=4, norm_topk_prob=False), qk_norm=True, head_dim=8),
    "llama head_dim = hidden/heads": dict(head_dim=32),
}


@pytest.mark.parametrize("name", GOOD)
def test_each_family_takes_its_options(name):
    model = ModelArgs(hidden_size=128, num_attention_heads=4, max_position_embeddings=64, **GOOD[name])
    validate(Config(model=model, training=TrainingArgs(sequence_length=64)))
