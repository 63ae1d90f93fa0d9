"""The input pipeline: text source -> tokens (cached) -> windows -> per-dp-rank micro-batches.

    from nanotrain.data import build_sampler
    sampler = build_sampler(config, builder=rank == 0, needs_data=..., barrier=dist.barrier)
    for step in range(start_step, train_steps):
        micro_batches = sampler.batch(consumed, dp_rank)   # m x (ids, targets) [mbs, S] int64
        consumed += sampler.global_batch_size

Modules, in pipeline order: `sources` (what to read), `tokenizer` (byte or tokenizer.json),
`dataset` (tokenise with datasets.map, cache the stream, cut windows), `sampler` (the seeded
global sample stream and its dp split), `build` (one rank builds, the others wait), `check`
(the no-tokenisation pre-submit check). Every user mistake raises `DataError`.
"""
from nanotrain.data.build import build_sampler, default_cache_dir, prepare_dataset
from nanotrain.data.check import check_data_config
from nanotrain.data.dataset import TokenDataset
from nanotrain.data.errors import DataError
from nanotrain.data.sampler import GlobalSampler
from nanotrain.data.sources import Source, resolve_source, stdlib_files
from nanotrain.data.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer

__all__ = ["build_sampler", "default_cache_dir", "prepare_dataset", "check_data_config",
           "TokenDataset", "DataError", "GlobalSampler", "Source", "resolve_source",
           "stdlib_files", "ByteTokenizer", "JsonTokenizer", "load_tokenizer"]
