"""Tokenise once, cache the token stream on disk, and serve fixed-length windows from it.

The cache holds one flat token stream per (source, text column, tokenizer, document cap):
every non-empty document's ids followed by the separator id, as uint16 (uint32 for vocabularies
over 65536) in `tokens.bin`, read back as a memory map. It does not depend on `sequence_length`:
windows are cut on the fly, so changing the sequence length reuses the cache.

    <cache_dir>/
      hf/                                 datasets' Arrow copy of local/hub sources
      <source>-<tokenizer>-<key>/
        tokens.bin                        the token stream
        meta.json                         written last: its presence means the stream is complete

Window i is `tokens[i*S : i*S + S + 1]` (S = sequence_length): inputs are its first S tokens,
targets its last S, and consecutive windows overlap by one token, so every token after the first
is a target exactly once per epoch and nothing is padded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from nanotrain.config.atomic_files import atomic_write
from nanotrain.data.errors import DataError
from nanotrain.data.sources import Source, load_texts, resolve_source
from nanotrain.data.tokenizer import Tokenizer, load_tokenizer, token_dtype

FORMAT_VERSION = 1


def _encode(batch: dict, *, tokenizer: Tokenizer, column: str, dtype: str) -> dict:
    """`datasets.map` body: ids + separator per document; an empty document adds nothing."""
    out = []
    for ids in tokenizer.encode_batch([t or "" for t in batch[column]]):
        if len(ids):
            out.append(np.append(ids.astype(dtype), np.array([tokenizer.separator_id], dtype)))
        else:
            out.append(np.empty(0, dtype))
    return {"input_ids": out}


def _cache_name(source: Source, tokenizer: Tokenizer, key: str) -> str:
    """A folder name a person can recognise: `stdlib-byte-<key>`, `train.jsonl-tokenizer-<key>`."""
    src = "stdlib" if source.kind == "stdlib" else os.path.basename(source.spec.rstrip("/*")) or "data"
    tok = os.path.splitext(os.path.basename(tokenizer.name))[0]
    return re.sub(r"[^\w.-]+", "_", f"{src}-{tok}")[:60] + "-" + key


@dataclass
class TokenDataset:
    """A packed token stream cut into windows of `seq_len + 1` tokens.

    Build it with `TokenDataset.build(...)`; `from_cache` says whether this process tokenised
    (False) or found the stream already on disk (True).
    """

    tokens: np.ndarray  # 1-D memory map of the whole stream
    seq_len: int
    separator_id: int
    tokenizer_vocab_size: int
    num_documents: int
    path: str  # the cache folder
    from_cache: bool
    meta: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_windows(self) -> int:
        """Windows of S+1 tokens at stride S; the last token of one is the first of the next."""
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def __len__(self) -> int:
        return self.num_windows

    def windows(self, indices) -> np.ndarray:
        """The windows at `indices` as an int64 array [len(indices), S+1]."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_windows):
            raise IndexError(f"window index out of range [0, {self.num_windows})")
        offsets = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1, dtype=np.int64)
        return np.asarray(self.tokens[offsets], dtype=np.int64)

    @classmethod
    def build(
        cls,
        data_args,
        *,
        seq_len: int,
        cache_dir: str,
        vocab_size: Optional[int] = None,
        max_documents: Optional[int] = None,
        allow_build: bool = True,
        max_build_mb: Optional[float] = None,
        progress: bool = False,
    ) -> "TokenDataset":
        """Load the tokenised stream from `cache_dir`, tokenising it first if it isn't there.

        `data_args` is the config's `DataArgs` (`source`, `text_column`, `tokenizer`,
        `num_workers`); `vocab_size` is `model.vocab_size`, checked against the tokenizer.
        `max_documents` keeps only the first N documents (tests, quick runs). With
        `allow_build=False` a missing cache is an error instead of a tokenisation: ranks that
        wait for another rank to build must never start a second tokenisation of their own.
        `max_build_mb` (`data.max_build_mb` in a training job): a missing cache of a source
        larger than that on disk (or of a hub dataset, whose size is unknown) is an error that
        says to run `--prepare-data`, instead of hours of tokenising on GPU nodes. `progress`:
        a tqdm bar of documents, tokens, MB/s and ETA (`--prepare-data --local`).

        Raises:
            DataError: a bad `seq_len`, tokenizer or source (`load_tokenizer`, `resolve_source`),
                a missing cache where none may be built, or data that cannot be tokenised.
        """
        if seq_len < 1:
            raise DataError(f"training.sequence_length={seq_len} must be >= 1")
        tokenizer = load_tokenizer(data_args.tokenizer, vocab_size)
        source = resolve_source(data_args.source)
        path, key = cache_location(source, tokenizer, data_args, cache_dir, max_documents)

        from_cache = os.path.exists(os.path.join(path, "meta.json"))
        if not from_cache:
            if not allow_build:
                raise DataError(
                    f"data: the tokenised cache {path} is missing: the rank that "
                    f"builds it failed or used another cache dir (see its log)"
                )
            too_big = too_big_to_build(source, max_build_mb)
            if too_big:
                raise DataError(too_big)
            _tokenise(source, tokenizer, data_args, path, key, cache_dir, max_documents, progress)
        with open(os.path.join(path, "meta.json")) as fh:
            meta = json.load(fh)
        tokens = np.memmap(os.path.join(path, "tokens.bin"), dtype=meta["dtype"], mode="r", shape=(meta["num_tokens"],))
        return cls(
            tokens=tokens,
            seq_len=seq_len,
            separator_id=meta["separator_id"],
            tokenizer_vocab_size=meta["vocab_size"],
            num_documents=meta["num_documents"],
            path=path,
            from_cache=from_cache,
            meta=meta,
        )


