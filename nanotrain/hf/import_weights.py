"""Start a run from a Hugging Face Llama (``checkpoints.init_from_hf``): each rank reads only its slices.

For every parameter of this rank's model (its pipeline stage(s), its tp shards) the ShardInfo says
which rows/columns of the full nanotrain tensor it holds; ``hf_llama.pieces`` says which HF tensor
holds which rows of it. Each (local, global) slice pair is intersected with each piece and read
with safetensors ``safe_open(...).get_slice(...)[rows, cols]``, which copies exactly those bytes
out of the memory-mapped file: no rank materialises a tensor it does not own (a tp rank of the
embedding reads its vocabulary rows, a pp rank only its layers). Values are cast to the
parameter's dtype (fp32 master weights from a bf16 file are exact). Replicas (dp, cp, the tied
embedding's copy on the last stage) read the same bytes, so they start identical without a
broadcast. Rows of a ``model.vocab_size`` larger than the HF vocabulary keep their seeded init.

The optimizer and the step start fresh; the trainer only calls this when the run has no complete
checkpoint of its own, so restarts resume from the run's checkpoints as usual.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors import safe_open

from nanotrain.checkpoint.items import Models, named_params
from nanotrain.config import ModelArgs
from nanotrain.hf.directory import HFDir, check_hf_dir
from nanotrain.models import hf_llama
from nanotrain.parallel.sharding import get_shard_info


def load_hf_weights(path: str | Path, model: Models, args: ModelArgs) -> dict:
    """Fill this rank's parameters of ``model`` from the HF directory ``path``, at any topology
    (each rank reads only its slices; no collective).

    Args:
        path: a local Hugging Face Llama directory (``checkpoints.init_from_hf``).
        model: this rank's module, or its list of virtual pipeline chunks.
        args: the run's ``model`` section, which the directory must match.

    Returns:
        ``{"tensors": slices read, "bytes": bytes read, "seconds": ...}``.

    Raises:
        HFError: (a ValueError) the directory does not fit ``args`` (``check_hf_dir``).
    """
    t0 = time.perf_counter()
    hf = check_hf_dir(path, args)
    reads, nbytes = 0, 0
    with torch.no_grad():
        for name, params in named_params(model).items():
            handles: dict[str, object] = {}  # closed after each parameter: its mapped pages leave
            for p in params:  # this process's RSS instead of piling up to the file size
                n, b = _fill(p, name, args, hf, handles)
                reads, nbytes = reads + n, nbytes + b
            handles.clear()
    return {"tensors": reads, "bytes": nbytes, "seconds": time.perf_counter() - t0}


def _fill(param: torch.Tensor, name: str, args: ModelArgs, hf: HFDir, handles: dict) -> tuple[int, int]:
    info = get_shard_info(param)
    reads, nbytes = 0, 0
    for local, glob in info.pairs:
        g0, g1 = glob[0].start, glob[0].stop
        for piece in hf_llama.pieces(name, args, hf.vocab_size):
            a, b = max(g0, piece.start), min(g1, piece.stop)
            if a >= b:
                continue
            rec = hf.tensors[piece.hf_name]
            if rec["file"] not in handles:
                handles[rec["file"]] = safe_open(str(hf.path / rec["file"]), framework="pt")
            view = handles[rec["file"]].get_slice(piece.hf_name)
            rows = slice(a - piece.start, b - piece.start)
            src = view[(rows, *glob[1:])] if len(glob) > 1 else view[rows]
            dst_rows = slice(local[0].start + a - g0, local[0].start + b - g0)
            param[(dst_rows, *local[1:])].copy_(src.to(param.dtype))
            reads, nbytes = reads + 1, nbytes + src.numel() * src.element_size()
    return reads, nbytes
