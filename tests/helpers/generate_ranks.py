"""Checkpoints of Hugging Face directories imported at a topology, for tests/test_generate.py: the
same weights saved by one process and by 8 ranks, which ``scripts/generate.py`` must decode alike.

A module without transformers (each of 8 ranks imports it)."""

from __future__ import annotations

from pathlib import Path

from nanotrain.config import config_from_dict
from nanotrain.hf.directory import hf_family, open_hf_dir


def imported_config(hf_dir: Path, layout: dict):
    """The run config of ``hf_dir``'s ``model:`` section (as ``scripts/hf_config.py`` prints it),
    float32, at ``layout`` (``parallelism`` fields), byte tokenizer."""
    hf = open_hf_dir(hf_dir)
    section = hf_family(hf, hf_dir).hf.model_section(hf.config)
    micro = layout.get("pp", 1)  # the pipeline needs at least pp micro-batches
    return config_from_dict(
        {
            "model": {**section, "dtype": "float32"},
            "parallelism": layout,
            "training": {"sequence_length": 32, "batch_accumulation_per_replica": micro},
        }
    )


def save_imported(jobs: list[tuple[str, dict, str]], ranks: bool = True) -> None:
    """On every rank (``ranks`` False: in this process, layouts all ones): for each job
    ``(hf_dir, layout, root)``, ``hf_dir`` imported at ``layout`` and saved, weights only, as
    ``root/step_000001`` with its config."""
    import torch.distributed as dist

    from nanotrain.checkpoint import save_checkpoint
    from nanotrain.hf.import_weights import load_hf_weights
    from nanotrain.training.builder import build_model, build_parallel_context

    if ranks:
        dist.init_process_group("gloo")
    for hf_dir, layout, root in jobs:
        config = imported_config(Path(hf_dir), layout)
        pc = build_parallel_context(config) if ranks else None
        model = build_model(config, pc)
        load_hf_weights(hf_dir, model, config.model)
        save_checkpoint(root, 1, model, None, None, pc, config=config)
        del model  # it holds the groups: destroyed only once nothing does
        if pc is not None:
            pc.destroy()
