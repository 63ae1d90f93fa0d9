"""Where the text comes from: local files, a hub dataset, or Python's own standard library.

`resolve_source` turns the `data.source` string into a `Source` by looking only at file names,
sizes and parquet footers, never at the data, so the CLI can reject a bad path before it submits a job.
`load_texts` then reads it with Hugging Face `datasets`. Every source yields documents in a fixed
order (sorted file names), because the token stream, and so every batch, must be the same on
every machine and every run.

The `stdlib` source exists so the default configs train on real text without a download: the
`.py` files of the running interpreter's standard library (about 12 MB on CPython 3.11), minus
its test suites (large, full of deliberately odd files, and absent from many distro Pythons) and
any installed packages.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from typing import Literal, Optional

from nanotrain.config.paths import FILE_OR_DIR, PathError, bounded_glob, check_path, walk_files
from nanotrain.data.errors import DataError

STDLIB = "stdlib"

# File extension -> the `datasets` packaged builder that reads it. In a directory only these are
# picked up (so a README or LICENSE next to the data is ignored); a single file or a glob with any
# other extension is read as plain text, which lets `source: "src/**/*.py"` train on code.
BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?(:[\w.-]+)?$")
_FIX = (
    "point data.source at a .txt/.json/.jsonl/.csv/.parquet file, a directory or glob of "
    "them, a hub dataset name, or 'stdlib'"
)


@dataclass(frozen=True)
class Source:
    """A resolved `data.source`: what to read, and a fingerprint that changes when the data does."""

    spec: str  # data.source as the user wrote it
    kind: Literal["stdlib", "files", "hub"]
    files: tuple[str, ...] = ()  # absolute paths, sorted (files and stdlib)
    builder: Optional[str] = None  # datasets builder for `files`
    hub_name: Optional[str] = None
    hub_config: Optional[str] = None

    def fingerprint(self) -> list:
        """Names, sizes and mtimes of the files: cheap, and a changed file invalidates the cache.

        A hub dataset is identified by its name only; its revision is whatever `datasets` cached.
        """
        if self.kind == "hub":
            return ["hub", self.hub_name, self.hub_config]
        head = ["stdlib", sys.version] if self.kind == STDLIB else ["files", self.builder]
        stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in self.files]
        return head + stats


def _ext(path: str) -> str:
    """The data extension of a file name, looking through a compression suffix (`.jsonl.gz`)."""
    stem, ext = os.path.splitext(path.lower())
    return os.path.splitext(stem)[1] if ext in _COMPRESSED else ext


def _kind_of(path: str) -> str:
    """The `datasets` builder for one file name; unknown extensions are plain text."""
    return BUILDERS.get(_ext(path), "text")


def _looks_like_path(spec: str) -> bool:
    """Whether `spec` is meant as a local path (so a missing one is an error, not a hub name)."""
    return (
        os.path.lexists(os.path.expanduser(spec))
        or any(c in spec for c in "*?[")
        or spec.startswith(("/", "./", "../", "~"))
        or spec.endswith(os.sep)
        or _ext(spec) in BUILDERS
        or not _HUB_NAME.match(spec)
    )


def stdlib_files() -> tuple[str, ...]:
    """The standard library's own `.py` files, sorted by path relative to its root."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP and not d.startswith(".")]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return tuple(sorted(found, key=lambda p: os.path.relpath(p, root)))


def _directory_files(path: str) -> list[str]:
    """Regular data files under a directory, recursively, skipping hidden entries (e.g. a `.cache`);
    bounded like a glob (config.paths.walk_files), so `data.source: /` cannot walk the file system."""
    return [f for f in _bounded(walk_files, path) if _ext(f) in BUILDERS]


def _bounded(walk, path: str) -> list[str]:
    try:
        return walk("data.source", path)
    except PathError as exc:
        raise DataError(str(exc)) from None


