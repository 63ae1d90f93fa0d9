"""One owner at a time for a run directory and its checkpoint directory.

Why: a second run started in a live run's directory resumed from its checkpoints, deleted its
in-progress `step_N.tmp` as a "leftover" (the first then died) and interleaved logs; a run whose
`checkpoints.path` pointed into another run's resumed foreign weights and pruned them.

* `<dir>/owner.lock` (JSON: run id, host, SLURM node, pid and its start time, SLURM job id and
  restart, start time, command) is created with O_EXCL by rank 0 of the task before anything
  reads or writes checkpoints, logs or TensorBoard files, and removed when the task ends. It is
  taken for the run directory and for the checkpoint directory (`checkpoints.path`, which
  another run may share).
* A lock whose owner is gone is *stale*: its SLURM job is no longer pending/running (squeue), or,
  without a job, its pid is dead or belongs to another process (start time differs) on this host.
  A stale lock is reported (one line naming the dead owner) and taken over. A live owner — or one
  on another host that cannot be checked — refuses the start with one `error:` line naming it;
  the same SLURM job's next incarnation (a requeue) takes over its predecessor's lock.
* `<run_dir>/run_id` (created once) is the run's identity: stored in every checkpoint's
  meta.json, so a checkpoint written by another run is refused on resume and never pruned
  (`nanotrain.checkpoint`), unless `checkpoints.allow_foreign` says so.

`check_before_launch` runs the same checks in `submit.py`, before a job is queued or local ranks
start, together with the run's recorded SLURM job (`--resume` while that job is still pending or
running would put a second job beside it).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nanotrain.runtime import slurm_commands

LOCK = "owner.lock"
RUN_ID = "run_id"
LIVE_JOB_STATES = {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
}


class OwnershipError(ValueError):
    """The directory has a live owner (or an unverifiable one): a user error, one line, exit 2."""


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the
    pid it identifies a process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def me(run_id: str | None = None) -> dict:
    return {
        "run_id": run_id,
        "host": socket.gethostname(),
        "node": os.environ.get("SLURMD_NODENAME"),
        "pid": os.getpid(),
        "pid_start": _pid_start(os.getpid()),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv)[:300],
    }


def describe(holder: dict) -> str:
    job = f", SLURM job {holder['job_id']}" if holder.get("job_id") else ""
    node = f" (node {holder['node']})" if holder.get("node") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{node}{job}, since {holder.get('started')}"


def job_state(job_id: str) -> str | None:
    """squeue's state of a job, "" when squeue no longer lists it, None when squeue can't say."""
    try:
        proc = slurm_commands.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"])
    except slurm_commands.SlurmCommandError:
        return None
    if proc.returncode != 0:  # "Invalid job id specified": finished and purged
        return "" if "Invalid job id" in proc.stderr else None
    return (proc.stdout.split() or [""])[0]


def alive(holder: dict) -> tuple[bool | None, str]:
    """(True: a live owner, False: stale, None: cannot tell), with the evidence."""
    if holder.get("job_id"):
        state = job_state(holder["job_id"])
        if state is None:
            return None, f"squeue cannot tell whether SLURM job {holder['job_id']} still runs"
        if state in LIVE_JOB_STATES:
            return True, f"SLURM job {holder['job_id']} is {state}"
        return False, f"SLURM job {holder['job_id']} is no longer queued or running"
    if holder.get("host") != socket.gethostname():
        return None, f"it runs on another host ({holder.get('host')}), which this one cannot check"
    pid = holder.get("pid")
    if isinstance(pid, int) and _pid_start(pid) is not None and _pid_start(pid) == holder.get("pid_start"):
        return True, f"process {pid} is running"
    return False, f"process {pid} is gone"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        return {"unreadable": f"{type(e).__name__}: {e}"}
    return data if isinstance(data, dict) else {"unreadable": "not a JSON object"}


def _verdict(directory: Path, holder: dict, run_id: str | None) -> tuple[bool, str]:
    """(take it over?, why) for an existing lock; raises OwnershipError for a live owner."""
    if holder.get("unreadable"):
        return True, f"unreadable lock {directory / LOCK} ({holder['unreadable']})"
    mine = me(run_id)
    if holder.get("pid") == mine["pid"] and holder.get("pid_start") == mine["pid_start"]:
        return True, ""  # our own (taken twice)
    if holder.get("job_id") and holder.get("job_id") == mine["job_id"]:
        return True, ""  # the same SLURM job's previous incarnation (requeued)
    live, why = alive(holder)
    if live is False:
        return True, f"stale lock {directory / LOCK} of {describe(holder)}: {why}; taking it over"
    fix = (
        f"wait for it to end or stop it (scancel {holder['job_id']})"
        if holder.get("job_id")
        else f"stop it, or delete {directory / LOCK} if you are sure it is not running"
    )
    raise OwnershipError(
        f"{directory} is in use by another run ({describe(holder)}; {why}): {fix}, "
        "or give this run another logging.run_name / checkpoints.path"
    )


def acquire(directory: Path, run_id: str | None) -> str:
    """Take `directory`'s lock for this process; returns a note about a stale lock taken over
    ("" if none). Raises OwnershipError when another owner is alive or cannot be checked."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    note = ""
    for _ in range(5):
        tmp = directory / f".{LOCK}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(me(run_id), indent=1) + "\n")
        try:
            os.link(tmp, path)  # atomic, fails if a lock exists (O_EXCL that also works on NFS)
            return note
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        try:
            holder = _read(path)
        except FileNotFoundError:
            continue  # released meanwhile: try again
        take, why = _verdict(directory, holder, run_id)
        note = note or why
        aside = directory / f".{LOCK}.taken.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        if _read(aside) != holder:  # another starter replaced the stale lock meanwhile: its lock
            os.link(aside, path)
            aside.unlink()
            raise OwnershipError(f"{directory}: another run took it over at the same moment ({describe(_read(path))})")
        aside.unlink()
    raise OwnershipError(f"{directory}: could not take {LOCK} (it keeps changing)")


