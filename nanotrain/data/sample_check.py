"""Pre-launch checks of the data itself, cheaply: a sample of rows and the total size.

Why: a non-string or mixed text column, a binary or non-JSON `.jsonl`, a file of empty lines, a
corrupt parquet file and too little data for one global batch were found only by the rank that
tokenises — after the run directory was made, the ranks started and (on SLURM) the job waited in
the queue. Reading everything before launch would cost what tokenising costs,
so this reads at most ``SAMPLE_FILES`` files, from each the first ``HEAD_BYTES`` and the last
``TAIL_BYTES`` (or the first row group of the text column of a parquet file), plus file sizes and
parquet footers. What the sample cannot see is still found by the rank, and reported there as
one `error:` line with exit 2 (`runtime/task.py`).

The size check is an upper bound, so it never rejects data that would fit: a token covers at
least one byte of text (byte tokenizer: exactly one; BPE / WordPiece: one or more), every byte of
text is at least one byte of the file (JSON and CSV add quotes and keys), and each document adds
one separator. A parquet file's bound is the uncompressed size of the text column plus a
separator per row. The `stdlib` source's bound is its files' sizes plus a separator each (a file
that is not UTF-8 counts three bytes per byte: each invalid byte becomes U+FFFD, three bytes).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from nanotrain.data.errors import DataError
from nanotrain.data.sources import _COMPRESSED, Source

SAMPLE_FILES = 8
HEAD_BYTES = 1 << 20
TAIL_BYTES = 64 << 10


def _sampled(files: tuple[str, ...]) -> list[str]:
    if len(files) <= SAMPLE_FILES:
        return list(files)
    step = (len(files) - 1) / (SAMPLE_FILES - 1)
    return [files[round(i * step)] for i in range(SAMPLE_FILES)]


def _chunks(path: str) -> list[tuple[int, bytes, bool]]:
    """(line number of the first line or 0 if unknown, bytes, whole file?) of the head and tail."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(HEAD_BYTES)
        if size <= HEAD_BYTES:
            return [(1, head, True)]
        head = head[: head.rfind(b"\n") + 1]  # whole lines only
        fh.seek(max(HEAD_BYTES, size - TAIL_BYTES))
        tail = fh.read()
    tail = tail[tail.find(b"\n") + 1 :]
    return [(1, head, False), (0, tail, False)]


def _where(path: str, first: int, index: int) -> str:
    return f"{path} line {first + index}" if first else f"{path} (a line near its end)"


def _check_binary(path: str, data: bytes) -> None:
    if b"\0" in data[:65536]:
        raise DataError(
            f"data.source: {path} is binary, not text (it holds NUL bytes); "
            "point data.source at text, JSON Lines, CSV or parquet files"
        )
    try:
        data[:65536].decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < min(len(data), 65536) - 4:  # not just a character cut at the sample's end
            raise DataError(
                f"data.source: {path} is not UTF-8 text (byte {e.start}: {e.reason}); "
                "point data.source at UTF-8 text, JSON Lines, CSV or parquet files"
            ) from None


def _check_json_lines(path: str, column: str) -> None:
    chunks = _chunks(path)
    first_line = next((ln for ln in chunks[0][1].splitlines() if ln.strip()), b"")
    _check_binary(path, chunks[0][1])
    if first_line.lstrip()[:1] in (b"[", b"{"):
        try:
            record = json.loads(first_line)
        except ValueError:
            return  # one JSON document over many lines (an array, {"data": [...]}): the builder reads it
        if not isinstance(record, dict):
            return
    documents = 0
    for first, data, whole in chunks:
        for i, line in enumerate(data.splitlines()):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise DataError(
                    f"data.source: {_where(path, first, i)} is not JSON ({e}); every line of a "
                    "JSON Lines file must be one JSON object"
                ) from None
            if not isinstance(record, dict):
                raise DataError(
                    f"data.source: {_where(path, first, i)} is a JSON {type(record).__name__}, "
                    "not an object; every line of a JSON Lines file must be one JSON object"
                )
            value = record.get(column)
            if value is not None and not isinstance(value, str):
                raise DataError(
                    f"data.text_column: {column!r} at {_where(path, first, i)} is a "
                    f"JSON {type(value).__name__} ({str(value)[:40]}), not text; every row's "
                    f"{column!r} must be a string"
                )
            documents += 1
        if whole and documents == 0:
            raise DataError(
                f"data.source: {path} holds no documents (only empty lines); point data.source at data that holds text"
            )


def _check_parquet(path: str, column: str) -> int:
    """Checks the column's type and reads its first row group; returns the byte bound."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise DataError(
            f"data.source: {path} is not a readable parquet file ({type(e).__name__}: "
            f"{str(e)[:200]}); replace or remove it"
        ) from None
    if column not in schema.names:
        return 0  # named by the column check with the columns present
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        raise DataError(
            f"data.text_column: column {column!r} of {path} holds {kind}, not text; "
            "set data.text_column to a string column"
        )
    index = schema.get_field_index(column)
    bound = 0
    for rg in range(pf.metadata.num_row_groups):
        group = pf.metadata.row_group(rg)
        bound += group.column(index).total_uncompressed_size + group.num_rows
    if pf.metadata.num_row_groups:
        try:
            pf.read_row_group(0, columns=[column])
        except (pa.ArrowException, OSError) as e:
            raise DataError(
                f"data.source: {path} is a corrupt parquet file: its column {column!r} cannot be "
                f"read ({type(e).__name__}: {str(e)[:200]}); replace or remove it"
            ) from None
    return bound


def _parquet_bound(path: str) -> int:
    import pyarrow.parquet as pq

    meta = pq.read_metadata(path)
    return sum(meta.row_group(i).total_byte_size + meta.row_group(i).num_rows for i in range(meta.num_row_groups))


def check_sample(source: Source, text_column: str) -> Optional[int]:
    """Raise DataError for what a sample shows; return an upper bound of the source's tokens
    (None where there is none: hub datasets, compressed files)."""
    if source.kind == "stdlib":
        return sum(_stdlib_file_bound(path) for path in source.files)
    if source.kind != "files":
        return None
    bound, sampled = 0, set(_sampled(source.files))
    for path in source.files:
        if source.builder == "parquet":
            bound += _check_parquet(path, text_column) if path in sampled else _parquet_bound(path)
            continue
        if path.endswith(_COMPRESSED):
            return None
        bound += os.path.getsize(path) + (1 if source.builder == "text" else 0)
        if path not in sampled or os.path.getsize(path) == 0:
            continue
        if source.builder == "json":
            _check_json_lines(path, text_column)
        elif source.builder == "text":
            with open(path, "rb") as fh:
                _check_binary(path, fh.read(65536))
    return bound


def _stdlib_file_bound(path: str) -> int:
    """Tokens of one stdlib file at most: its bytes (tripled where they are not UTF-8, see the
    module doc) and the document separator."""
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return 3 * len(raw) + 1
    return len(raw) + 1


def check_volume(bound: Optional[int], source: Source, *, seq_len: int, global_batch: int, detail: str) -> None:
    """Too little data for one global batch, by the upper bound: certain, never a guess."""
    if bound is None:
        return
    windows = max(0, (bound - 1) // seq_len)
    if windows < global_batch:
        raise DataError(
            f"data: too little data for one global batch: {source.spec!r} holds at most {bound} "
            f"tokens, i.e. at most {windows} windows of training.sequence_length+1={seq_len + 1} "
            f"tokens; {global_batch} needed ({detail}); add data or lower those fields"
        )
