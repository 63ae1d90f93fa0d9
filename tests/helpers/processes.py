"""The processes and state of a running job, read from outside it: the step it has logged, the pid
of one of its ranks (local or a SLURM task), and its latest checkpoint, checked complete and intact."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from nanotrain.checkpoint import read_latest
from nanotrain.checkpoint.format import verify_checkpoint


def step_of(run_dir: Path) -> int:
    """The step in the run's progress.json; 0 while there is none (or it cannot be read)."""
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def _alive(pid: int) -> bool:
    """A running (not zombie) local rank: a fork server's child or a ``nanotrain.launch`` process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return fields[0] not in ("Z", "X") and b"nanotrain.launch" in cmdline


def rank_pid(run_dir: Path, rank: int) -> int | None:
    """The process of `rank` of the run in `run_dir`, while it runs: a local rank (the launcher's
    `job/ranks.json` names it: a rank forked by the fork server has the server's command line) or
    a SLURM task (submitit's runner, its command line names the job folder)."""
    try:
        pid = json.loads((run_dir / "job" / "ranks.json").read_text())["ranks"][str(rank)]
    except (OSError, ValueError, KeyError):
        pid = None
    if pid is not None and _alive(pid):
        return pid
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(run_dir) not in cmdline:
            continue
        local = "nanotrain.runtime.task" in cmdline and f"RANK={rank}".encode() in environ
        slurm = "submitit.core._submit" in cmdline and f"SLURM_PROCID={rank}".encode() in environ
        if local or slurm:
            return int(entry.name)
    return None


def signal_rank(run_dir: Path, rank: int, sig: int) -> tuple[int, float]:
    """Send ``sig`` to ``rank`` of the run in ``run_dir`` (local rank or SLURM task), which must
    exist; returns (its pid, the monotonic time the signal went)."""
    pid = rank_pid(run_dir, rank)
    assert pid is not None, f"rank {rank} not found"
    os.kill(pid, sig)
    return pid, time.monotonic()


def assert_latest_intact(run_dir: Path) -> int:
    """The step of the run's latest checkpoint, after asserting it exists and verifies."""
    root = run_dir / "checkpoints"
    latest = read_latest(root)
    assert latest is not None, "no complete checkpoint"
    assert verify_checkpoint(root / latest) == [], f"{latest} is damaged"
    return int(latest.split("_")[1])
