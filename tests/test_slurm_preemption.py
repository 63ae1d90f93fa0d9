"""Preemption and time limits on the real local SLURM cluster.

A 2-node x 4-task CPU job is preempted twice with `scancel --signal=USR2` (what SLURM sends
before a preemption or time limit) and once by a real job in a higher-priority partition. Each
time every rank agrees on the step, saves, the job requeues itself and resumes. It completes,
and its TensorBoard loss sequence equals an uninterrupted run's, with no step lost or repeated.
A second job reaches its time limit while training (the limit is lowered once a step is done)
and saves, requeues and finishes the same way. A third, with `slurm.max_requeues: 0`, saves on
the preemption signal, is not requeued and exits 75 (not COMPLETED), as `--status` says.

The first job also trains under `training.spike.policy: skip` with two poisoned steps (the test
hook ``NANOTRAIN_TEST_SPIKE``, tests/hooks/sitecustomize.py, in every rank of every incarnation):
step 2's gradient is not finite, step 26's is 1000x too large, so at least one preemption falls
between them. Each is skipped once, recorded once in spikes.jsonl, and the losses still equal an
uninterrupted local run with the same poison: a skip survives a requeue bit for bit."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers.processes import step_of
from helpers.slurm import (
    TERMINAL,
    accounting,
    cancel,
    job_state,
    restart_count,
    run_seconds,
    start_now_if_requeued,
    submitted_job_id,
    wait_for_job,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
HOOKS = ROOT / "tests" / "hooks"
POISON = "poison=2:inf,26:1000"  # the steps the first job skips (one non-finite, one spike)
SKIP = ["training.spike.policy=skip", "training.spike.window=4"]
pytestmark = [pytest.mark.slurm]


def submit(
    tmp_path: Path, name: str, steps: int, *extra: str, local: bool = False, spike: str = ""
) -> subprocess.CompletedProcess:
    """``submit.py`` (SLURM, or ``--local``); ``spike``: the test hook's poison, passed to the job
    through the environment sbatch exports (every task of every incarnation reads it)."""
    env = dict(os.environ)
    if spike:
        env["NANOTRAIN_TEST_SPIKE"] = spike
        env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), env.get("PYTHONPATH", "")])
    items = [
        f"logging.dir={tmp_path}",
        f"logging.run_name={name}",
        f"training.train_steps={steps}",
        "logging.log_interval=1",
        "checkpoints.interval=0",
        "slurm.max_requeues=6",
        *extra,
    ]
    args = [sys.executable, str(ROOT / "submit.py"), str(TINY)] + (["--local"] if local else [])
    for item in items:
        args += ["--set", item]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


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
    proc = submit(tmp_path, "preempted", steps, "slurm.partition=low", *SKIP, spike=POISON)
    assert proc.returncode == 0, proc.stderr
    job_id, run_dir = submitted_job_id(proc.stdout), tmp_path / "preempted"
    last = 0
    for attempt in range(3):
        wait_until(lambda: running_past(job_id, run_dir, last + 3), 240, f"training past step {last + 3}", job_id)
        restarts = restart_count(job_id)
        if attempt < 2:  # what submitit's job._interrupt() and SLURM's time limit send
            subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        else:  # a real higher-priority job that needs both nodes
            high = subprocess.run(
                [
                    "sbatch",
                    "-p",
                    "high",
                    "-N2",
                    "--exclusive",
                    "--wrap",
                    "sleep 2",
                    "-o",
                    str(tmp_path / "high-%j.out"),
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            high_id = submitted_job_id(high.stdout)
        wait_until(lambda: restart_count(job_id) > restarts, 180, "the job to requeue", job_id)
        last = step_of(run_dir)
    assert wait_for_job(high_id, timeout=120) == "COMPLETED"
    wait_until(lambda: job_state(job_id) != "PENDING" or start_now_if_requeued(job_id), 120, "restart", job_id)
    assert wait_for_job(job_id, timeout=400) == "COMPLETED"
    assert restart_count(job_id) >= 3

    reference = submit(tmp_path, "straight", steps, *SKIP, local=True, spike=POISON)
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    got, expected = losses(run_dir), losses(tmp_path / "straight")
    skipped = [json.loads(line) for line in (run_dir / "spikes.jsonl").read_text().splitlines()]
    assert [r["step"] for r in skipped] == [2, 26], skipped  # each once, across the requeues
    assert [s for s, _ in got] == list(range(1, steps + 1))  # no step lost, none repeated
    assert got == expected
    logs = "".join(p.read_text() for p in (run_dir / "job").glob(f"{job_id}_0_log.out"))
    assert logs.count("preempted at step") >= 3 and logs.count("(same topology)") >= 3


@pytest.mark.timeout(900)
def test_time_limit_saves_requeues_and_finishes(slurm_cluster, tmp_path):
    """A job that reaches its time limit while training is signalled by SLURM itself, saves,
    requeues, resumes where it saved and finishes with the losses of an uninterrupted run.

    slurmctld checks limits every 30 s and sends the warning at the first check where
    now + 30 s >= end - delay. A limit set at submission would let that check come during
    start-up, before any step (with --time=1 within 20-50 s of the start, which a loaded machine
    can spend starting up): nothing to save, and the test could not tell a save from none. So
    the job starts with a 15-minute limit and the test waits for evidence of a trained step
    (progress.json), then lowers the limit (`scontrol update`, as an operator would) to the
    next whole minute that lies 60-120 s ahead: with a 90 s delay the warning then comes at the
    next check (<= 30 s later: after step 1 by construction), and the end (>= 30 s after it)
    leaves the save and the requeue their time (measured: saved at steps 22 and 80, 19 and 44 s
    into the run).
    200 steps (~65 s of training on a quiet 2-core box) cannot end before the warning. Once it
    has saved and requeued, the limit goes back up so that the second incarnation runs to the
    end. A constant learning rate (after warm-up) makes the first K steps' losses independent of
    `training.train_steps`, so the uninterrupted run it is compared with stops 5 steps past the
    resumed one's save instead of training all 200."""
    steps = 200
    constant_lr = "optimizer.lr_decay_style=constant"
    proc = submit(
        tmp_path, "timelimit", steps, "slurm.time=15", "slurm.signal_delay_s=90", "slurm.max_requeues=20", constant_lr
    )
    assert proc.returncode == 0, proc.stderr
    job_id, run_dir = submitted_job_id(proc.stdout), tmp_path / "timelimit"
    try:
        wait_until(lambda: running_past(job_id, run_dir, 0), 240, "the first trained step", job_id)
        limit_min = math.ceil((run_seconds(job_id) + 60) / 60)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit_min}"], check=True, timeout=30)

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
    finally:
        cancel(job_id)
    logs = "".join(p.read_text() for p in (run_dir / "job").glob(f"{job_id}_0_log.out"))
    saved = re.findall(r"preempted at step (\d+) \(SIGUSR2", logs)
    assert len(saved) == 1 and 1 <= int(saved[0]) < steps, logs[-3000:]  # saved once, while training
    assert "requeued job" in logs, logs[-3000:]
    assert f"at step {saved[0]} (same topology)" in logs, logs[-3000:]  # resumed where it saved
    got = losses(run_dir)
    assert [s for s, _ in got] == list(range(1, steps + 1))  # no step lost, none repeated
    compared = int(saved[0]) + 5
    reference = submit(tmp_path, "straight", compared, constant_lr, local=True)
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    assert got[:compared] == losses(tmp_path / "straight")  # the resumed steps equal uninterrupted ones


