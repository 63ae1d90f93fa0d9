"""Sharded, checksummed, atomically committed checkpoints in safetensors; resume on any topology.

API (all ranks call both, collectively; ``pc=None`` = one process)::

    path = save_checkpoint(root, step, model, optimizer, scheduler, pc,
                           extra={"consumed_samples": n, "consumed_tokens": t}, config=config)
    resumed = load_checkpoint(root, model, optimizer, scheduler, pc, config=config)
    # None: nothing to resume; else .step, .extra, .resharded (RNG streams start fresh) and
    # .skipped (damaged newer checkpoints passed over)

Layout (dp2 x tp2, ZeRO-1; ``ep-XX`` / ``cp-XX`` join the names when those axes are > 1)::

    <checkpoints.path>/latest                   "step_000120" (text file, replaced atomically)
    <checkpoints.path>/step_000120/
        COMPLETE                                "sha256 <of meta.json>", written last
        meta.json                               step, extra, topology, config + its hash, format
                                                version, scheduler state, lr per param group,
                                                per file: bytes and sha256s (header, each tensor,
                                                file); the index: name -> [{file, slices, ...}]
        model/pp-00_tp-0T.safetensors           parameters of (pp 0, tp T), written by dp rank 0
        optimizer/pp-00_tp-0T_dp-0D.safetensors exp_avg, exp_avg_sq, step of the ZeRO-1 range dp
                                                rank D owns (ZeRO-0: dp 0 writes [0, numel))
        state/rank-RRRRR.safetensors            RNG states (torch CPU/CUDA, python, numpy) as
                                                uint8 tensors; the rank's coords and rank_state

Every tensor's record (safetensors ``__metadata__`` and meta.json's index) holds the unsharded
shape and its (local slice, global slice) pairs, the parameter's ``ShardInfo``: fused chunks and
vocabulary padding (never saved) reassemble without model code, and the loader reshards to any
topology (``scripts/reshard_checkpoint.py`` does it offline). A record held by several ranks is
written once, by the lowest global rank holding it. Safetensors and JSON only: nothing is
unpickled, and the collectives carry JSON (``comm.py``).

One file per rank and kind, not per parameter: no slower, and far fewer files for a parallel file
system's metadata server (benchmarks/README.md, "Measured here"). Each tensor has its own sha256,
so a loader verifies exactly the bytes it reads. A checkpoint that fails verification is renamed
``step_N.damaged`` (``damage.py``) and never loaded, counted or pruned; another run's checkpoint
(meta.json's ``run_id``) is refused unless ``allow_foreign``, and never pruned.
"""

import importlib

# Lazy attributes (PEP 562): `submit.py` reads checkpoint names and meta.json before a launch
# (`layout.py`, standard library only) and must not pay for importing torch to do it.
_HOMES = {
    "CheckpointError": "layout",
    "CheckpointMismatch": "layout",
    "complete_checkpoints": "layout",
    "load_candidates": "layout",
    "read_latest": "layout",
    "verify_checkpoint": "format",
    "LoadedCheckpoint": "load",
    "load_checkpoint": "load",
    "prune": "save",
    "save_checkpoint": "save",
    "begin_save": "save",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'nanotrain.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nanotrain.checkpoint.{_HOMES[name]}"), name)
