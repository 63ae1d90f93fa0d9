"""The pre-submit check: everything about `data:` that can be known without tokenising.

`submit.py` calls `check_data_config` before it launches anything, so a typo in a path fails in
a second with exit 2 instead of minutes later inside a queued job. It reads names, sizes, the
first line or schema of one file, the tokenizer.json when one is given, and a sample of the rows
of a few files (`sample_check.py`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

from nanotrain.data.dataset import (
    cache_location,
    default_cache_dir,
    per_source_args,
    too_big_to_build,
    validation_args,
    validation_windows,
)
from nanotrain.data.errors import DataError
from nanotrain.data.mixture import integer_counts
from nanotrain.data.sample_check import check_sample, check_volume
from nanotrain.data.sources import Source, peek_columns, resolve_source
from nanotrain.data.tokenizer import BYTE, check_tokenizer_path, load_tokenizer


def check_data_config(data_args, vocab_size: Optional[int] = None, config=None) -> Source:
    """`check_source` for the one `data.source`, or for every entry of `data.sources` and the
    `data.validation.source`, each error naming the entry (`data.sources[1].source: ...`); the
    mixture's weights (`mixture.integer_counts`); with the whole `config`, the validation windows
    that evaluation reads (`check_eval_volume`). Reads a sample of the files, tokenises nothing.

    Returns:
        The resolved `Source` of `data.source`, or of the first mixture entry.

    Raises:
        DataError: the first problem found, one line naming the entry and the fix.
    """
    if data_args.sources:
        integer_counts([src.weight for src in data_args.sources])
    bounds = {}
    first = None
    if not data_args.sources:
        first, bounds["data"] = _checked(data_args, vocab_size, config)
    for where, args in [(w, a) for w, a in all_source_args(data_args) if w != "data"]:
        try:
            source, bounds[where] = _checked(args, vocab_size, None)
        except DataError as exc:
            message = str(exc)
            for field in ("data.source", "data.text_column"):
                if message.startswith(field + ":"):
                    message = where + "." + field.split(".")[1] + message[len(field) :]
            raise DataError(message) from None
        first = first or source
    if config is not None:
        check_eval_volume(config, bounds)
    return first


def check_eval_volume(config, bounds: dict) -> None:
    """Raise DataError when evaluation would read validation windows more than once: it reads
    `training.eval_batches` global batches, and the held-out windows (by the sources' upper
    bounds `bounds`, {where: tokens or None}) are certainly fewer. Nothing is said where a bound
    is unknown (hub data, compressed files)."""
    t, v = config.training, config.data.validation
    if not t.eval_interval or v is None:
        return
    seq = t.sequence_length
    if v.fraction is not None:
        trained = [b for w, b in bounds.items() if w != "data.validation"]
        if any(b is None for b in trained):
            return
        windows = [max(0, (b - 1) // seq) for b in trained]
        held = sum(validation_windows(w, v.fraction) for w in windows if w > 1)
        what = f"data.validation.fraction={v.fraction:g} holds out at most {held} windows"
        fix = "raise data.validation.fraction or lower training.eval_batches"
    else:
        bound = bounds.get("data.validation")
        if bound is None:
            return
        held = max(0, (bound - 1) // seq)
        what = f"data.validation.source {v.source!r} holds at most {held} windows"
        fix = "add validation data or lower training.eval_batches"
    per_batch = config.parallelism.batch_replicas * t.micro_batch_size * t.batch_accumulation_per_replica
    need = t.eval_batches * per_batch
    if held < need:
        raise DataError(
            f"training.eval_batches: {t.eval_batches} global batches of {per_batch} samples = {need} "
            f"validation windows of training.sequence_length+1={seq + 1} tokens, but {what}: "
            f"evaluation would read windows twice; {fix}"
        )


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
    before a training submission, so the user learns it in a second, not after the queue.
    Raises DataError for a tokenizer or source that cannot be resolved."""
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
    return _checked(data_args, vocab_size, config)[0]


