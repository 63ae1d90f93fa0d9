"""Issue 17, item 3, on the real local SLURM cluster: a user's `scancel` saves and ends CANCELLED
without a requeue (it used to requeue and run again to COMPLETED), and `--resume` refuses while
the run's job is still pending or running. The preemption / time-limit requeue path is proven
by test_slurm_preemption.py; what this cluster cannot produce (a preemption that sends only
SIGTERM, an accounting-less cluster) is covered by feeding `classify_sigterm` the scheduler's
answers recorded on this cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nanotrain.runtime import ownership, preemption

from helpers.processes import assert_latest_intact, rank_pid, step_of
from helpers.runs import set_args
from helpers.slurm import restart_count, submitted_job_id, wait_for_job, wait_until

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def submit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_scancel_saves_and_ends_cancelled_without_requeue(slurm_cluster, tmp_path):
    items = [
        "parallelism.dp=2",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "slurm.tasks_per_node=1",
        f"logging.dir={tmp_path}",
        "logging.run_name=c",
        "training.train_steps=100000",
        "logging.log_interval=1",
        "checkpoints.interval=0",
        "slurm.max_requeues=3",
    ]
    proc = submit(str(TINY), *set_args(items))
    assert proc.returncode == 0, proc.stderr
    job_id, run_dir = submitted_job_id(proc.stdout), tmp_path / "c"
    wait_until(lambda: step_of(run_dir) >= 3, 300, "step 3", job_id)
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    assert wait_for_job(job_id, timeout=120) == "CANCELLED"
    wait_until(lambda: all(rank_pid(run_dir, r) is None for r in range(2)), 60, "the tasks to exit")
    # Rank 0 decides before it exits: had it requeued, Restarts would already be 1 now.
    assert restart_count(job_id) == 0
    acct = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-D", "-o", "State"], capture_output=True, text=True, timeout=30
    ).stdout.split("\n")
    assert [row.split()[0] for row in acct if row.strip()] == ["CANCELLED"]  # one incarnation
    log = (run_dir / "job" / f"{job_id}_0_log.out").read_text()
    saved = assert_latest_intact(run_dir)
    assert f"cancelled at step {saved} (SIGTERM, a user's scancel" in log and "not requeued" in log, log[-2000:]
    assert "requeued job" not in log

    # submit.py counts a COMPLETING job (tasks still being killed) as live: wait for SLURM to finish it
    wait_until(lambda: ownership.job_state(job_id) not in ownership.LIVE_JOB_STATES, 120, "the job to leave the queue")
    resumed = submit("--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    new_job = submitted_job_id(resumed.stdout)
    try:
        twice = submit("--resume", str(run_dir))  # the new job is pending or running: refused
        errors = [line for line in twice.stderr.splitlines() if line.startswith("error:")]
        assert twice.returncode == 2 and len(errors) == 1 and "Traceback" not in twice.stderr, twice.stderr
        assert f"SLURM job {new_job} is still" in errors[0] and f"scancel {new_job}" in errors[0]
    finally:
        subprocess.run(["scancel", new_job], timeout=30)
    assert wait_for_job(new_job, timeout=120) == "CANCELLED"


# What `scontrol show job` / `sacct` said at the SIGTERM on this cluster (Slurm 22.05.8): scancel,
# a partition preemption (PreemptMode=REQUEUE: SLURM has requeued before the TERM), a time limit.
SCONTROL = {
    "scancel": "JobState=COMPLETING Reason=None Dependency=(null)\n   Requeue=1 Restarts=0 BatchFlag=1",
    "preempt": "JobState=COMPLETING Reason=None Dependency=(null)\n   Requeue=1 Restarts=1 BatchFlag=1",
    "timelimit": "JobState=COMPLETING Reason=TimeLimit Dependency=(null)\n   Requeue=1 Restarts=0 BatchFlag=1",
}
SACCT = {"scancel": "CANCELLED by 0\n", "preempt": "PREEMPTED\n", "timelimit": "TIMEOUT\n"}
SACCT_ONLY = {"scancel": "cancelled", "preempt": "preempted", "timelimit": "timeout"}


@pytest.mark.parametrize(
    "case,accounting,expected",
    [
        ("scancel", True, "cancelled"),
        ("preempt", True, "preempted"),
        ("timelimit", True, "timeout"),
        ("scancel", False, "cancelled"),
        ("preempt", False, "preempted"),
        ("timelimit", False, "timeout"),
    ],
)
def test_sigterm_is_told_apart_by_the_jobs_record(monkeypatch, case, accounting, expected):
    def answers(argv):
        if argv[0] == "scontrol":
            return SCONTROL[case]
        return SACCT[case] if accounting else ""

    monkeypatch.setattr(preemption, "_run", answers)
    kind, evidence = preemption.classify_sigterm("7", restart_count=0)
    assert kind == expected and "scontrol JobState=COMPLETING" in evidence


@pytest.mark.parametrize("case", list(SACCT_ONLY))
def test_sacct_alone_decides_when_scontrol_shows_nothing(monkeypatch, case):
    """E.g. a cluster whose scontrol record shows no reason yet: accounting's state decides."""

    def answers(argv):
        return "JobState=RUNNING Reason=None Dependency=(null)\n   Restarts=0" if argv[0] == "scontrol" else SACCT[case]

    monkeypatch.setattr(preemption, "_run", answers)
    kind, evidence = preemption.classify_sigterm("7", restart_count=0)
    assert kind == SACCT_ONLY[case] and f"sacct {SACCT[case].split()[0]}" in evidence