@pytest.mark.timeout(600)
def test_preempted_with_no_requeue_left_saves_and_exits_75(slurm_cluster, tmp_path, capsys):
    """`slurm.max_requeues: 0`: a preemption signal after a trained step makes every rank save;
    the requeue budget is spent, so the job is not requeued and ends with exit code 75 (state
    FAILED, never COMPLETED), which `--status` reports with the command that resumes it."""
    from nanotrain.checkpoint.layout import complete_checkpoints
    from nanotrain.commands.status import show_status

    steps = 300  # cannot finish in the seconds between the first step and the signal
    proc = submit(tmp_path, "norequeue", steps, "slurm.max_requeues=0")
    assert proc.returncode == 0, proc.stderr
    job_id, run_dir = submitted_job_id(proc.stdout), tmp_path / "norequeue"
    try:
        wait_until(lambda: running_past(job_id, run_dir, 1), 240, "training past step 1", job_id)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        wait_for_job(job_id, timeout=240)
    finally:
        cancel(job_id)
    assert accounting(job_id) == ("FAILED", "75:0")
    assert restart_count(job_id) == 0
    logs = "".join(p.read_text() for p in (run_dir / "job").glob(f"{job_id}_0_log.*"))
    saved = re.findall(r"preempted at step (\d+) \(", logs)
    assert len(saved) == 1 and 2 <= int(saved[0]) < steps, logs[-3000:]
    assert "= slurm.max_requeues; not requeueing again" in logs, logs[-3000:]
    assert "requeued job" not in logs
    assert [step for step, _ in complete_checkpoints(run_dir / "checkpoints")] == [int(saved[0])]

    capsys.readouterr()
    assert show_status(run_dir) == 0
    out = capsys.readouterr().out
    assert "state: FAILED" in out and "requeues: 0" in out, out
    assert "exit code: 75, stopped and saved, but not requeued" in out, out
    assert f"resume with: python submit.py --resume {run_dir}" in out, out
