"""The rank side of tests/test_hf.py, in a module without transformers (every rank imports it:
transformers alone would cost each of 8 ranks seconds of start-up)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotrain.checkpoint import save_checkpoint
from nanotrain.config import Config, ModelArgs, OptimizerArgs, ParallelismArgs
from nanotrain.hf.import_weights import load_hf_weights
from nanotrain.optim import build_lr_scheduler, build_optimizer
from nanotrain.parallel.data_parallel import build_grad_sync
from nanotrain.training.builder import build_engine, build_model, build_parallel_context
from nanotrain.training.step import train_step

# GQA + untied: the shape of configs/tiny_cpu.yaml, with a rope_theta and eps that are not the
# defaults of either side (a field that is not carried over changes the numbers).
GQA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=256,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=500000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MHA = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    rope_theta=20000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
SEQ, BATCH = 16, 4
LAYOUTS4 = [dict(dp=2, tp=2), dict(dp=2, pp=2), dict(cp=2, tp=2)]
LAYOUT8 = dict(dp=2, tp=2, pp=2)


def batch() -> torch.Tensor:
    """The fixed batch: [BATCH, SEQ + 1] random byte ids."""
    return torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))


def first_step_losses(
    hf_dirs: dict, layouts: list[dict], train_dir: str | None, models: dict | None = None, ids=None
) -> dict:
    """On every rank: for each layout and model, import and take one lr-0 step on ``ids``
    (default ``batch()``, [BATCH, S + 1]); with ``train_dir`` also train the GQA model 3 steps
    (ZeRO-1) and save a checkpoint there. ``models``: name -> ``ModelArgs`` fields, the
    directories ``hf_dirs[name]`` (default ``{"gqa": GQA, "mha": MHA}``)."""
    dist.init_process_group("gloo")
    out = {}
    for layout in layouts:
        for name, model in (models or {"gqa": GQA, "mha": MHA}).items():
            config = Config(parallelism=ParallelismArgs(**layout), model=ModelArgs(**model, dtype="float32"))
            training = train_dir is not None and name == "gqa"
            config.optimizer = OptimizerArgs(
                lr=1e-2 if training else 0.0, min_lr=0.0, weight_decay=0.0, zero_stage=1 if training else 0
            )
            pc = build_parallel_context(config)
            m = build_model(config, pc)
            load_hf_weights(hf_dirs[name], m, config.model)
            engine = build_engine(config, pc)
            sync = build_grad_sync(list(m.parameters()), pc)
            opt = build_optimizer(m.named_parameters(), config.optimizer, pc.dp_cp_pg)
            sched = build_lr_scheduler(opt, config.optimizer, 10)
            rows = batch() if ids is None else ids
            per = rows.shape[0] // pc.dp_size
            mine = rows[pc.dp_rank * per : (pc.dp_rank + 1) * per]
            micro = [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(1)]
            losses = [
                train_step(m, micro, sync, opt, sched, pc, None, engine=engine).loss
                for _ in range(3 if training else 1)
            ]
            out[(str(layout), name)] = losses[0]
            if training:
                save_checkpoint(train_dir, 3, m, opt, sched, pc, extra={"consumed_samples": 0}, config=config)
            del m, engine, sync, opt, sched
            pc.destroy()
    return out  # every rank has the losses (averaged over dp, sent along pp)