def release(directory: Path) -> None:
    """Remove the lock if it is still this process's."""
    path = directory / LOCK
    try:
        holder = _read(path)
    except FileNotFoundError:
        return
    mine = me()
    if holder.get("pid") == mine["pid"] and holder.get("pid_start") == mine["pid_start"]:
        path.unlink(missing_ok=True)


def ensure_run_id(run_dir: Path) -> str:
    """The run's identity, created once (O_EXCL) and kept when the run directory moves."""
    path = run_dir / RUN_ID
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as fh:
        fh.write(uuid.uuid4().hex + "\n")
    return path.read_text().strip()


def owned_dirs(run_dir: Path, checkpoint_dir: Path) -> list[Path]:
    """Both, always: a checkpoint directory inside one run directory may be another run's
    `checkpoints.path`, and that run locks only the checkpoint directory."""
    run_dir, checkpoint_dir = Path(run_dir).resolve(), Path(checkpoint_dir).resolve()
    return [run_dir] if checkpoint_dir == run_dir else [run_dir, checkpoint_dir]


@dataclass
class Claim:
    """What rank 0 holds while the task runs; every rank gets the run id."""

    run_id: str
    dirs: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        for directory in self.dirs:
            release(directory)


def claim(run_dir: Path, checkpoint_dir: Path, is_rank0: bool, broadcast) -> Claim:
    """Rank 0 takes the locks and the run id; `broadcast` (rank 0's object to every rank) shares
    the outcome, so a refusal raises OwnershipError on every rank at once."""
    result, held = None, []
    if is_rank0:
        try:
            run_id = ensure_run_id(Path(run_dir))
            notes = []
            for directory in owned_dirs(run_dir, checkpoint_dir):
                note = acquire(directory, run_id)
                held.append(directory)
                if note:
                    notes.append(note)
            result = {"run_id": run_id, "notes": notes}
        except (OwnershipError, OSError) as e:
            for directory in held:
                release(directory)
            held = []
            result = {"error": str(e)}
    result = broadcast(result)
    if "error" in result:
        raise OwnershipError(result["error"])
    return Claim(result["run_id"], held, result["notes"])


def check_before_launch(run_dir: Path, checkpoint_dir: Path, job_id: str | None) -> list[str]:
    """`submit.py`'s check before it queues a job or starts ranks: the run's recorded SLURM job
    must not be pending or running, and no live owner may hold the directories. Raises
    OwnershipError; returns notes about stale locks (the task takes them over)."""
    if job_id:
        state = job_state(str(job_id))
        if state in LIVE_JOB_STATES:
            raise OwnershipError(
                f"{run_dir}: its SLURM job {job_id} is still {state}; wait for it to end or "
                f"cancel it (scancel {job_id}) before resuming or starting it again"
            )
    notes = []
    for directory in owned_dirs(run_dir, checkpoint_dir):
        try:
            holder = _read(directory / LOCK)
        except FileNotFoundError:
            continue
        take, why = _verdict(directory, holder, None)
        if why:
            notes.append(why)
    return notes
