"""Building the data in a multi-process job: one rank tokenises, the others wait and load.

Tokenising on every rank would multiply the work and race on the cache; instead the builder rank
(global rank 0, or local rank 0 on each node when the cache dir is node-local) tokenises while
the others wait in a barrier, then they load the finished stream from the cache. Ranks that need
no data (middle pipeline stages) still enter the barrier, so every rank calls it exactly once.

The job's barrier is met on the default group's store (``wait_for_builders``), not in a
collective: a collective runs under the process groups' timeout, and on NCCL the waiting ranks
are aborted (SIGABRT, no message) when tokenising a real corpus takes longer than that.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from nanotrain.data.dataset import TokenDataset, default_cache_dir, per_source_args, validation_args, validation_windows
from nanotrain.data.sampler import DEFAULT_NAME, GlobalSampler, SourcePart

# How long a rank waits for the builder: tokenising a corpus on one rank may take hours. A builder
# that dies ends the wait sooner: its launcher ends the job, or its store (rank 0's) goes away.
DATA_BUILD_TIMEOUT = timedelta(hours=24)
_ARRIVED, _OPEN = "nanotrain/data_build/arrived", "nanotrain/data_build/open"


def wait_for_builders(store=None, world_size: Optional[int] = None, timeout: timedelta = DATA_BUILD_TIMEOUT) -> None:
    """Every rank of the job meets here, on ``store`` (the default group's), for ``timeout``.

    The meetings are told apart by one arrivals counter: all ``world_size`` arrivals at meeting
    n come before any at meeting n + 1 (no rank leaves n before all arrived), so arrival number
    a belongs to meeting (a - 1) // world_size, and its last arrival opens it."""
    store = dist.distributed_c10d._get_default_store() if store is None else store
    world = dist.get_world_size() if world_size is None else world_size
    arrived = store.add(_ARRIVED, 1)
    meeting = f"{_OPEN}/{(arrived - 1) // world}"
    if arrived % world == 0:
        store.set(meeting, "1")
    store.wait([meeting], timeout)


def prepare_dataset(
    data_args,
    *,
    seq_len: int,
    cache_dir: str,
    vocab_size: Optional[int] = None,
    builder: bool = True,
    needs_data: bool = True,
    barrier: Optional[Callable[[], object]] = None,
    max_documents: Optional[int] = None,
    max_build_mb: Optional[float] = None,
) -> Optional[TokenDataset]:
    """This rank's `TokenDataset`, or None where `needs_data` is False.

    `builder` ranks tokenise (or find the cache) before `barrier()`; the rest load after it and
    never tokenise. A builder's error is raised after the barrier, so the others are not left
    waiting in it; they then fail with a "cache missing" `DataError` of their own. `dist.barrier`
    (what the trainer hands in) is met on the store instead: `wait_for_builders`.

    Args:
        data_args: one source's `DataArgs` (`source_args` splits a mixture).
        seq_len: tokens per sample; windows are `seq_len + 1` tokens (inputs and shifted targets).
        cache_dir: where the tokenised stream is cached (`default_cache_dir`).
        vocab_size: `model.vocab_size`, checked against the tokenizer.
        max_documents: read at most this many documents (tests, smoke runs).
        max_build_mb: refuse to tokenise inputs larger than this inside a training job.

    Raises:
        DataError: the source, tokenizer or cache cannot serve (missing path, no documents, wrong
            column, a source too large to tokenise here, a cache missing on a non-builder rank).
    """
    kwargs = dict(seq_len=seq_len, cache_dir=cache_dir, vocab_size=vocab_size, max_documents=max_documents)
    dataset, error = None, None
    if builder:
        try:
            dataset = TokenDataset.build(data_args, max_build_mb=max_build_mb, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the barrier
            error = exc
    if barrier is not None:
        (wait_for_builders if barrier is dist.barrier else barrier)()
    if error is not None:
        raise error
    if not needs_data:
        return None
    if dataset is None:  # not `dataset or ...`: a TokenDataset has a length
        dataset = TokenDataset.build(data_args, allow_build=False, **kwargs)
    return dataset


def source_args(data_args) -> list[tuple[str, object, float]]:
    """(name, per-source `DataArgs`, weight) of every training source: `data.sources`, or the
    one `data.source` (named `default`)."""
    if not data_args.sources:
        return [(DEFAULT_NAME, data_args, 1.0)]
    return [(s.name, args, s.weight) for s, args in zip(data_args.sources, per_source_args(data_args))]


def build_samplers(
    config,
    *,
    dp: Optional[int] = None,
    cache_dir: Optional[str] = None,
    builder: bool = True,
    needs_data: bool = True,
    barrier: Optional[Callable[[], object]] = None,
    max_documents: Optional[int] = None,
) -> tuple[Optional[GlobalSampler], Optional[GlobalSampler]]:
    """The trainer's one call: config -> this rank's (training, validation) `GlobalSampler`s;
    both None where the rank needs no data, the second None without `data.validation`.

    `data.validation.fraction` holds out the tail of every source's window range (contiguous,
    so no held-out window shares more than its first token with a training one), read in order
    in the same mixture; `data.validation.source` is a corpus of its own. `dp` defaults to
    `parallelism.batch_replicas` (dp x ep); `cache_dir` to `default_cache_dir(config)`; the other
    keywords are `prepare_dataset`'s, for every source.

    Raises:
        DataError: as `prepare_dataset`, for any source (training or validation), or too little
            data for one global batch (`GlobalSampler`).
    """
    t, d = config.training, config.data
    kwargs = dict(
        seq_len=t.sequence_length,
        cache_dir=cache_dir or default_cache_dir(config),
        vocab_size=config.model.vocab_size,
        builder=builder,
        needs_data=needs_data,
        barrier=barrier,
        max_documents=max_documents,
        max_build_mb=d.max_build_mb,
    )
    datasets = [(name, prepare_dataset(args, **kwargs), w) for name, args, w in source_args(d)]
    val_args = validation_args(d)
    val_ds = prepare_dataset(val_args, **kwargs) if val_args is not None else None
    if not needs_data:
        return None, None
    sizes = dict(
        seed=t.seed,
        dp=dp or config.parallelism.batch_replicas,
        micro_batch_size=t.micro_batch_size,
        batch_accumulation=t.batch_accumulation_per_replica,
        document_masking=d.document_masking,
        mask_boundary_loss=d.mask_boundary_loss,
        cp_balance=config.parallelism.cp if config.parallelism.cp_balance == "documents" else 1,
    )
    fraction = d.validation.fraction if d.validation is not None else None
    if fraction is None:
        train_parts = [SourcePart(name, ds, w) for name, ds, w in datasets]
        val_parts = [SourcePart("validation", val_ds, shuffle=False)] if val_ds is not None else None
    else:
        held = [validation_windows(ds.num_windows, fraction) for _, ds, _ in datasets]
        train_parts = [SourcePart(name, ds, w, hi=ds.num_windows - v) for (name, ds, w), v in zip(datasets, held)]
        val_parts = [
            SourcePart(name, ds, w, lo=ds.num_windows - v, shuffle=False) for (name, ds, w), v in zip(datasets, held)
        ]
    train = GlobalSampler(train_parts, **sizes)
    val = GlobalSampler(val_parts, **sizes) if val_parts else None
    return train, val


def build_sampler(config, **kwargs) -> Optional[GlobalSampler]:
    """The training sampler of `build_samplers` (None without data)."""
    return build_samplers(config, **kwargs)[0]
