"""On-disk format: names, shard metadata as JSON, checksummed file writes, the commit primitives.

Everything here is plain file and JSON work with no torch.distributed, so the writer, the loader
and the offline resharder share one definition of the format. The layout is documented in
``nanotrain/checkpoint/__init__.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch

from nanotrain.checkpoint.layout import (  # noqa: F401 (re-exported)
    COMPLETE,
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    META,
    CheckpointError,
    CheckpointMismatch,
    complete_checkpoints,
    is_tmp_name,
    load_candidates,
    parse_step,
    read_latest,
    read_meta,
    read_safetensors_header,
    stale_entries,
    step_dir_name,
)
from nanotrain.config.atomic_files import atomic_write_text, fsync_dir
from nanotrain.parallel.sharding import ShardInfo

HEADER_KEY = "nanotrain"  # safetensors __metadata__ key holding the per-tensor shard records (JSON)


# ----------------------------------------------------------------------------- names
def coord_tag(**coords: int) -> str:
    """``pp-00_tp-01`` style tag; axes whose value is None are left out."""
    return "_".join(f"{axis}-{value:02d}" for axis, value in coords.items() if value is not None)


# ----------------------------------------------------------------------------- shard metadata
def _slices_to_json(index) -> list[list[int]]:
    out = []
    for s in index:
        if s.step not in (None, 1):
            raise CheckpointError(f"strided shard slices are not supported: {s}")
        out.append([int(s.start), int(s.stop)])
    return out


def info_to_json(info: ShardInfo) -> dict:
    return {
        "global_shape": list(info.global_shape),
        "axis": info.axis,
        "pairs": [[_slices_to_json(local), _slices_to_json(glob)] for local, glob in info.pairs],
    }


def info_from_json(data: dict) -> ShardInfo:
    def idx(spans):
        return tuple(slice(a, b) for a, b in spans)

    return ShardInfo(
        tuple(data["global_shape"]), tuple((idx(loc), idx(glob)) for loc, glob in data["pairs"]), data.get("axis")
    )


def canonical(obj) -> str:
    """Stable JSON (sorted keys, no spaces): for hashing and for comparing records."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def key_hash(obj) -> str:
    return hashlib.sha1(canonical(obj).encode()).hexdigest()[:16]


DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- checksummed I/O
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
HASH_THREADS = 2  # per file: the tensors of one file hashed side by side (hashlib releases the GIL)
CHECKSUM = "sha256 of each tensor's bytes and of the header; file digest = sha256(header digest + tensor digests)"


def safetensors_prefix(header: dict) -> bytes:
    """What a safetensors file starts with: the 8-byte little-endian header length, then the
    header as compact JSON (keys in ``header``'s order), space-padded to a multiple of 8 bytes."""
    head_bytes = json.dumps(header, separators=(",", ":")).encode()
    head_bytes += b" " * (-len(head_bytes) % 8)
    return struct.pack("<Q", len(head_bytes)) + head_bytes


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes: no copy for a contiguous CPU tensor (a view into ZeRO-1's flat buffer
    included), one tensor-sized copy otherwise (GPU, strided)."""
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _sha256(raw: memoryview) -> str:
    return hashlib.sha256(raw).hexdigest()


def file_digest(header_sha256: str, tensor_sha256: Iterable[str]) -> str:
    return hashlib.sha256((header_sha256 + "".join(tensor_sha256)).encode()).hexdigest()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], header: dict) -> dict:
    """Stream a safetensors file to disk, hashing as it goes, and fsync it.

    Written here rather than with ``safetensors.torch.save`` (which builds the whole file as one
    bytes object first): no second copy of the rank's shard in memory. Each tensor and the header
    get their own sha256, so a loader verifies exactly the bytes it reads (a rank taking one norm
    from another rank's file does not hash that whole file). Returns the meta.json record:
    ``{"bytes", "digest", "header_sha256", "tensors": {key: sha256}}``.
    """
    head, offset = {}, 0
    for key, t in tensors.items():
        size = t.numel() * t.element_size()
        head[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head["__metadata__"] = {HEADER_KEY: canonical(header)}
    prefix = safetensors_prefix(head)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The bytes go to the page cache first, unhashed; the tensors are then hashed on
    # HASH_THREADS threads while this one waits for the disk (fsync). hashlib, file writes and
    # fsync all release the GIL, so a file costs write + max(hash, fsync) instead of the sum of
    # all three; hashing while writing would take the cores the writes need.
    with open(path, "wb") as f, ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="nanotrain-sha256") as hasher:
        f.write(prefix)
        raws = {}
        for key, t in tensors.items():
            raws[key] = _raw(t)
            f.write(raws[key])
        f.flush()
        pending = {key: hasher.submit(_sha256, raw) for key, raw in raws.items()}
        os.fsync(f.fileno())
        digests = {key: job.result() for key, job in pending.items()}
    header_sha = hashlib.sha256(prefix).hexdigest()
    return {
        "bytes": len(prefix) + offset,
        "digest": file_digest(header_sha, digests.values()),
        "header_sha256": header_sha,
        "tensors": digests,
    }


def write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------- commit primitives
def write_meta_and_complete(ckpt_dir: Path, meta: dict) -> None:
    """meta.json, then COMPLETE holding meta.json's sha256 (so meta.json is checked too)."""
    for sub in ("model", "optimizer", "state"):
        if (ckpt_dir / sub).is_dir():
            fsync_dir(ckpt_dir / sub)
    text = json.dumps(meta, indent=1, sort_keys=False) + "\n"
    write_bytes(ckpt_dir / META, text.encode())
    write_complete(ckpt_dir, hashlib.sha256(text.encode()).hexdigest())


def write_complete(ckpt_dir: Path, meta_sha256: str) -> None:
    write_bytes(ckpt_dir / COMPLETE, f"sha256 {meta_sha256}\n".encode())
    fsync_dir(ckpt_dir)


def commit_rename(tmp_dir: Path, final_dir: Path) -> None:
    """step_N.tmp -> step_N. An existing step_N (a stale one from an abandoned future, or a
    repeated step) is first renamed aside to a *.tmp name, which the loader ignores."""
    if final_dir.exists():
        aside = final_dir.with_name(final_dir.name + ".replaced.tmp")
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final_dir, aside)
        os.rename(tmp_dir, final_dir)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


