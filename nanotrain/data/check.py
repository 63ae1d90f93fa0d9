"""The pre-submit check: everything about `data:` that can be known without tokenising.

`submit.py` calls `check_data_config` before it launches anything, so a typo in a path fails in
a second with exit 2 instead of minutes later inside a queued job. It reads names, sizes, the
first line or schema of one file, the tokenizer.json when one is given, and a sample of the rows
of a few files (`sample_check.py`).
"""
from __future__ import annotations

import os
from typing import Optional

from nanotrain.data.dataset import cache_location, default_cache_dir, per_source_args, too_big_to_build, validation_args
from nanotrain.data.errors import DataError
from nanotrain.data.sample_check import check_sample, check_volume
from nanotrain.data.sources import Source, peek_columns, resolve_source
from nanotrain.data.tokenizer import BYTE, check_tokenizer_path, load_tokenizer


def check_data_config(data_args, vocab_size: Optional[int] = None, config=None) -> Source:
    """`check_source` for the one `data.source`, or for every entry of `data.sources` and the
    `data.validation.source`, each error naming the entry (`data.sources[1].source: ...`)."""
    entries = [(w, a) for w, a in all_source_args(data_args) if w != "data"]
    first = None if data_args.sources else check_source(data_args, vocab_size, config)
    for where, args in entries:
        try:
            source = check_source(args, vocab_size, None)
        except DataError as exc:
            message = str(exc)
            for field in ("data.source", "data.text_column"):
                if message.startswith(field + ":"):
                    message = where + "." + field.split(".")[1] + message[len(field):]
            raise DataError(message) from None
        first = first or source
    return first


def all_source_args(data_args) -> list[tuple[str, object]]:
    """(where, per-source `DataArgs`) of every corpus a run reads: training and validation."""
    if data_args.sources:
        out = [(f"data.sources[{i}]", args) for i, args in enumerate(per_source_args(data_args))]
    else:
        out = [("data", data_args)]
    val = validation_args(data_args)
    if val is not None:
        out.append(("data.validation", val))
    return out


def missing_cache_problem(config) -> Optional[str]:
    """Why a training job would stop on a missing cache (`data.max_build_mb`), or None: checked
    before a training submission, so the user learns it in a second, not after the queue."""
    tokenizer = load_tokenizer(config.data.tokenizer, None)
    for _, args in all_source_args(config.data):
        source = resolve_source(args.source)
        path, _ = cache_location(source, tokenizer, args, default_cache_dir(config))
        if not os.path.exists(os.path.join(path, "meta.json")):
            problem = too_big_to_build(source, config.data.max_build_mb)
            if problem:
                return problem
    return None


def check_source(data_args, vocab_size: Optional[int] = None, config=None) -> Source:
    """Raise `DataError` for a data config that cannot work; return the resolved source.

    Checks: the tokenizer is 'byte' or a loadable tokenizer.json (with `tokenizers` installed)
    whose vocabulary fits `vocab_size` (`model.vocab_size`, when given); the source path, glob
    or directory exists and holds data; the text column is present where the first file shows
    it cheaply (jsonl, csv, parquet, text, stdlib); a sample of rows holds JSON objects whose text
    column is a string (jsonl), the column is text and readable (parquet), the files are text;
    with the whole `config`, the data can fill one global batch (an upper bound, never a guess).
    A hub name cannot be checked offline.
    """
    check_tokenizer_path(data_args.tokenizer)
    if data_args.tokenizer != BYTE or vocab_size is not None:
        load_tokenizer(data_args.tokenizer, vocab_size)
    source = resolve_source(data_args.source)
    columns = peek_columns(source)
    if columns is not None and data_args.text_column not in columns:
        raise DataError(f"data.text_column: {data_args.text_column!r} is not a column of "
                        f"{source.spec!r} (columns present: {columns}); "
                        f"set data.text_column to one of them")
    bound = check_sample(source, data_args.text_column)
    if config is not None:
        t = config.training
        global_batch = config.parallelism.batch_replicas * t.micro_batch_size * t.batch_accumulation_per_replica
        check_volume(bound, source, seq_len=t.sequence_length, global_batch=global_batch,
                     detail=f"parallelism.dp={config.parallelism.dp} x training.batch_accumulation_per_replica="
                            f"{t.batch_accumulation_per_replica} x training.micro_batch_size={t.micro_batch_size}")
    return source