def _checked(data_args, vocab_size: Optional[int], config) -> tuple[Source, Optional[int]]:
    """`check_source`'s work; returns the source and its upper bound of tokens (or None)."""
    check_tokenizer_path(data_args.tokenizer)
    if data_args.tokenizer != BYTE or vocab_size is not None:
        load_tokenizer(data_args.tokenizer, vocab_size)
    source = resolve_source(data_args.source)
    columns = peek_columns(source)
    if columns is not None and data_args.text_column not in columns:
        raise DataError(
            f"data.text_column: {data_args.text_column!r} is not a column of "
            f"{source.spec!r} (columns present: {columns}); "
            f"set data.text_column to one of them"
        )
    bound = check_sample(source, data_args.text_column)
    if config is not None:
        t = config.training
        global_batch = config.parallelism.batch_replicas * t.micro_batch_size * t.batch_accumulation_per_replica
        check_volume(
            bound,
            source,
            seq_len=t.sequence_length,
            global_batch=global_batch,
            detail=f"parallelism.dp={config.parallelism.dp} x training.batch_accumulation_per_replica="
            f"{t.batch_accumulation_per_replica} x training.micro_batch_size={t.micro_batch_size}",
        )
    return source, bound


def eval_source_args(config) -> list[tuple[str, object]]:
    """(``eval.sources[i]``, per-source `DataArgs`) of every evaluation corpus: its source and
    text column (or `data.text_column`), tokenised as training's data (`data.tokenizer`)."""
    d = config.data
    return [
        (f"eval.sources[{i}]", replace(d, source=s.source, sources=[], text_column=s.text_column or d.text_column))
        for i, s in enumerate(config.eval.sources)
    ]


def as_entry(message: str, where: str) -> str:
    """A data error about `data.source` / `data.text_column` (what one source's check names) as
    one about the evaluation source ``where`` (``eval.sources[1]``)."""
    for field in ("data.source", "data.text_column"):
        message = message.replace(field, where + "." + field.split(".")[1])
    return message


def check_eval_config(config) -> None:
    """Before a launch with `checkpoints.eval_job` or an `--evaluate`: every `eval.sources` entry
    as `check_source` checks a training source (errors naming the entry), with enough windows for
    its `batches` where the size is known (an upper bound: windows it certainly lacks), and every
    `eval.prompts` entry encoding to at least one token with room for `eval.sample_tokens` more
    within the model's context. Raises DataError (one line)."""
    t = config.training
    per_batch = config.parallelism.batch_replicas * t.micro_batch_size * t.batch_accumulation_per_replica
    for (where, args), entry in zip(eval_source_args(config), config.eval.sources):
        try:
            _, bound = _checked(args, config.model.vocab_size, None)
        except DataError as exc:
            raise DataError(as_entry(str(exc), where)) from None
        need = entry.batches * per_batch
        if bound is not None and max(0, (bound - 1) // t.sequence_length) < need:
            raise DataError(
                f"{where}.batches: {entry.batches} global batches of {per_batch} samples = {need} windows of "
                f"training.sequence_length+1={t.sequence_length + 1} tokens, but {entry.source!r} holds at most "
                f"{max(0, (bound - 1) // t.sequence_length)}: lower batches or add data"
            )
    if not config.eval.prompts:
        return
    tokenizer = load_tokenizer(config.data.tokenizer, config.model.vocab_size)
    limit = config.model.max_position_embeddings
    if config.model.sliding_window is not None:
        limit = min(limit, config.model.sliding_window)
    for i, prompt in enumerate(config.eval.prompts):
        n = len(tokenizer.encode_batch([prompt])[0])
        if n == 0:
            raise DataError(f"eval.prompts[{i}]: encodes to no token; give some text")
        if n + config.eval.sample_tokens > limit + 1:  # the last new token is never fed
            raise DataError(
                f"eval.prompts[{i}]: {n} tokens + eval.sample_tokens {config.eval.sample_tokens} exceed the "
                f"model's context ({limit} tokens): shorten the prompt or lower eval.sample_tokens"
            )
