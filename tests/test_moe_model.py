"""MoE model, one process: the same weights in ``transformers.MixtralForCausalLM`` give the same
logits and load-balancing loss; the arithmetic of ``llama_arch`` matches the built model; the
capacity drop rule drops exactly the documented assignments; MoE config errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nanotrain.config import ModelArgs, MoEArgs
from nanotrain.models import llama_arch
from nanotrain.models.llama_parallelize import build_llama
from nanotrain.models.moe import route

MOE = MoEArgs(num_experts=4, top_k=2, aux_loss_coef=0.02, z_loss_coef=0.001)
ARGS = ModelArgs(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    dtype="float32",
    moe=MOE,
)


def _mixtral(args: ModelArgs, ours):
    """A tiny random MixtralForCausalLM loaded with our model's weights (mapped here)."""
    import transformers  # a dev dependency, imported when used (seconds: not at collection)

    kv = args.num_key_value_heads
    hf_config = transformers.MixtralConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=llama_arch.expert_ffn(args),
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=kv,
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.rms_norm_eps,
        num_local_experts=args.moe.num_experts,
        num_experts_per_tok=args.moe.top_k,
        router_aux_loss_coef=args.moe.aux_loss_coef,
        output_router_logits=True,
        tie_word_embeddings=False,
        sliding_window=None,
        attention_dropout=0.0,
    )
    hf_config._attn_implementation = "eager"
    hf = transformers.MixtralForCausalLM(hf_config).eval()
    w = {n: p.detach() for n, p in ours.named_parameters()}
    d = llama_arch.head_dim(args)
    q_out, kv_out = args.num_attention_heads * d, kv * d
    state = {
        "model.embed_tokens.weight": w["embed.weight"],
        "model.norm.weight": w["final_norm.weight"],
        "lm_head.weight": w["lm_head.weight"],
    }
    for i in range(args.num_layers):
        q, k, v = w[f"layers.{i}.attn.qkv.weight"].split([q_out, kv_out, kv_out])
        pre, hf_pre = f"layers.{i}.", f"model.layers.{i}."
        state.update(
            {
                hf_pre + "self_attn.q_proj.weight": q,
                hf_pre + "self_attn.k_proj.weight": k,
                hf_pre + "self_attn.v_proj.weight": v,
                hf_pre + "self_attn.o_proj.weight": w[pre + "attn.o_proj.weight"],
                hf_pre + "input_layernorm.weight": w[pre + "input_norm.weight"],
                hf_pre + "post_attention_layernorm.weight": w[pre + "post_attn_norm.weight"],
                hf_pre + "mlp.gate.weight": w[pre + "mlp.router.weight"],
                hf_pre + "mlp.experts.gate_up_proj": w[pre + "mlp.experts.gate_up.weight"],
                hf_pre + "mlp.experts.down_proj": w[pre + "mlp.experts.down.weight"],
            }
        )
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def test_same_logits_and_load_balancing_loss_as_transformers_mixtral():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    ours = build_llama(ARGS, None, seed=3)
    hf = _mixtral(ARGS, ours)
    ids = torch.randint(0, ARGS.vocab_size, (2, 24))
    ours.begin_step(1)
    with torch.no_grad():
        logits = ours(ids).transpose(0, 1)  # ours are [S, B, V]
        out = hf(input_ids=ids)
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    stats = ours.moe_state.stats
    assert len(stats) == ARGS.num_layers
    for layer, st in enumerate(stats):  # each layer's loss = HF's function of that layer's logits
        expected = load_balancing_loss_func((out.router_logits[layer],), MOE.num_experts, MOE.top_k)
        torch.testing.assert_close(st["aux"], expected, rtol=1e-6, atol=1e-7)
    # Our model-level loss is the mean of the layers' (decomposable over pipeline stages); with a
    # single MoE layer that is exactly HF's aux_loss of the whole model.
    one = dataclasses.replace(ARGS, num_layers=1)
    ours1 = build_llama(one, None, seed=3)
    hf1 = _mixtral(one, ours1)
    ours1.begin_step(1)
    with torch.no_grad():
        ours1(ids)
        out1 = hf1(input_ids=ids)
    torch.testing.assert_close(ours1.moe_state.stats[0]["aux"], out1.aux_loss, rtol=1e-6, atol=1e-7)


