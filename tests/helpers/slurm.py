"""Helpers for tests that submit real jobs: wait with a hard timeout, cancel on the way out."""

from __future__ import annotations

import re
import subprocess
import time

TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def job_state(job_id: str) -> str | None:
    """The allocation's state from sacct (scontrol as a fallback while sacct lags)."""
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    if out:
        return out.splitlines()[0].split()[0]
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"JobState=(\S+)", out)
    return match.group(1) if match else None


def wait_for_job(job_id: str, timeout: float) -> str:
    """Block until the job ends; past `timeout` cancel it and fail (a hang is a failure)."""
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state in TERMINAL:
            return state
        time.sleep(1.0)
    subprocess.run(["scancel", job_id], timeout=30)
    raise AssertionError(f"job {job_id} still {state} after {timeout:.0f} s; cancelled")


def submitted_job_id(output: str) -> str:
    match = re.search(r"(?:submitted job|Submitted batch job) (\d+)", output)
    assert match, f"no job id in output: {output!r}"
    return match.group(1)


def restart_count(job_id: str) -> int:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"Restarts=(\d+)", out)
    return int(match.group(1)) if match else 0


def wait_until(predicate, timeout: float, what: str, job_id: str | None = None, interval: float = 0.5):
    """Poll `predicate()` until truthy; past `timeout` cancel the job (if any) and fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    if job_id is not None:
        subprocess.run(["scancel", job_id], timeout=30)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job_field(job_id: str, name: str) -> str | None:
    """One field of ``scontrol show job`` (``NumTasks``, ``ExcNodeList``, ...), or None."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    match = re.search(rf"(?<![\w/]){name}=(\S*)", out)
    return match.group(1) if match else None


def start_now_if_requeued(job_id: str) -> None:
    """A requeued job waits `cred_expire` (30 s here) in PENDING/BeginTime; start it at once."""
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True, timeout=30)


def run_seconds(job_id: str) -> int:
    """How long the job's current incarnation has run (scontrol's ``RunTime``), in seconds."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    match = re.search(r"RunTime=(?:(\d+)-)?(\d+):(\d+):(\d+)", out)
    assert match, f"no RunTime for job {job_id}: {out!r}"
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def accounting(job_id: str) -> tuple[str, str]:
    """(State, ExitCode) of the job's last incarnation from sacct, e.g. ("FAILED", "75:0")."""
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"], capture_output=True, text=True, timeout=30
    ).stdout
    rows = [row.split("|") for row in out.splitlines() if row.strip()]
    assert rows, f"sacct knows no job {job_id}"
    return rows[-1][0].split()[0], rows[-1][1]


def cancel(job_id: str | None) -> None:
    """``scancel`` a job a test submitted (its ``finally``: nothing outlives a failed test)."""
    if job_id is not None:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
