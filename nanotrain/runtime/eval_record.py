"""The record of a run's evaluation jobs: ``<run>/eval/step_<N>.json``, one file per checkpoint.

Three processes write a checkpoint's record, each what only it knows: the training job's rank 0
when the checkpoint is committed (``submitting``, the submitter's pid and host), the submitter
once sbatch answered (``queued`` and the job id, or ``not submitted`` and why), the evaluation
job itself (``running``, ``read`` once the weights are in its memory, then ``done`` with every
source's loss, or ``failed`` with its one error line). Each change is a read-modify-write under
an ``flock`` of the record's lock file and an atomic replace, so a reader never sees half a file
and no writer's fields are lost to another's.

``read`` is what ``checkpoints.keep_last`` waits for (``protects``): a checkpoint whose job has
not read it yet is not deleted while that job may still come to read it (queued or running); a
job that ended without reading it (cancelled, failed before loading) leaves the record
``skipped`` and the checkpoint to the usual pruning. ``--status`` shows the records.

Standard library only: ``submit.py --status`` reads these without importing torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator, Optional

from nanotrain.config.atomic_files import atomic_write_json
from nanotrain.runtime import slurm_commands

EVAL_DIR = "eval"
# States no process moves on from (the scheduler may still tell more about a job that died).
FINISHED = ("done", "failed", "skipped", "not submitted")


def eval_dir(run_dir: Path) -> Path:
    return Path(run_dir) / EVAL_DIR


def record_path(run_dir: Path, step: int) -> Path:
    return eval_dir(run_dir) / f"step_{int(step):06d}.json"


def read_record(run_dir: Path, step: int) -> Optional[dict]:
    """The record of ``step``, or None (no evaluation job was started for it, or it is unreadable)."""
    try:
        record = json.loads(record_path(run_dir, step).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_records(run_dir: Path) -> list[dict]:
    """Every readable record of the run, by step."""
    records = []
    for path in sorted(eval_dir(run_dir).glob("step_*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return sorted(records, key=lambda r: r["step"])


@contextlib.contextmanager
def _locked(run_dir: Path, step: int) -> Iterator[None]:
    path = record_path(run_dir, step).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def update_record(
    run_dir: Path,
    step: int,
    only_if_state: tuple[str, ...] | None = None,
    whole: bool = False,
    fresh: bool = False,
    **fields,
) -> dict:
    """Merge ``fields`` into the record of ``step`` (made if missing; ``fresh``: replacing it)
    and write it atomically. ``only_if_state``: unless the record's state is one of these, the
    state is left as it is (a submitter that answers after its job already started must not turn
    ``running`` back into ``queued``), and with ``whole`` nothing is written at all. Returns the
    record."""
    with _locked(run_dir, step):
        record = {"step": int(step)} if fresh else read_record(run_dir, step) or {"step": int(step)}
        if only_if_state is not None and record.get("state") not in only_if_state:
            if whole:
                return record
            fields = {k: v for k, v in fields.items() if k != "state"}
        record.update(fields, updated=time.time())
        atomic_write_json(record_path(run_dir, step), record, durable=False)
    return record


def here() -> dict:
    """Where this process runs, for a record: host and pid (to ask later whether it still lives)."""
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _pid_alive(record: dict) -> bool:
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False  # another node's process (a requeued job): it cannot be asked from here
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _slurm_job_alive(job_id: str) -> Optional[bool]:
    """Whether SLURM still holds the job (pending, running, completing...); None when squeue does
    not answer. All of the user's jobs are listed rather than the one asked for: `squeue -j` of a
    job that ended long ago fails like a squeue that does not answer."""
    out = slurm_commands.answer(["squeue", "-h", "-u", str(os.getuid()), "-o", "%i"])
    if out is None:
        return None
    return str(job_id) in {line.strip() for line in out.splitlines()}


def protects(run_dir: Path, step: int) -> bool:
    """Whether ``checkpoints.keep_last`` must keep the checkpoint of ``step`` for its evaluation
    job: one was started and has not read it, and may still do so. A job found gone without
    having read it is recorded ``skipped`` here (it never will), which releases the checkpoint."""
    record = read_record(run_dir, step)
    if record is None or record.get("read") or record.get("state") in FINISHED:
        return False
    state = record.get("state")
    if state == "submitting" or record.get("launcher") == "local":
        alive = _pid_alive(record)  # the submitter, or the local evaluation process
    elif record.get("job_id"):
        alive = _slurm_job_alive(record["job_id"])
        if alive is None:
            return True  # the scheduler did not answer: keep it, the next save asks again
    else:
        alive = False
    if alive:
        return True
    with _locked(run_dir, step):  # unless the job moved on meanwhile (it read the checkpoint)
        now = read_record(run_dir, step) or {}
        if now.get("read") or now.get("state") != state:
            return not now.get("read") and now.get("state") not in FINISHED
        now.update(
            state="skipped",
            error="the evaluation job ended without reading the checkpoint; keep_last pruned it",
            updated=time.time(),
        )
        atomic_write_json(record_path(run_dir, step), now, durable=False)
    return False
