"""The pre-submit check: everything about `data:` that can be known without tokenising.

`submit.py` calls `check_data_config` before it launches anything, so a typo in a path fails in
a second with exit 2 instead of minutes later inside a queued job. It reads names, sizes and at
most the first line or schema of one file, plus the tokenizer.json when one is given.
"""
from __future__ import annotations

from typing import Optional

from nanotrain.data.errors import DataError
from nanotrain.data.sources import Source, peek_columns, resolve_source
from nanotrain.data.tokenizer import BYTE, check_tokenizer_path, load_tokenizer


def check_data_config(data_args, vocab_size: Optional[int] = None) -> Source:
    """Raise `DataError` for a data config that cannot work; return the resolved source.

    Checks: the tokenizer is 'byte' or a loadable tokenizer.json (with `tokenizers` installed)
    whose vocabulary fits `vocab_size` (`model.vocab_size`, when given); the source path, glob
    or directory exists and holds data; the text column is present where the first file shows
    it cheaply (jsonl, csv, parquet, text, stdlib). A hub name cannot be checked offline.
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
    return source
