"""Export a nanotrain checkpoint, at whatever topology it was saved, as a Hugging Face directory
of its ``model.family``.

    python scripts/export_hf.py logs/<run> OUT_DIR [--dtype bfloat16|float32] [--max-shard-size 5GB]

OUT_DIR gets what ``AutoModelForCausalLM.from_pretrained`` (the family's class: LlamaForCausalLM,
MistralForCausalLM, Qwen2/Qwen3/SmolLM3/Mixtral/Qwen3MoeForCausalLM) and
``AutoTokenizer.from_pretrained`` read: config.json, generation_config.json, model.safetensors
(or, above ``max_shard_size``, ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``),
tokenizer.json and tokenizer_config.json. Nothing of transformers is imported: safetensors and
JSON only.

Streaming: the output files' headers are computed from the checkpoint's index first (every
shape is known), then one nanotrain tensor at a time is merged from its tp/pp/ep shards by the
slice metadata (``assemble.assemble_full``, as resharding does), split into its HF tensors
(the family's ``pieces``: an expert stack into one tensor per expert and projection, the layout
``save_pretrained`` writes), cast and appended to the open file. The source files are opened per
tensor and closed after it, so peak memory is about one full tensor (the embedding, or an MoE
layer's expert stack), not the model (benchmarks/hf_io.py measures it). Only the model files are
read: the optimizer states are left alone, and every byte read is checked against the
checkpoint's sha256s first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from nanotrain.checkpoint import format as fmt
from nanotrain.checkpoint.assemble import ShardReader, assemble_full
from nanotrain.checkpoint.format import CheckpointError
from nanotrain.checkpoint.offline_checks import (  # noqa: F401 (re-exported: the script's names)
    DEFAULT_MAX_SHARD,
    DTYPES,
    parse_size,
    plan_export,
    source_checkpoint,
)
from nanotrain.config import ModelArgs, config_from_dict
from nanotrain.config.atomic_files import atomic_write
from nanotrain.config.files import removed_on_failure
from nanotrain.data.hf_tokenizer import export_tokenizer
from nanotrain.hf.directory import INDEX, SINGLE
from nanotrain.models.family import family_of
from nanotrain.models.hf_mapping import nanotrain_names


def _plan(args: ModelArgs, max_shard: int, itemsize: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """HF tensors in order, packed greedily into files of at most ``max_shard`` bytes."""
    files, size = [[]], 0
    for name, shape in family_of(args).hf.hf_shapes(args).items():
        nbytes = itemsize * int(torch.Size(shape).numel())
        if files[-1] and size + nbytes > max_shard:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += nbytes
    return files


def _tensors(ckpt: Path, meta: dict, args: ModelArgs, dtype: torch.dtype):
    """(HF name, tensor) in ``hf_shapes`` order, one nanotrain tensor in memory at a time."""
    index = meta["index"]["model"]
    for name in nanotrain_names(args):
        if name not in index:
            raise CheckpointError(f"{ckpt}: no parameter {name!r} in the checkpoint")
        reader = ShardReader(ckpt)
        full = assemble_full(reader, name, index[name])
        reader.close()
        for piece in family_of(args).hf.pieces(name, args):
            rows = full if piece.lead is None else full[piece.lead]
            yield piece.hf_name, rows[piece.start : piece.stop].to(dtype).contiguous()
        del full


def _write_file(path: Path, entries: list[tuple[str, tuple[int, ...]]], st_dtype: str, itemsize: int, stream) -> int:
    """One safetensors file: the header from the planned shapes, then each tensor's bytes as the
    stream yields it (checked against the plan). Returns the bytes of tensor data written."""
    head, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in entries:
        n = itemsize * int(torch.Size(shape).numel())
        head[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n

    def write(f) -> None:
        f.write(fmt.safetensors_prefix(head))
        for name, shape in entries:
            got, tensor = next(stream)
            if got != name or tuple(tensor.shape) != tuple(shape):
                raise CheckpointError(f"export: expected {name} {list(shape)}, got {got} {list(tensor.shape)}")
            f.write(fmt._raw(tensor))

    atomic_write(path, write)
    return offset


def export_hf(
    src: str | Path, out_dir: str | Path, dtype: str = "float32", max_shard_size: int = DEFAULT_MAX_SHARD
) -> dict:
    """Write a nanotrain checkpoint out as a Hugging Face directory of its ``model.family``
    (weights, config.json, generation config, tokenizer), shards merged; one process, any saved
    topology.

    Args:
        src: a run directory or checkpoint directory (its ``latest`` complete checkpoint).
        out_dir: the directory to write; it must not hold, be or lie inside the checkpoint.
        dtype: the written weights' dtype (``float32``, ``bfloat16``: the names of ``format.DTYPES``).
        max_shard_size: bytes per weight file before another is started (with an index).

    Returns:
        ``{"checkpoint", "files", "bytes", "seconds"}``.

    Raises:
        CheckpointError: a wrong source, output or dtype, a model its family's config.json
            cannot describe (``offline_checks.plan_export``, before anything is written), or a damaged
            checkpoint. A failure after writing began removes what this call made: ``out_dir``
            itself if it did not exist, else the files it added.
    """
    t0 = time.perf_counter()
    ckpt, meta = plan_export(src, out_dir, dtype)
    config = meta["config"]
    args = config_from_dict({"model": config["model"]}).model  # sub-sections (rope_scaling) as dataclasses
    bad = [
        p for rel, rec in meta["files"].items() if rel.startswith("model/") and (p := fmt.verify_file(ckpt, rel, rec))
    ]
    if bad:
        raise CheckpointError(f"{ckpt} is damaged: " + "; ".join(bad))
    out = Path(out_dir)
    with removed_on_failure(out):
        out.mkdir(parents=True, exist_ok=True)
        names, total = _write(ckpt, meta, args, dtype, max_shard_size, out)
    return {"checkpoint": str(ckpt), "files": names, "bytes": total, "seconds": time.perf_counter() - t0}


def _write(
    ckpt: Path, meta: dict, args: ModelArgs, dtype: str, max_shard_size: int, out: Path
) -> tuple[list[str], int]:
    """The weight files, tokenizer and configs into ``out``; returns (weight files, bytes)."""
    config = meta["config"]
    torch_dtype = fmt.DTYPES[dtype]
    st_dtype = fmt._ST_DTYPES[torch_dtype]
    itemsize = torch.tensor([], dtype=torch_dtype).element_size()
    plan = _plan(args, max_shard_size, itemsize)
    stream = _tensors(ckpt, meta, args, torch_dtype)
    total, names = 0, []
    for k, entries in enumerate(plan):
        name = SINGLE if len(plan) == 1 else f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
        total += _write_file(out / name, entries, st_dtype, itemsize, stream)
        names.append(name)
    if len(plan) > 1:
        weight_map = {t: f for f, entries in zip(names, plan) for t, _ in entries}
        (out / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )
    keep = set(names) | ({INDEX} if len(plan) > 1 else set())
    for stale in [out / SINGLE, out / INDEX, *out.glob("model-*-of-*.safetensors")]:
        if stale.name not in keep:
            stale.unlink(missing_ok=True)  # an earlier export's files in the same directory
    tokenizer = (config.get("data") or {}).get("tokenizer", "byte")
    special = export_tokenizer(tokenizer, out, args.max_position_embeddings)
    hf_cfg = family_of(args).hf.hf_config(args, dtype=dtype, **special)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    generation = {
        "bos_token_id": special["bos_token_id"],
        "eos_token_id": special["eos_token_id"],
        "pad_token_id": special["eos_token_id"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / "nanotrain_export.json").write_text(
        json.dumps(
            {
                "checkpoint": str(ckpt),
                "step": meta.get("step"),
                "run_id": meta.get("run_id"),
                "topology": meta.get("topology"),
                "dtype": dtype,
            },
            indent=2,
        )
        + "\n"
    )
    return names, total
