"""A checkpoint, at whatever topology it was saved, as the plain single-device model of its
``model.family`` (what ``scripts/generate.py`` decodes with): one process, no process group.

Each parameter of the plain model is merged from its saved tp/pp/ep/ZeRO shards by the slice
metadata (``assemble.assemble_full``, as the HF export and offline resharding merge them), after
every model file's bytes are checked against the checkpoint's sha256s; the optimizer states are
not read. The model is built on the meta device and given storage on the target device once,
so a large model is never initialised only to be overwritten.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from nanotrain.checkpoint import format as fmt
from nanotrain.checkpoint.assemble import ShardReader, assemble_full
from nanotrain.checkpoint.format import CheckpointError
from nanotrain.config import ModelArgs, config_from_dict
from nanotrain.models.family import family_of
from nanotrain.parallel.part import placement


def inference_args(meta: dict) -> ModelArgs:
    """The checkpoint's ``model`` section, with an MoE layer's ``capacity_factor`` off: dropping
    tokens past an expert's capacity depends on how many tokens a forward holds (a prompt at
    once, then one at a time), so decoding routes every token to its top-k experts, as
    ``transformers`` (which has no capacity) does on the export."""
    args = config_from_dict({"model": meta["config"]["model"]}).model
    if args.moe is not None and args.moe.capacity_factor is not None:
        args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, capacity_factor=None))
    return args


def load_plain_model(ckpt: Path, meta: dict, dtype: torch.dtype = torch.float32, device="cpu") -> torch.nn.Module:
    """The plain model (``family.build``) of checkpoint ``ckpt`` (``meta``: its meta.json), every
    parameter assembled from the saved shards, in ``dtype`` on ``device``, in eval mode.

    Raises:
        CheckpointError: a model file damaged, a parameter missing from the index, or saved
            with another shape than the config's model has.
    """
    ckpt = Path(ckpt)
    args = inference_args(meta)
    files = [(rel, rec) for rel, rec in meta["files"].items() if rel.startswith("model/")]
    bad = [p for rel, rec in files if (p := fmt.verify_file(ckpt, rel, rec))]
    if bad:
        raise CheckpointError(f"{ckpt} is damaged: " + "; ".join(bad))
    with placement.on_meta():
        model = family_of(args).build(args).to(dtype)
    placement.materialize_(model, device)  # in ``dtype`` at once; tied weights stay one tensor
    index = meta["index"]["model"]
    reader = ShardReader(ckpt)
    try:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name not in index:
                    raise CheckpointError(f"{ckpt}: no parameter {name!r} in the checkpoint")
                full = assemble_full(reader, name, index[name])
                if tuple(full.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{ckpt}: {name} saved as {list(full.shape)}, the config's model has {list(param.shape)}"
                    )
                param.copy_(full)
    finally:
        reader.close()
    return model.eval()
