"""The model's arithmetic (``nanotrain/models/llama_arch.py``) agrees with the model it describes:
the parameters of every (tp rank, pp rank) equal the real model part's, the stage split is the
one the pipeline step keeps, and the config -> plan mapping carries every field. In one process:
``build_llama`` with ``pp_rank`` / ``pp_size`` builds one stage, and a stand-in group with
``size()`` / ``rank()`` gives it one tp rank's shards."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from nanotrain.config import Config, ModelArgs, ParallelismArgs, TrainingArgs
from nanotrain.estimate.memory import stage_parameters as estimated_stage_parameters
from nanotrain.models import llama_arch
from nanotrain.models.family import LLAMA
from nanotrain.models.llama_parallelize import build_llama, plan_from_config
from nanotrain.parallel.grid import GroupShape
from nanotrain.parallel.tensor_parallel import TensorParallelLinearMode

ARGS = ModelArgs(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
)


def _model(args: ModelArgs, tp: int, tp_rank: int, pp: int, pp_rank: int, v: int) -> torch.nn.Module:
    return build_llama(args, GroupShape(tp, tp_rank), pp_rank=pp_rank, pp_size=pp, virtual_stages=v)


# (tp, pp, virtual stages, tied, vocab): vocab 259 and 257 are not multiples of tp (padded rows);
# vocab 640 makes the head cost ~2 layers, so the split moves layers off the last stage.
LAYOUTS = [
    (1, 1, 1, False, 256),
    (1, 1, 1, True, 259),
    (2, 1, 1, False, 259),
    (4, 1, 1, True, 258),
    (1, 2, 1, True, 256),
    (2, 2, 1, False, 259),
    (2, 3, 1, True, 259),
    (1, 4, 1, False, 640),
    (2, 2, 2, True, 259),
    (4, 2, 2, False, 257),
]


@pytest.mark.parametrize("tp,pp,v,tied,vocab", LAYOUTS)
def test_parameters_per_stage_equal_the_model(tp, pp, v, tied, vocab):
    args = replace(ARGS, vocab_size=vocab, tie_word_embeddings=tied)
    stages = llama_arch.stage_blocks(args, pp, v)
    placed = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            model = _model(args, tp, tp_rank, pp, pp_rank, v)
            numel = sum(p.numel() for p in model.parameters())
            assert llama_arch.stage_parameters(args, tp, pp, pp_rank, v) == numel, (pp_rank, tp_rank)
        placed.update({name: chunk.virtual_stage for chunk in model.chunks for name in chunk.blocks})
    # The split llama_arch computes is the one the model built.
    assert placed == {name: s for s, names in enumerate(stages) for name in names}
    if tp == 1:  # the stages hold the whole model once, plus the tied embedding's replica
        replica = llama_arch.block_parameters(args, "embed") if tied and pp > 1 else 0
        total = sum(llama_arch.stage_parameters(args, 1, pp, r, v) for r in range(pp))
        assert total == llama_arch.parameter_count(args).total + replica


def test_heavy_head_moves_layers_off_the_last_stage():
    stages = llama_arch.stage_blocks(replace(ARGS, vocab_size=640), pp=4)
    layers = [sum(name.startswith("layers.") for name in stage) for stage in stages]
    assert sum(layers) == 6 and layers[-1] < max(layers)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_memory_estimate_counts_the_same_parameters(tp, tied):
    """At pp = 1 the estimate's busiest rank is the whole model's tp shard."""
    args = replace(ARGS, vocab_size=259, tie_word_embeddings=tied)
    config = Config(parallelism=ParallelismArgs(tp=tp), model=args)
    assert estimated_stage_parameters(config) == (llama_arch.stage_parameters(args, tp), args.num_layers)


def test_unshardable_layer_is_refused():
    """Not a count of a model that cannot be built: the tp linears refuse uneven shards too."""
    args = replace(ARGS, intermediate_size=130)
    with pytest.raises(ValueError, match="intermediate_size"):
        llama_arch.layer_parameters(args, tp=4)
    with pytest.raises(ValueError):
        _model(args, 4, 0, 1, 0, 1)


def test_the_plan_carries_the_config():
    config = Config(
        parallelism=ParallelismArgs(
            tp=2,
            pp=2,
            pp_engine="interleaved_1f1b",
            pp_virtual_stages=2,
            tp_mode="REDUCE_SCATTER",
            tp_linear_async_communication=True,
        ),
        model=replace(ARGS, dtype="bfloat16"),
        training=TrainingArgs(seed=11),
    )
    pc = SimpleNamespace(tp_pg=GroupShape(2, 1), pp_rank=1, pp_size=2, cp_pg=None, ep_pg=None)
    plan = plan_from_config(config, pc)
    model = LLAMA.build_part(config, pc)
    assert plan.seed == 11 and plan.tp_pg is pc.tp_pg and model.args is config.model
    assert model.mode is TensorParallelLinearMode.REDUCE_SCATTER and model.async_communication
    assert model.compute_dtype is torch.bfloat16 and len(model.chunks) == 2
    assert sum(p.numel() for p in model.parameters()) == llama_arch.stage_parameters(config.model, 2, 2, 1, 2)
    single = plan_from_config(Config(model=ARGS))  # no context: one process
    assert (single.tp_pg, single.pp_rank, single.pp_size, single.cp_pg) == (None, 0, 1, None)
