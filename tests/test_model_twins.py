"""The torch-free arithmetic (``llama_arch``, ``llama_parallelize_costs``) that ``--dry-run``,
``--plan`` and the memory estimate use equals the numbers read from the module itself, exactly,
over a grid of shapes (GQA and MHA, tied and untied, padded vocabularies, dense and MoE with
shared experts, leading dense layers and a layer frequency, a head_dim apart from hidden / heads
with qkv biases and q/k norms) and layouts (tp, pp, virtual stages,
ep): the whole model's parameters, each rank's parameters and routed experts, the model FLOPs
behind MFU, and the FLOPs each recompute mode adds (HFU). All on the meta device: no storage."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nanotrain.config import Config, ModelArgs, MoEArgs, TrainingArgs
from nanotrain.models import llama_arch, llama_counts, llama_parallelize_costs
from nanotrain.models.llama import LlamaModel
from nanotrain.models.llama_parallelize import build_llama, flops_per_token
from nanotrain.parallel.grid import GroupShape

SEQ = 48
BASE = ModelArgs(
    vocab_size=259,
    hidden_size=48,
    intermediate_size=136,
    num_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
)
SHAPES = {
    "gqa": BASE,
    "gqa-tied": replace(BASE, tie_word_embeddings=True),
    "mha": replace(BASE, num_key_value_heads=None, vocab_size=256, num_attention_heads=4),
    "moe-shared": replace(
        BASE,
        moe=MoEArgs(num_experts=4, top_k=2, num_shared_experts=1, first_dense_layers=1, expert_intermediate_size=40),
    ),
    "moe-sparse": replace(BASE, tie_word_embeddings=True, moe=MoEArgs(num_experts=8, top_k=1, layer_frequency=2)),
    # the Hugging Face families' options: heads of their own width (6 x 12 = 72 query features
    # for a hidden size of 48), q/k/v biases (split over tp), per-head q/k norms (replicated)
    "options": replace(BASE, head_dim=12, qkv_bias=True, qk_norm=True, no_rope_layers=[1]),
    "moe-options": replace(
        BASE, head_dim=6, qkv_bias=True, qk_norm=True, moe=MoEArgs(num_experts=4, top_k=2, norm_topk_prob=False)
    ),
}
# (tp, pp, virtual stages, ep); the MoE shapes take ep > 1
LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 2, 1), (1, 1, 1, 2), (2, 2, 1, 2), (1, 3, 1, 4)]


def _meta_model(args: ModelArgs) -> LlamaModel:
    with torch.device("meta"):
        return LlamaModel(args)


@pytest.mark.parametrize("shape", SHAPES)
def test_whole_model_counts_and_flops(shape):
    args = SHAPES[shape]
    model = _meta_model(args)
    assert llama_arch.parameter_count(args).total == llama_counts.total_parameters(model)
    assert llama_arch.training_flops_per_token(args, SEQ) == llama_counts.training_flops_per_token(model, SEQ)
    for mode in ("none", "selective", "full"):
        config = Config(model=args, training=TrainingArgs(sequence_length=SEQ, recompute=mode))
        model_flops, hardware = flops_per_token(config)
        assert model_flops == llama_arch.training_flops_per_token(args, SEQ)
        assert hardware == llama_parallelize_costs.hardware_flops_per_token(args, SEQ, mode), mode


@pytest.mark.parametrize(
    "shape,tp,pp,v,ep",
    [(shape, *layout) for shape, args in SHAPES.items() for layout in LAYOUTS if layout[3] == 1 or args.moe],
)
def test_each_rank_holds_what_the_arithmetic_counts(shape, tp, pp, v, ep):
    args = SHAPES[shape]
    summaries = llama_arch.rank_summaries(args, pp, v)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                part = build_llama(
                    args,
                    GroupShape(tp, tp_rank),
                    pp_rank=pp_rank,
                    pp_size=pp,
                    virtual_stages=v,
                    ep_pg=GroupShape(ep, ep_rank) if ep > 1 else None,
                    initialize=False,
                )
                held = llama_counts.total_parameters(part)
                routed = sum(p.numel() for name, p in part.named_parameters() if ".mlp.experts." in name)
                where = (pp_rank, tp_rank, ep_rank)
                assert llama_arch.stage_parameters(args, tp, pp, pp_rank, v, ep) == held, where
                assert llama_arch.rank_parameters(args, summaries[pp_rank], tp, ep) == (held, routed), where
