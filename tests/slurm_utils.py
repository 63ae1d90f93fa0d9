"""Helpers for tests that submit real jobs: wait with a hard timeout, cancel on the way out."""
from __future__ import annotations

import re
import subprocess
import time

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
            "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def job_state(job_id: str) -> str | None:
    """The allocation's state from sacct (scontrol as a fallback while sacct lags)."""
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"],
                         capture_output=True, text=True, timeout=30).stdout.strip()
    if out:
        return out.splitlines()[0].split()[0]
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                         timeout=30).stdout
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