def test_aux_losses_reach_the_gradient_with_their_coefficients():
    """d(loss)/d(router) from the injected auxiliary losses equals that of adding them to the loss
    explicitly (micro-batch scale 1/m included)."""
    torch.manual_seed(0)
    ids = torch.randint(0, ARGS.vocab_size, (2, 16))
    a = build_llama(ARGS, None, seed=1)
    a.begin_step(2)
    (a(ids, ids) / 2).backward()
    b = build_llama(ARGS, None, seed=1)
    b.begin_step(1)
    b.moe_state.loss_scale = 0.0  # no injection: add the same terms by hand
    losses = []
    for layer in b.layers.values():
        orig = layer.mlp.forward

        def spy(x, orig=orig, mlp=layer.mlp):
            with torch.autocast("cpu", enabled=False):
                logits = x.reshape(-1, x.shape[-1]) @ mlp.router.weight.t()
            r = route(logits, MOE.top_k, None)
            losses.append(MOE.aux_loss_coef * r.aux + MOE.z_loss_coef * r.z)
            return orig(x)

        layer.mlp.forward = spy
    lm = b(ids, ids)
    ((lm + sum(losses) / len(losses)) / 2).backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_arithmetic_matches_the_built_model():
    shared = dataclasses.replace(
        MOE, num_shared_experts=1, expert_intermediate_size=16, first_dense_layers=1, layer_frequency=2
    )
    args = dataclasses.replace(ARGS, num_layers=4, moe=shared)
    assert llama_arch.moe_layer_indices(args) == [1, 3]
    model = build_llama(args, None)
    count = llama_arch.parameter_count(args)
    assert count.total == sum(p.numel() for p in model.parameters())
    assert count.total == llama_arch.stage_parameters(args)
    # active = total minus the (E - k) routed experts a token does not use, per MoE layer
    unused = 2 * (shared.num_experts - shared.top_k) * 3 * args.hidden_size * 16
    assert count.active == count.total - unused
    dense = dataclasses.replace(args, moe=None)
    assert llama_arch.parameter_count(dense).total == sum(p.numel() for p in build_llama(dense, None).parameters())
    blocks = {b.name: b.cost for b in llama_arch.pipeline_blocks(args)}
    assert blocks["layers.1"] != blocks["layers.0"]
    # FLOPs count active weights only
    flops = llama_arch.training_flops_per_token(args, 16)
    assert flops == 6 * count.matmul + llama_arch.attention_flops_per_token(args, 16)
    # expert shards over ep: the routed experts divide, nothing else does
    e1 = llama_arch.layer_parameters(args, 1, 1, ep=1)
    e2 = llama_arch.layer_parameters(args, 1, 1, ep=2)
    assert e1 - e2 == (shared.num_experts // 2) * 3 * args.hidden_size * 16


def test_capacity_drops_exactly_the_documented_assignments():
    """Hand-built routing: 4 tokens, 2 experts, top-1... then top-2, capacity 1 per expert at
    factor 0.5 (ceil(0.5 * 4 * 1 / 2) = 1): the first token (in order) of each expert is kept."""
    big = 10.0
    # token -> preferred expert: 0, 0, 1, 0
    logits = torch.tensor([[big, 0.0], [big, 0.0], [0.0, big], [big, 0.0]])
    r = route(logits, 1, 0.5)
    kept = sorted((int(a) % 4, e) for e, block in enumerate(r.order.split(r.counts)) for a in block)
    assert kept == [(0, 0), (2, 1)] and r.dropped == 2 and r.counts == [1, 1]
    # top-2, capacity ceil(0.75 * 4 * 2 / 2) = 3 per expert: slot 0 is served before slot 1.
    # Expert 0: first choice of tokens 0, 1, 3 (3 assignments, full), second choice of token 2
    # dropped. Expert 1: first choice of token 2, second choices of tokens 0, 1 kept, of token 3 dropped.
    r2 = route(logits, 2, 0.75)
    kept2 = sorted((int(a) // 4, int(a) % 4, e) for e, block in enumerate(r2.order.split(r2.counts)) for a in block)
    assert kept2 == [(0, 0, 0), (0, 1, 0), (0, 2, 1), (0, 3, 0), (1, 0, 1), (1, 1, 1)]
    assert r2.dropped == 2
    # the kept assignments carry their renormalised top-2 weights (not renormalised after drops)
    w = torch.softmax(logits, -1)
    expected = [float(w[t].max() if slot == 0 else w[t].min()) for slot, t, _ in kept2]
    got = sorted(zip([(int(a) // 4, int(a) % 4) for a in r2.order], r2.weights.tolist()))
    assert [g for _, g in got] == pytest.approx(expected, rel=1e-6)
    # dropless keeps all
    assert route(logits, 2, None).dropped == 0


def test_dry_run_of_the_16gpu_moe_config_counts_total_and_active_parameters(capsys):
    from pathlib import Path

    from nanotrain.commands.cli import main
    from nanotrain.config import load_config
    from nanotrain.estimate.memory import stage_parameters

    path = Path(__file__).resolve().parents[1] / "configs" / "moe_16gpu.yaml"
    assert main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    config = load_config(path)
    count = llama_arch.parameter_count(config.model)
    assert f"total {count.total:,}, active per token {count.active:,}" in out
    assert "each ep rank holds 2 experts per MoE layer" in out and "dp2 x tp1 x pp2 x cp1 x ep4" in out
    # the last stage's rank holds 1/ep of its layers' experts
    held, layers = stage_parameters(config, pp_rank=1)
    m = config.model
    experts = m.moe.num_experts * 3 * m.hidden_size * m.moe.expert_intermediate_size
    last_stage = llama_arch.rank_blocks(m, 2, 1)  # the model's own split: the head costs layers
    assert last_stage[-2:] == ["final_norm", "lm_head"] and layers == len(last_stage) - 2
    assert held == sum(llama_arch.block_parameters(m, n, 1, 4) for n in last_stage)
    assert llama_arch.layer_parameters(m, 1, 0, ep=1) - llama_arch.layer_parameters(m, 1, 0, ep=4) == experts * 3 // 4


def test_capacity_in_the_model_drops_what_the_load_exceeds():
    """A capacity no expert reaches gives the dropless model's logits exactly; a small one drops
    sum_e max(0, load_e - C) assignments per layer, reported as moe/dropped_tokens."""
    from nanotrain.logging.moe_stats import step_scalars

    ids = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = {}
    for factor in (None, 100.0, 0.5):
        model = build_llama(
            dataclasses.replace(ARGS, moe=dataclasses.replace(MOE, capacity_factor=factor)), None, seed=3
        )
        model.begin_step(1)
        with torch.no_grad():
            runs[factor] = (model(ids), model.moe_state)
    assert torch.equal(runs[None][0], runs[100.0][0])
    logits, state = runs[0.5]
    cap = math.ceil(0.5 * 32 * MOE.top_k / MOE.num_experts)
    expected = sum(max(0, int(n) - cap) for st in state.stats for n in st["load"])
    assert expected > 0 and sum(st["dropped"] for st in state.stats) == expected
    assert step_scalars(state, capacity=True)["moe/dropped_tokens"] == expected
    assert not torch.equal(logits, runs[None][0])
