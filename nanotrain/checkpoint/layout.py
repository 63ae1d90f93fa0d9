"""The checkpoint directory's names, how to find and read a checkpoint's meta.json, and the
header of a safetensors file.

Standard library only (no torch), so `submit.py` can look at a run's checkpoints before it
launches anything (which checkpoint a resume would load, whose it is, which model it holds)
without paying seconds for importing torch. `format.py` re-exports all of it.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Iterable

from nanotrain.config import Config, ModelArgs, MoEArgs, config_to_dict

FORMAT = "nanotrain-checkpoint"
FORMAT_VERSION = 1
META = "meta.json"
COMPLETE = "COMPLETE"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^step_\d+(\.[A-Za-z0-9_-]+)*\.tmp$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded (the message says which file / parameter)."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint is intact but is not this run's to load: another model shape, or another
    run's identity. A user's decision (exit 2, one line), never a reason to fall back."""


# ----------------------------------------------------------------------------- names
def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def is_tmp_name(name: str) -> bool:
    return bool(_TMP_RE.match(name))


def read_latest(root: Path) -> str | None:
    """The ``step_N`` name that ``<root>/latest`` holds, or None when the file is missing,
    unreadable or names no step (never raises: a resume then looks for complete checkpoints)."""
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if parse_step(name) is not None else None


# ----------------------------------------------------------------------------- discovery
def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every directory named step_N holding COMPLETE, newest first; [] when
    ``root`` cannot be listed. Only the marker is checked, not the files (``verify_checkpoint``)."""
    out = []
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return []
    for p in entries:
        step = parse_step(p.name)
        if step is not None and p.is_dir() and (p / COMPLETE).is_file():
            out.append((step, p))
    return sorted(out, reverse=True)


def load_candidates(root: Path) -> list[Path]:
    """Checkpoints to try, in order: the one ``latest`` names (if complete), then the complete
    ones older than it, newest first. Without a valid ``latest``: every complete one, newest
    first. Complete checkpoints newer than ``latest`` (a crash between the rename and the update
    of ``latest``, or the abandoned future of a rolled-back run) are not used."""
    found = complete_checkpoints(root)
    latest = read_latest(root)
    if latest is not None:
        steps = {p.name: s for s, p in found}
        if latest in steps:
            return [p for s, p in found if s <= steps[latest]]
    return [p for _, p in found]


def stale_entries(root: Path) -> Iterable[Path]:
    """Leftovers of interrupted saves: *.tmp directories and step_N without COMPLETE."""
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return []
    out = []
    for p in entries:
        if not p.is_dir():
            continue
        if is_tmp_name(p.name) or (parse_step(p.name) is not None and not (p / COMPLETE).is_file()):
            out.append(p)
    return out


def read_safetensors_header(path: Path, error: type[CheckpointError] = CheckpointError) -> tuple[bytes, dict]:
    """(the raw 8-byte length + header, the parsed header) of a safetensors file, read without
    torch (checkpoint files and Hugging Face directories alike); a bad file raises ``error``."""
    with open(path, "rb") as f:
        size_bytes = f.read(8)
        if len(size_bytes) != 8:
            raise error(f"{path}: shorter than a safetensors header")
        (size,) = struct.unpack("<Q", size_bytes)
        if size > 100 << 20:
            raise error(f"{path}: implausible header size {size}")
        raw = f.read(size)
    if len(raw) != size:
        raise error(f"{path}: header truncated")
    try:
        return size_bytes + raw, json.loads(raw)
    except ValueError:
        raise error(f"{path}: not a safetensors file (unreadable header)") from None


def read_meta(ckpt_dir: Path) -> dict:
    """meta.json, checked against the sha256 in COMPLETE. Raises CheckpointError naming the file."""
    try:
        complete = (ckpt_dir / COMPLETE).read_text().split()
        data = (ckpt_dir / META).read_bytes()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{ckpt_dir}: cannot read {META}/{COMPLETE}: {e}") from None
    if len(complete) != 2 or complete[0] != "sha256":
        raise CheckpointError(f"{ckpt_dir / COMPLETE}: unexpected content")
    if hashlib.sha256(data).hexdigest() != complete[1]:
        raise CheckpointError(f"{ckpt_dir / META}: checksum mismatch (file altered or truncated)")
    try:
        meta = json.loads(data)
    except ValueError:  # written with its checksum, yet not JSON: not a file nanotrain wrote
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt_dir / META}: not a {FORMAT} checkpoint")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt_dir / META}: format version {meta['format_version']} is newer "
            f"than this code understands ({FORMAT_VERSION})"
        )
    return meta


# Model fields that say how, not what, the model computes: a resumed run may change them.
COMPUTE_ONLY = ("dtype", "attention_kernel")


def _model_fields(config: dict | None) -> dict:
    """The ``model`` section of a config dict, with every field it lacks at its default: a
    checkpoint written before a field existed computed what the default computes."""
    defaults = config_to_dict(Config())["model"]
    model = dict((config or {}).get("model") or {})
    out = {k: v for k, v in {**defaults, **model}.items() if k not in COMPUTE_ONLY}
    if isinstance(out.get("moe"), dict):
        moe_defaults = config_to_dict(Config(model=ModelArgs(moe=MoEArgs())))["model"]["moe"]
        out["moe"] = {**moe_defaults, **out["moe"]}
    return out


def model_differences(saved: dict | None, mine: dict | None) -> list[str]:
    """Fields of the `model` sections of two config dicts that differ (``COMPUTE_ONLY`` aside: a
    resumed run may change its compute dtype or attention kernel), as 'name (saved value saved,
    value now)'."""
    saved, mine = _model_fields(saved), _model_fields(mine)
    return [
        f"{k} ({saved.get(k)!r} saved, {mine.get(k)!r} now)"
        for k in sorted(set(saved) | set(mine))
        if saved.get(k) != mine.get(k)
    ]
