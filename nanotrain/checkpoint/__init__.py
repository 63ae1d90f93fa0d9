"""Sharded, checksummed, atomically committed checkpoints in safetensors; resume on any topology.

API (all ranks call both, collectively; ``pc=None`` = one process)::

    path = save_checkpoint(root, step, model, optimizer, scheduler, pc,
                           extra={"consumed_samples": n, "consumed_tokens": t}, config=config)
    resumed = load_checkpoint(root, model, optimizer, scheduler, pc, config=config)
    if resumed is not None:        # None: nothing to resume
        step, consumed = resumed.step, resumed.extra["consumed_samples"]
        # resumed.resharded: the topology changed (RNG streams then start fresh)
        # resumed.skipped: damaged newer checkpoints that were passed over (files named)

``scripts/reshard_checkpoint.py SRC DST --set parallelism.tp=4`` rewrites a checkpoint for another
topology offline (``reshard.reshard_offline``); resuming does not need it, the loader reshards.

Layout (dp2 x tp2, ZeRO-1)::

    <checkpoints.path>/latest                      "step_000120" (text file, replaced atomically)
    <checkpoints.path>/step_000120/
        COMPLETE                                   "sha256 <of meta.json>", written last
        meta.json                                  step, extra (consumed samples/tokens), topology
                                                   (dp tp pp cp ep zero_stage pp_engine
                                                   pp_virtual_stages tp_mode), config + its hash,
                                                   format version, scheduler state, lr per param
                                                   group, per file: bytes, sha256 of the header
                                                   and of every tensor, file digest; the index:
                                                   name -> [{file, slice metadata, ...}]
        model/pp-00_tp-00.safetensors              parameters of (pp 0, tp 0), written by dp rank 0
        model/pp-00_tp-01.safetensors
        optimizer/pp-00_tp-00_dp-00.safetensors    <name>/exp_avg, <name>/exp_avg_sq, <name>/step of
        optimizer/pp-00_tp-00_dp-01.safetensors      the ZeRO-1 range [start, stop) of the flattened
        optimizer/pp-00_tp-01_dp-00.safetensors      local parameter each dp rank owns (ZeRO-0:
        optimizer/pp-00_tp-01_dp-01.safetensors      dp 0 writes [0, numel))
        state/rank-00000.safetensors ... rank-00003   RNG states (torch CPU/CUDA, python, numpy) as
                                                   uint8 tensors; the rank's coords and rank_state
    (ep-XX / cp-XX join the names when those axes are > 1.)

Every tensor's record (in the file's safetensors ``__metadata__`` and in meta.json's index) holds
the unsharded shape and the (local slice, global slice) pairs it holds, i.e. the parameter's
``ShardInfo``, so fused QKV / gate-up chunks and vocab padding (never saved) need no model code to
reassemble. Identical records held by several ranks — dp/cp replicas, tp-replicated norms, the
tied embedding's replica on the last pipeline stage, ZeRO-0 states — are written once, by the
lowest global rank holding them. Nothing is unpickled anywhere: safetensors and JSON only, and the
collectives carry JSON (``comm.py``).

File granularity: one file per rank and kind, not one per parameter: no slower to save or load,
and a small fraction of the files (what a parallel file system's metadata server notices at
scale); the same choice as DCP and Megatron's torch_dist (the comparison: benchmarks/README.md,
"Measured here"). The usual cost of per-rank files — a rank reading one tensor of another rank's
file must hash the whole file — is avoided by checksumming each tensor: a loader verifies exactly
the bytes it reads. Files are streamed to disk tensor by tensor (no second in-memory copy) and fsynced.

Damage: a checkpoint that fails verification (on load, before a save trusts it, or the size
check of pruning) is renamed ``step_N.damaged`` with a ``DAMAGED.txt`` saying why (``damage.py``):
kept for inspection, never loaded, counted or pruned. meta.json records the writing run's
``run_id``; the loader refuses another run's checkpoint unless told (``allow_foreign``) and
pruning never deletes one.

Checksum: sha256: detects deliberate edits, not just bit rot, at a cost on every byte a rank
writes or reads (hashed beside the fsync, ``format.py``).
"""
import importlib

# Lazy attributes (PEP 562): `submit.py` reads checkpoint names and meta.json before a launch
# (`layout.py`, standard library only) and must not pay for importing torch to do it.
_HOMES = {
    "CheckpointError": "layout", "CheckpointMismatch": "layout", "complete_checkpoints": "layout",
    "load_candidates": "layout", "read_latest": "layout", "verify_checkpoint": "format",
    "LoadedCheckpoint": "load", "load_checkpoint": "load", "prune": "save", "save_checkpoint": "save",
    "begin_save": "save",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'nanotrain.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nanotrain.checkpoint.{_HOMES[name]}"), name)