def update_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST, name + "\n")


def remove_dir(path: Path) -> None:
    """Delete a checkpoint directory without ever exposing a half-deleted COMPLETE one: rename it
    to a *.tmp name first (atomic), then delete."""
    aside = path.with_name(path.name + ".deleting.tmp")
    try:
        os.rename(path, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


# ----------------------------------------------------------------------------- discovery
def verify_file(ckpt_dir: Path, rel: str, record: dict | None, keys: Iterable[str] | None = None) -> str | None:
    """None if ``rel`` has its recorded size and header, and the tensors ``keys`` (None = all)
    their recorded sha256; else the reason, naming the file (and tensor)."""
    path = ckpt_dir / rel
    if record is None:
        return f"{path}: not listed in {META}"
    try:
        size = path.stat().st_size
    except OSError:
        return f"{path}: missing"
    if size != record["bytes"]:
        return f"{path}: size {size} bytes, expected {record['bytes']} (truncated or altered)"
    try:
        prefix, head = read_safetensors_header(path)
    except (CheckpointError, ValueError, OSError) as e:
        return f"{path}: unreadable header ({e})"
    if hashlib.sha256(prefix).hexdigest() != record["header_sha256"]:
        return f"{path}: header sha256 mismatch (altered)"
    wanted = list(record["tensors"]) if keys is None else list(keys)
    with open(path, "rb") as f:
        for key in wanted:
            if key not in head or key not in record["tensors"]:
                return f"{path}: tensor {key!r} missing"
            start, stop = head[key]["data_offsets"]
            f.seek(len(prefix) + start)
            h, left = hashlib.sha256(), stop - start
            while left > 0:
                block = f.read(min(left, 16 << 20))
                if not block:
                    return f"{path}: truncated inside tensor {key!r}"
                h.update(block)
                left -= len(block)
            if h.hexdigest() != record["tensors"][key]:
                return f"{path}: tensor {key!r} sha256 mismatch (altered)"
    if keys is None:
        in_order = (record["tensors"][k] for k in head if k != "__metadata__")
        if file_digest(record["header_sha256"], in_order) != record["digest"]:
            return f"{path}: file digest mismatch"
    return None


def verify_checkpoint(ckpt_dir: Path) -> list[str]:
    """Every file of a checkpoint, completely (offline tools; the loader checks what it reads).
    Returns the problems found, each naming its file ([] = intact); raises CheckpointError
    when meta.json or COMPLETE is unreadable, altered or of an unknown format."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    return [p for rel, rec in meta["files"].items() if (p := verify_file(ckpt_dir, rel, rec))]