def default_cache_dir(config) -> str:
    """`<logging.dir>/.cache/data`: shared by every run under the same logs folder, so a second
    run (or a resumed one) finds the tokens the first one made; `data.cache_dir` when set (the
    points of a sweep, one folder down, share the cache of the sweep's logs folder)."""
    return config.data.cache_dir or os.path.join(config.logging.dir, ".cache", "data")


def per_source_args(data_args) -> list:
    """The `DataArgs` of each entry of `data.sources`, in order: that entry's source and text
    column (or `data.text_column`), everything else from `data`."""
    return [
        replace(data_args, source=s.source, sources=[], text_column=s.text_column or data_args.text_column)
        for s in data_args.sources
    ]


def validation_windows(num_windows: int, fraction: float) -> int:
    """Windows held out of a source for `data.validation.fraction`: the last ceil(fraction * W)
    of its stream (at least 1, and at least 1 left for training). Pure arithmetic: the sampler
    and the pre-submit check (`check.check_eval_volume`) share it."""
    return min(max(1, math.ceil(fraction * num_windows)), num_windows - 1)


def validation_args(data_args):
    """The `DataArgs` of the `data.validation.source` corpus, or None where there is none."""
    if data_args.validation is None or data_args.validation.source is None:
        return None
    return replace(data_args, source=data_args.validation.source, sources=[])


def write_cache_meta(
    path: str, source, text_column: str, tokenizer, dtype, counts: dict, max_documents: Optional[int], key: str
) -> None:
    """The cache's ``meta.json``, written last (atomically): what was tokenised, how, and how much;
    a cache without it is not complete."""
    meta = {
        "format_version": FORMAT_VERSION,
        "source": source.spec,
        "kind": source.kind,
        "text_column": text_column,
        "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "separator_id": tokenizer.separator_id,
        "dtype": dtype.name,
        "num_tokens": counts["tokens"],
        "num_documents": counts["docs"],
        "max_documents": max_documents,
        "key": key,
    }
    atomic_write(os.path.join(path, "meta.json"), lambda fh: fh.write(json.dumps(meta, indent=1).encode()))


def cache_location(
    source: Source, tokenizer: Tokenizer, data_args, cache_dir: str, max_documents: Optional[int] = None
) -> tuple[str, str]:
    """(cache folder, key) of a source: what `build` reads or writes, known without tokenising."""
    key_parts = [FORMAT_VERSION, source.fingerprint(), data_args.text_column, tokenizer.fingerprint, max_documents]
    key = hashlib.sha256(json.dumps(key_parts, default=str).encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(cache_dir), _cache_name(source, tokenizer, key)), key


def source_bytes(source: Source) -> int:
    """The size on disk of a source's files (0 for a hub dataset, which has none listed)."""
    return sum(os.path.getsize(f) for f in source.files)


def too_big_to_build(source: Source, max_build_mb: Optional[float]) -> Optional[str]:
    """Why a training job must not tokenise `source` itself, or None (`data.max_build_mb`)."""
    if max_build_mb is None:
        return None
    if source.kind == "hub":
        size = "a hub dataset, of unknown size"
    else:
        mb = source_bytes(source) / 1e6
        if mb <= max_build_mb:
            return None
        size = f"{mb:,.0f} MB"
    return (
        f"data.source: {source.spec!r} ({size}) has no tokenised cache yet and is above "
        f"data.max_build_mb={max_build_mb:g}: run `python submit.py CONFIG --prepare-data` first "
        f"(a CPU job), or raise data.max_build_mb"
    )


