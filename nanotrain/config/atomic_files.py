"""Atomic file writes, one implementation for every layer (the config package is the bottom one).

A reader — `--status` reading progress.json while the job writes it, a rank loading the token
cache another node is building, a resume reading `latest` — must see the old file or the new one,
never half of either: write a uniquely named sibling (same directory, so the rename never crosses
file systems), flush and fsync it, ``os.replace`` it over the target (one rename, atomic on POSIX
file systems), then fsync the directory so that the rename itself survives a crash. The name
carries host, pid and a random part, so writers racing on a shared file system (one per node)
never write into each other's temp file; a failed write leaves no temp file behind.

``durable=False`` skips both fsyncs (the old-or-new guarantee for readers stays); a caller that
passes it says why a crash losing the newest version is acceptable there.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path
from typing import BinaryIO, Callable


def fsync_dir(path: str | Path) -> None:
    """Make the renames and new entries in directory ``path`` durable (where the file system
    allows opening and fsyncing a directory; where it does not, this does nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(fd)


def atomic_write(
    path: str | Path, write: Callable[[BinaryIO], None], *, durable: bool = True, mode: int = 0o644
) -> None:
    """``write(fh)`` into a temp sibling of ``path``, then rename it over ``path`` (module doc)."""
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


def atomic_write_bytes(path: str | Path, data: bytes, *, durable: bool = True) -> None:
    atomic_write(path, lambda fh: fh.write(data), durable=durable)


def atomic_write_text(path: str | Path, text: str, *, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), durable=durable)


def atomic_write_json(path: str | Path, data, *, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n", durable=durable)
