"""Preemption and time limits on the real local SLURM cluster.

A 2-node x 4-task CPU job is preempted twice with `scancel --signal=USR2` (what SLURM sends
before a preemption or time limit) and once by a real job in a higher-priority partition. Each
time every rank agrees on the step, saves, the job requeues itself and resumes. It completes,
and its TensorBoard loss sequence equals an uninterrupted run's, with no step lost or repeated.
A second job with a 1-minute time limit saves, requeues and finishes the same way."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers.processes import step_of
from helpers.slurm import (
    TERMINAL,
    job_state,
    restart_count,
    start_now_if_requeued,
    submitted_job_id,
    wait_for_job,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
pytestmark = [pytest.mark.slurm]


def submit(tmp_path: Path, name: str, steps: int, *extra: str, local: bool = False) -> subprocess.CompletedProcess:
    items = [f"logging.dir={tmp_path}", f"logging.run_name={name}", f"training.train_steps={steps}",
             "logging.log_interval=1", "checkpoints.interval=0", "slurm.max_requeues=6", *extra]
    args = [sys.executable, str(ROOT / "submit.py"), str(TINY)] + (["--local"] if local else [])
    for item in items:
        args += ["--set", item]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)


def losses(run_dir: Path) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def running_past(job_id: str, run_dir: Path, step: int):
    """True once the job runs (again) and has trained beyond `step`; restarts a requeued job."""
    state = job_state(job_id)
    if state == "PENDING":
        start_now_if_requeued(job_id)
    if state in TERMINAL:
        raise AssertionError(f"job {job_id} ended ({state}) before it was preempted")
    return state == "RUNNING" and step_of(run_dir) > step


@pytest.mark.timeout(900)
def test_preempted_three_times_completes_with_identical_losses(slurm_cluster, tmp_path):
    steps = 30
    proc = submit(tmp_path, "preempted", steps, "slurm.partition=low")
    assert proc.returncode == 0, proc.stderr
    job_id, run_dir = submitted_job_id(proc.stdout), tmp_path / "preempted"
    last = 0
    for attempt in range(3):
        wait_until(lambda: running_past(job_id, run_dir, last + 3), 240, f"training past step {last + 3}", job_id)
        restarts = restart_count(job_id)
        if attempt < 2:  # what submitit's job._interrupt() and SLURM's time limit send
            subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        else:  # a real higher-priority job that needs both nodes
            high = subprocess.run(["sbatch", "-p", "high", "-N2", "--exclusive", "--wrap", "sleep 2",
                                   "-o", str(tmp_path / "high-%j.out")],
                                  capture_output=True, text=True, timeout=30, check=True)
            high_id = submitted_job_id(high.stdout)
        wait_until(lambda: restart_count(job_id) > restarts, 180, "the job to requeue", job_id)
        last = step_of(run_dir)
    assert wait_for_job(high_id, timeout=120) == "COMPLETED"
    wait_until(lambda: job_state(job_id) != "PENDING" or start_now_if_requeued(job_id), 120, "restart", job_id)
    assert wait_for_job(job_id, timeout=400) == "COMPLETED"
    assert restart_count(job_id) >= 3

    reference = submit(tmp_path, "straight", steps, local=True)
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    got, expected = losses(run_dir), losses(tmp_path / "straight")
    assert [s for s, _ in got] == list(range(1, steps + 1))  # no step lost, none repeated
    assert got == expected
    logs = "".join(p.read_text() for p in (run_dir / "job").glob(f"{job_id}_0_log.out"))
    assert logs.count("preempted at step") >= 3 and logs.count("(same topology)") >= 3


@pytest.mark.timeout(900)
def test_time_limit_saves_requeues_and_finishes(slurm_cluster, tmp_path):
    """A job whose training outlasts its 1-minute limit is signalled by SLURM itself, saves,
    requeues and finishes.

    slurmctld checks limits every 30 s and sends the warning at the first check where
    now + 30 s >= end - delay: with --time=1 and a 10 s delay that is 20-50 s after the start
    (with a 30 s delay it can be within seconds, while submitit is still unpickling the task and
    its own handler requeues without our save: seen here at 5 s under load). The run is sized so
    that it cannot end inside that window (200 steps: ~65 s of training on a quiet 2-core box;
    the window leaves at most ~42 s after start-up). Once SLURM's signal has made it save and
    requeue, the test raises the time limit (`scontrol update`, as an operator would) so that
    the second incarnation runs to the end: without that, the number of 1-minute incarnations a
    loaded machine needs (each trains only from its start-up to the signal) is unbounded, and a
    test must not depend on the load."""
    steps = 200
    proc = submit(tmp_path, "timelimit", steps, "slurm.time=1", "slurm.signal_delay_s=10", "slurm.max_requeues=20")
    assert proc.returncode == 0, proc.stderr
    job_id, run_dir = submitted_job_id(proc.stdout), tmp_path / "timelimit"

    def requeued():
        state = job_state(job_id)
        if state in TERMINAL:
            raise AssertionError(f"job {job_id} ended ({state}) before its time limit requeued it")
        return restart_count(job_id) >= 1

    wait_until(requeued, 240, "the time-limit signal to requeue the job", job_id, interval=1.0)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=15"], check=True, timeout=30)

    def finished():
        state = job_state(job_id)
        if state == "PENDING":
            start_now_if_requeued(job_id)
        return state if state in TERMINAL else None

    assert wait_until(finished, 600, "the job to finish", job_id, interval=2.0) == "COMPLETED"
    got = losses(run_dir)
    assert [s for s, _ in got] == list(range(1, steps + 1))  # no step lost, none repeated
    logs = "".join(p.read_text() for p in (run_dir / "job").glob(f"{job_id}_0_log.out"))
    assert "requeued job" in logs, logs[-3000:]
    saved = re.findall(r"preempted at step (\d+)", logs)
    if saved:  # the warning came while training: saved there, and the next incarnation resumed there
        assert int(saved[0]) < steps
        assert f"at step {saved[0]} (same topology)" in logs
    else:  # it came before the first step (a slow start-up): rank 0 requeued at once, nothing to save
        assert "during start-up, before any step: nothing to save, requeueing now" in logs, logs[-3000:]
