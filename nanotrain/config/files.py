"""Atomic file writes, one implementation for every layer (the config package is the bottom one).

A reader — `--status` reading progress.json while the job writes it, a rank loading the token
cache another node is building, a resume reading `latest` — must see the old file or the new one,
never half of either: write a uniquely named sibling, then ``os.replace`` it over the target (one
rename, atomic on POSIX file systems). The name carries host, pid and a random part, so writers
racing on a shared file system (one per node) never write into each other's temp file.
``durable=True`` also fsyncs the file and its directory (checkpoint commits survive a crash).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import BinaryIO, Callable


def fsync_dir(path: str | Path) -> None:
    """Make a rename in ``path`` durable (where the file system allows fsync on a directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], *, durable: bool = False,
                 mode: int = 0o644) -> None:
    """``write(fh)`` into a temp sibling of ``path``, then rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)  # others on the cluster may read it (--status)
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str, *, durable: bool = False) -> None:
    atomic_write(path, lambda fh: fh.write(text.encode()), durable=durable)


def atomic_write_json(path: str | Path, data, *, durable: bool = False) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n", durable=durable)


def first_missing(path: str | Path) -> Path | None:
    """The outermost directory of ``path`` that does not exist yet (what ``mkdir -p`` would make),
    or None when ``path`` exists."""
    path, missing = Path(path).absolute(), None
    while not path.exists() and path != path.parent:
        missing, path = path, path.parent
    return missing


@contextlib.contextmanager
def removed_on_failure(directory: str | Path):
    """Run the block that writes into ``directory``; if it raises (Ctrl-C included), remove what
    it made before re-raising: the directory with every parent it created if it did not exist,
    else the entries added to it. So a refusal after writing began leaves nothing behind (an
    entry the block replaced in place cannot be restored: callers check before they write)."""
    made = first_missing(directory)
    before = set() if made is not None else set(Path(directory).iterdir())
    try:
        yield
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        else:
            for entry in set(Path(directory).iterdir()) - before:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        raise
