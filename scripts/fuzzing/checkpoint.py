"""A tiny one-process checkpoint (2 layers, 4 heads, 2 KV heads, dense) for the export and reshard
cases: written once per fuzz run in well under a second once torch is imported."""

from __future__ import annotations

from pathlib import Path

MODEL = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    dtype="float32",
)


def save_tiny(root: Path) -> Path:
    """`root/step_000001` (+ `latest`) of a fresh tiny model, its AdamW and scheduler, with its
    config stored (so it can be resharded); returns the step directory."""
    from nanotrain.checkpoint import save_checkpoint
    from nanotrain.config import Config, ModelArgs, OptimizerArgs
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer

    config = Config(model=ModelArgs(**MODEL), optimizer=OptimizerArgs())
    model = build_llama(config.model, None, seed=0)
    opt = build_optimizer(model.named_parameters(), config.optimizer, zero_stage=0)
    sched = build_lr_scheduler(opt, config.optimizer, 10)
    return Path(save_checkpoint(root, 1, model, opt, sched, None, extra={"consumed_samples": 0}, config=config))


def export_tiny_hf(ckpt: Path, out: Path) -> None:
    """`out`: the checkpoint as a Hugging Face Llama directory (config.json + safetensors)."""
    from nanotrain.hf.export import export_hf

    export_hf(ckpt, out)
