"""Building the data in a multi-process job: one rank tokenises, the others wait and load.

Tokenising on every rank would multiply the work and race on the cache; instead the builder rank
(global rank 0, or local rank 0 on each node when the cache dir is node-local) tokenises while
the others wait in a barrier, then they load the finished stream from the cache. Ranks that need
no data (middle pipeline stages) still enter the barrier, so every rank calls it exactly once.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

from nanotrain.data.dataset import TokenDataset
from nanotrain.data.sampler import GlobalSampler


def default_cache_dir(config) -> str:
    """`<logging.dir>/.cache/data`: shared by every run under the same logs folder, so a second
    run (or a resumed one) finds the tokens the first one made."""
    return os.path.join(config.logging.dir, ".cache", "data")


def prepare_dataset(data_args, *, seq_len: int, cache_dir: str, vocab_size: Optional[int] = None,
                    builder: bool = True, needs_data: bool = True,
                    barrier: Optional[Callable[[], object]] = None,
                    max_documents: Optional[int] = None) -> Optional[TokenDataset]:
    """This rank's `TokenDataset`, or None where `needs_data` is False.

    `builder` ranks tokenise (or find the cache) before `barrier()`; the rest load after it and
    never tokenise. A builder's error is raised after the barrier, so the others are not left
    waiting in it; they then fail with a "cache missing" `DataError` of their own.
    """
    kwargs = dict(seq_len=seq_len, cache_dir=cache_dir, vocab_size=vocab_size,
                  max_documents=max_documents)
    dataset, error = None, None
    if builder:
        try:
            dataset = TokenDataset.build(data_args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the barrier
            error = exc
    if barrier is not None:
        barrier()
    if error is not None:
        raise error
    if not needs_data:
        return None
    if dataset is None:  # not `dataset or ...`: a TokenDataset has a length
        dataset = TokenDataset.build(data_args, allow_build=False, **kwargs)
    return dataset


def build_sampler(config, *, dp: Optional[int] = None, cache_dir: Optional[str] = None,
                  builder: bool = True, needs_data: bool = True,
                  barrier: Optional[Callable[[], object]] = None,
                  max_documents: Optional[int] = None) -> Optional[GlobalSampler]:
    """The trainer's one call: config -> this rank's `GlobalSampler` (None without data).

    `dp` defaults to `parallelism.batch_replicas` (dp x ep); `cache_dir` to `default_cache_dir(config)`.
    """
    t = config.training
    dataset = prepare_dataset(config.data, seq_len=t.sequence_length,
                              cache_dir=cache_dir or default_cache_dir(config),
                              vocab_size=config.model.vocab_size, builder=builder,
                              needs_data=needs_data, barrier=barrier, max_documents=max_documents)
    if dataset is None:
        return None
    return GlobalSampler(dataset, seed=t.seed, dp=dp or config.parallelism.batch_replicas,
                         micro_batch_size=t.micro_batch_size,
                         batch_accumulation=t.batch_accumulation_per_replica)