def resolve_source(spec: str) -> Source:
    """Classify `data.source` (`stdlib`, files, a directory, a glob, or a hub dataset name) and
    list its files (a hub name is not looked up here).

    Raises:
        DataError: the path is missing or refused by the path checker, a glob or directory finds
            no data files (or visits too many directories), the files mix kinds, or they hold no
            text.
    """
    if spec == STDLIB:
        files = stdlib_files()
        if not files:
            root = sysconfig.get_paths()["stdlib"]
            raise DataError(f"data.source: 'stdlib' found no .py files under {root}; {_FIX}")
        return Source(spec, STDLIB, files=files)
    if not _looks_like_path(spec):
        name, _, config = spec.partition(":")
        return Source(spec, "hub", hub_name=name, hub_config=config or None)

    path = os.path.expanduser(spec)
    if any(c in path for c in "*?["):
        files = _bounded(bounded_glob, path)  # regular files only: a FIFO is never opened
        if not files:
            raise DataError(f"data.source: the glob {spec!r} matches no files; {_FIX}")
    elif os.path.isdir(
        check_path(
            "data.source",
            path,
            FILE_OR_DIR,
            DataError,
            missing=f"data.source: no such file or directory {spec!r}; {_FIX}",
        )
    ):
        files = _directory_files(path)
        if not files:
            raise DataError(f"data.source: directory {spec!r} holds no {'/'.join(sorted(BUILDERS))} files; {_FIX}")
    else:
        files = [path]

    files = sorted(os.path.abspath(f) for f in files)
    kinds = sorted({_kind_of(f) for f in files})
    if len(kinds) > 1:
        raise DataError(
            f"data.source: {spec!r} mixes file kinds ({', '.join(kinds)}); "
            f"point data.source at one kind, e.g. a glob like '<dir>/*.jsonl'"
        )
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(
            f"data.source: {spec!r} is empty ({len(files)} file(s), all 0 bytes); "
            f"point data.source at files that hold text"
        )
    if kinds == ["parquet"]:
        import pyarrow.parquet as pq  # row counts sit in the footer: cheap, and datasets

        if all(pq.read_metadata(f).num_rows == 0 for f in files):  # fails obscurely on 0 rows
            raise DataError(
                f"data.source: {spec!r} has no documents (0 rows); point data.source at data that holds text"
            )
    return Source(spec, "files", files=tuple(files), builder=kinds[0])


def peek_columns(source: Source) -> Optional[list[str]]:
    """The column names of a local source from its first file only, without loading the data.

    Used by the pre-submit check; None where that would need a full read (a JSON array, a hub
    dataset) and the check is left to the real build.
    """
    if source.kind == STDLIB:
        return ["path", "text"]
    if source.kind != "files":
        return None
    first = next(f for f in source.files if os.path.getsize(f) > 0)
    if source.builder == "text":
        return ["text"]
    if first.endswith(_COMPRESSED):
        return None
    if source.builder == "parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(first).names)
    with open(first, encoding="utf-8", errors="replace") as fh:
        line = next((ln for ln in fh if ln.strip()), "")
    if source.builder == "csv":
        import csv

        return next(csv.reader([line]), [])
    try:
        record = json.loads(line)
    except ValueError:
        return None  # a pretty-printed JSON document; `datasets` will read it whole
    return list(record) if isinstance(record, dict) else None


def _stdlib_dataset(files: tuple[str, ...]):
    """The stdlib files as an in-memory `Dataset` with `path` and `text` columns.

    Bytes that aren't UTF-8 (a few files declare latin-1) are replaced, deterministically.
    """
    import datasets

    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for f in files:
        with open(f, "rb") as fh:
            texts.append(fh.read().decode("utf-8", errors="replace"))
    return datasets.Dataset.from_dict({"path": [os.path.relpath(f, root) for f in files], "text": texts})


def load_texts(source: Source, text_column: str, hf_cache_dir: str, max_documents: Optional[int] = None):
    """The source as a `datasets.Dataset` holding only `text_column`, capped at `max_documents`.

    `datasets` keeps its Arrow copy of local/hub data under `hf_cache_dir`, not in the user's
    `~/.cache/huggingface`, so one run's cache is self-contained and shared between its ranks.
    """
    import datasets

    if source.kind == STDLIB:
        files = source.files[:max_documents] if max_documents is not None else source.files
        ds = _stdlib_dataset(files)
    else:
        kwargs: dict = {"split": "train", "cache_dir": hf_cache_dir}
        if source.kind == "files":
            args: tuple = (source.builder,)
            kwargs["data_files"] = list(source.files)
            if source.builder == "text":
                kwargs["sample_by"] = "document"  # one file = one document, newlines kept
        else:
            args = (source.hub_name, source.hub_config) if source.hub_config else (source.hub_name,)
        try:
            ds = datasets.load_dataset(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - datasets raises many types; report one line
            while exc.__cause__ is not None:  # DatasetGenerationError wraps the useful one
                exc = exc.__cause__
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            hint = (
                "hub datasets need network on the nodes; otherwise download it elsewhere "
                "and point data.source at the files"
                if source.kind == "hub"
                else _FIX
            )
            raise DataError(
                f"data.source: cannot load {source.spec!r} ({type(exc).__name__}: {first}); {hint}"
            ) from exc
    if len(ds) == 0:
        raise DataError(
            f"data.source: {source.spec!r} has no documents (0 rows); point data.source at data that holds text"
        )
    if text_column not in ds.column_names:
        raise DataError(
            f"data.text_column: {text_column!r} is not a column of {source.spec!r} "
            f"(columns present: {ds.column_names}); set data.text_column to one of them"
        )
    feature = ds.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(
            f"data.text_column: column {text_column!r} of {source.spec!r} holds "
            f"{feature}, not text; set data.text_column to a string column"
        )
    ds = ds.select_columns([text_column])
    if max_documents is not None and len(ds) > max_documents:
        ds = ds.select(range(max_documents))
    return ds
