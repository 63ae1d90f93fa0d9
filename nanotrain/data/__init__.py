"""The input pipeline: text source -> tokens (cached) -> windows -> per-dp-rank micro-batches.

    from nanotrain.data import build_sampler
    sampler = build_sampler(config, builder=rank == 0, needs_data=..., barrier=dist.barrier)
    for step in range(start_step, train_steps):
        micro_batches = sampler.batch(consumed, dp_rank)   # m x (ids, targets[, documents]) [mbs, S] int64
        consumed += sampler.global_batch_size

Modules, in pipeline order: `sources` (what to read), `tokenizer` (byte or tokenizer.json),
`dataset` (tokenise with datasets.map, cache the stream, cut windows), `sampler` (the seeded
global sample stream and its dp split), `build` (one rank builds, the others wait), `check`
(the no-tokenisation pre-submit check), `device_batches` (batches copied to the GPU a step ahead).
Every user mistake raises `DataError`.
"""

import importlib

# Lazy attributes (PEP 562): `submit.py` calls `check_data_config` before every submission and must
# not pay for importing torch and datasets (seconds) just to check that a path exists.
_HOMES = {
    "build_sampler": "build",
    "build_samplers": "build",
    "SourcePart": "sampler",
    "MixturePattern": "mixture",
    "default_cache_dir": "dataset",
    "missing_cache_problem": "check",
    "source_args": "build",
    "prepare_dataset": "build",
    "check_data_config": "check",
    "TokenDataset": "dataset",
    "DataError": "errors",
    "GlobalSampler": "sampler",
    "Source": "sources",
    "resolve_source": "sources",
    "stdlib_files": "sources",
    "ByteTokenizer": "tokenizer",
    "JsonTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "BatchPrefetcher": "device_batches",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'nanotrain.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"nanotrain.data.{_HOMES[name]}"), name)
