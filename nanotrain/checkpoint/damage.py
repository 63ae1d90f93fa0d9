"""Damaged checkpoints are moved aside, never trusted, never counted, never deleted.

Why a separate state at all: a checkpoint directory named ``step_N`` holding COMPLETE is what
every other part of the code counts as good (``latest``, the loader's candidates, keep_last
pruning, the save that skips a step ``latest`` already names). A checkpoint that failed
verification and kept its name would go on being counted: the next save at that step was skipped
because the directory "existed", pruning could delete the last good checkpoint to keep the
damaged one, and every resume fell back past it again. Renaming it to
``step_N.damaged`` (``step_N.damaged-2``, ... if that exists) takes it out of all of those at
once — the name matches neither ``step_N`` nor the ``*.tmp`` leftovers that a save deletes — while
the bytes stay on disk for inspection, with ``DAMAGED.txt`` saying what was wrong and when. A
false alarm (a file that was only unreadable for a moment) is undone with one ``mv``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from nanotrain.checkpoint import format as fmt
from nanotrain.checkpoint.format import CheckpointError
from nanotrain.config.atomic_files import fsync_dir

log = logging.getLogger("nanotrain.checkpoint")

DAMAGED_SUFFIX = ".damaged"
REASON_FILE = "DAMAGED.txt"


def is_damaged_name(name: str) -> bool:
    base, _, rest = name.partition(DAMAGED_SUFFIX)
    return bool(rest == "" or rest.startswith("-")) and name != base and fmt.parse_step(base) is not None


def quarantine(ckpt_dir: Path, problems: list[str]) -> Path | None:
    """Rename ``step_N`` to ``step_N.damaged[-K]`` and write why; returns the new path (None if
    it could not be moved, e.g. a read-only file system: then it is only reported)."""
    ckpt_dir = Path(ckpt_dir)
    target = ckpt_dir.with_name(ckpt_dir.name + DAMAGED_SUFFIX)
    k = 2
    while target.exists():
        target = ckpt_dir.with_name(f"{ckpt_dir.name}{DAMAGED_SUFFIX}-{k}")
        k += 1
    try:
        os.rename(ckpt_dir, target)
    except OSError as e:
        log.warning("checkpoint %s is damaged but could not be moved aside (%s): %s", ckpt_dir, e, "; ".join(problems))
        return None
    fsync_dir(target.parent)
    try:
        (target / REASON_FILE).write_text(
            f"moved aside {time.strftime('%Y-%m-%dT%H:%M:%S')} by pid {os.getpid()}: failed verification\n"
            + "".join(f"  {p}\n" for p in problems)
        )
    except OSError:
        pass
    log.warning(
        "checkpoint %s failed verification and was moved aside to %s (kept for inspection, "
        "never loaded or counted): %s",
        ckpt_dir,
        target.name,
        "; ".join(problems),
    )
    return target


def full_problems(ckpt_dir: Path) -> list[str]:
    """Every file of the checkpoint against meta.json (sha256 of every tensor): the check a save
    makes before it trusts a directory instead of writing its own."""
    try:
        return fmt.verify_checkpoint(ckpt_dir)
    except CheckpointError as e:
        return [str(e)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{ckpt_dir}: unreadable ({type(e).__name__}: {e})"]


def quick_problems(ckpt_dir: Path) -> tuple[list[str], dict | None]:
    """meta.json against COMPLETE and every listed file present with its recorded size: cheap
    (no hashing), catches truncation, deletion and an altered meta.json. Used by pruning, which
    must not count a checkpoint among the kept ones without looking at it. Returns (problems,
    meta)."""
    try:
        meta = fmt.read_meta(ckpt_dir)
    except CheckpointError as e:
        return [str(e)], None
    except (ValueError, TypeError) as e:
        return [f"{ckpt_dir / fmt.META}: unreadable ({e})"], None
    problems = []
    for rel, rec in (meta.get("files") or {}).items():
        try:
            size = (ckpt_dir / rel).stat().st_size
        except OSError:
            problems.append(f"{ckpt_dir / rel}: missing")
            continue
        if size != rec.get("bytes"):
            problems.append(f"{ckpt_dir / rel}: size {size} bytes, expected {rec.get('bytes')} (truncated or altered)")
    return problems, meta


def prune(root: Path, step: int, keep_last: int, run_id: str | None = None, protected=None) -> list[Path]:
    """Keep the checkpoint of ``step`` (just written and checked) and the ``keep_last - 1`` newest
    complete ones before it; delete older ones.

    Only checkpoints of ``run_id`` are considered: another run's (a ``checkpoints.path`` shared
    on purpose, ``checkpoints.allow_foreign``) are never deleted. A checkpoint is counted among
    the kept ones only after a size check (``quick_problems``): one that fails is moved aside,
    so the last good checkpoint is never pruned in favour of a damaged one. Complete
    checkpoints after ``step`` (an abandoned future of a rolled-back run) are left alone.
    ``protected(step)``: true for a checkpoint that must stay beyond ``keep_last`` for now (an
    evaluation job has yet to read it); asked only of one that would be deleted, and not counted
    among the kept. Returns the directories deleted."""
    kept, removed = 0, []
    for s, p in (sp for sp in fmt.complete_checkpoints(root) if sp[0] < step):  # newest first
        problems, meta = quick_problems(p)
        if meta is not None and meta.get("run_id") != run_id:
            continue  # another run's checkpoint: not ours to delete
        if problems:
            quarantine(p, problems)
        elif kept < keep_last - 1:
            kept += 1
        elif protected is not None and protected(s):
            log.info("keeping %s beyond checkpoints.keep_last: its evaluation job has not read it yet", p)
        else:
            fmt.remove_dir(p)
            removed.append(p)
    return removed