class _TokenisingBar:
    """tqdm over documents, with tokens so far and the input rate in MB/s (from the files'
    size on disk; a hub dataset shows no rate). `datasets`' own bars are off meanwhile."""

    def __init__(self, texts, source: Source):
        import datasets
        from tqdm import tqdm

        datasets.disable_progress_bars()
        self._bytes = source_bytes(source) if source.files else None
        self._total = len(texts)
        self._bar = tqdm(
            total=len(texts),
            unit="doc",
            desc=f"preparing {os.path.basename(source.spec) or source.spec}",
            dynamic_ncols=True,
        )

    def advance(self, docs: int, tokens: int) -> None:
        self._bar.update(docs)
        elapsed = max(self._bar.format_dict["elapsed"], 1e-9)
        rate = {"tokens": f"{tokens:,}"}
        if self._bytes is not None:
            rate["MB/s"] = f"{self._bytes * self._bar.n / self._total / elapsed / 1e6:.1f}"
        self._bar.set_postfix(rate, refresh=True)

    def close(self) -> None:
        import datasets

        self._bar.close()
        datasets.enable_progress_bars()


def _write_token_chunks(fh, chunks, dtype, counts: dict) -> None:
    """Stream Arrow list chunks of token ids into ``fh`` as raw ``dtype``; count docs and tokens."""
    for chunk in chunks:
        lengths = np.diff(np.asarray(chunk.offsets))
        counts["docs"] += int(np.count_nonzero(lengths))
        ids = chunk.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        counts["tokens"] += int(ids.size)
        fh.write(ids.tobytes())


def _tokenise(
    source: Source,
    tokenizer: Tokenizer,
    data_args,
    path: str,
    key: str,
    cache_dir: str,
    max_documents: Optional[int],
    progress: bool = False,
) -> None:
    """Tokenise with `datasets.map` (batched, `num_workers` processes), then stream the result
    into `tokens.bin`. The map's own Arrow files are scratch: `tokens.bin` is the cache, at a
    fraction of the size, and deleting the scratch keeps the cache folder to the two files."""
    import datasets

    texts = load_texts(source, data_args.text_column, os.path.join(cache_dir, "hf"), max_documents)
    dtype = token_dtype(tokenizer.vocab_size)
    os.makedirs(path, exist_ok=True)
    scratch = os.path.join(path, f"map-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(scratch)
    num_proc = data_args.num_workers if data_args.num_workers > 1 else None
    if num_proc:
        # Rust-side threads in the parent plus forked workers can deadlock; workers are the
        # parallelism here.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    seq_type = getattr(datasets, "List", None) or datasets.Sequence  # List: datasets >= 4
    counts = {"tokens": 0, "docs": 0}
    bar = _TokenisingBar(texts, source) if progress else None
    shards = max(1, min(50, len(texts) // 200)) if progress else 1  # a bar that moves

    def write(fh) -> None:
        for i in range(shards):
            part = texts.shard(shards, i, contiguous=True) if shards > 1 else texts
            tokenised = part.map(
                _encode,
                batched=True,
                batch_size=256,
                num_proc=num_proc if len(part) > 1 else None,
                fn_kwargs={"tokenizer": tokenizer, "column": data_args.text_column, "dtype": dtype.name},
                remove_columns=texts.column_names,
                features=datasets.Features({"input_ids": seq_type(datasets.Value(dtype.name))}),
                cache_file_name=os.path.join(scratch, f"tokenised-{i}.arrow"),
                new_fingerprint=f"{key}-{i}",
                desc=f"tokenising {source.spec}",
            )
            _write_token_chunks(fh, tokenised.data.column("input_ids").chunks, dtype, counts)
            del tokenised  # close its memory map before the scratch folder goes
            if bar is not None:
                bar.advance(len(part), counts["tokens"])

    try:
        atomic_write(os.path.join(path, "tokens.bin"), write)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if bar is not None:
            bar.close()
    if counts["tokens"] == 0:
        os.remove(os.path.join(path, "tokens.bin"))
        raise DataError(
            f"data.source: {source.spec!r} has {len(texts)} documents but every "
            f"{data_args.text_column!r} is empty; point data.source at data with text"
        )
    write_cache_meta(path, source, data_args.text_column, tokenizer, dtype, counts, max_documents, key)
