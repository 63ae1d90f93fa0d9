"""Start a run from a Hugging Face model (``checkpoints.init_from_hf``): each rank reads only its slices.

For every parameter of this rank's model (its pipeline stage(s), its tp shards, its ep experts) the
ShardInfo says which rows/columns of the full nanotrain tensor it holds; the family's mapping
(``family_of(args).hf.pieces``) says which HF tensor holds which rows of it (for an expert stack:
which expert's rows, ``Piece.lead``, so a rank holding experts [a, b) opens only theirs). Each
(local, global) slice pair is intersected with each piece and read with safetensors
``safe_open(...).get_slice(...)[rows, cols]``, which copies exactly those bytes out of the
memory-mapped file: no rank materialises a tensor it does not own (a tp rank of the
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
from nanotrain.models.family import family_of
from nanotrain.models.hf_mapping import nanotrain_shapes
from nanotrain.parallel.sharding import get_shard_info


def load_hf_weights(path: str | Path, model: Models, args: ModelArgs) -> dict:
    """Fill this rank's parameters of ``model`` from the HF directory ``path``, at any topology
    (each rank reads only its slices; no collective).

    Args:
        path: a local Hugging Face directory of ``model.family`` (``checkpoints.init_from_hf``).
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


def load_hf_state_dict(path: str | Path, args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict:
    """The full nanotrain tensors (``nanotrain_shapes`` names) of the HF directory ``path``, read
    through the same pieces as ``load_hf_weights`` (one process; offline tools and tests). Rows of
    a ``model.vocab_size`` above the HF vocabulary are zero."""
    hf = check_hf_dir(path, args)
    out, handles = {}, {}
    for name, shape in nanotrain_shapes(args).items():
        out[name] = torch.zeros(shape, dtype=dtype)
        _fill(out[name], name, args, hf, handles)
    return out


def _fill(param: torch.Tensor, name: str, args: ModelArgs, hf: HFDir, handles: dict) -> tuple[int, int]:
    """Copy into ``param`` every (local, global) slice pair's intersection with each HF piece.
    A piece with ``lead`` e is expert e of a 3-D stack: read only when the pair holds e, its
    rows then cut along dim 1."""
    info = get_shard_info(param)
    reads, nbytes = 0, 0
    for local, glob in info.pairs:
        glob = (*glob, *(slice(0, n) for n in info.global_shape[len(glob) :]))
        local = (*local, *(slice(0, n) for n in param.shape[len(local) :]))
        for piece in family_of(args).hf.pieces(name, args, hf.vocab_size, hf.fused):
            lead = () if piece.lead is None else (piece.lead,)
            if lead and not glob[0].start <= piece.lead < glob[0].stop:
                continue
            g = glob[len(lead)]
            a, b = max(g.start, piece.start), min(g.stop, piece.stop)
            if a >= b:
                continue
            rec = hf.tensors[piece.hf_name]
            if rec["file"] not in handles:
                handles[rec["file"]] = safe_open(str(hf.path / rec["file"]), framework="pt")
            view = handles[rec["file"]].get_slice(piece.hf_name)
            rows, rest = slice(a - piece.start, b - piece.start), glob[len(lead) + 1 :]
            src = view[(rows, *rest)] if rest else view[rows]
            at = local[len(lead)].start + a - g.start
            dst = (*(local[0].start + piece.lead - glob[0].start for _ in lead), slice(at, at + b - a))
            param[(*dst, *local[len(lead) + 1 :])].copy_(src.to(param.dtype))
            reads, nbytes = reads + 1, nbytes + src.numel() * src.element_size()
    return reads, nbytes
