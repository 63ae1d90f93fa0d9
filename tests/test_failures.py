"""Failure behaviour: one rank killed with SIGKILL ends the whole job non-zero within 60 s with the
last complete checkpoint intact (locally and on real SLURM), and a cancelled SLURM run continues
with `submit.py --resume` from its latest complete checkpoint."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotrain.runtime.ownership import LIVE_JOB_STATES
from nanotrain.runtime.ownership import job_state as job_state_in_queue

from helpers.processes import assert_latest_intact, rank_pid, signal_rank, step_of
from helpers.runs import TINY, cli, set_args, tb_first_steps, tb_losses
from helpers.slurm import submitted_job_id, wait_for_job, wait_until

ROOT = Path(__file__).resolve().parents[1]


def common(tmp_path: Path, name: str, steps: int) -> list[str]:
    items = [
        f"logging.dir={tmp_path}",
        f"logging.run_name={name}",
        f"training.train_steps={steps}",
        "logging.log_interval=1",
        "checkpoints.interval=5",
    ]
    return set_args(items)


@pytest.mark.timeout(400)
def test_sigkill_of_one_local_rank_ends_the_job(tmp_path):
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        cli(str(TINY), "--local", *common(tmp_path, "killed", 400)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: step_of(run_dir) >= 7 or proc.poll() is not None, 300, "step 7")
        _, killed_at = signal_rank(run_dir, 3, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "rank 3 exited with status 137" in out, out[-2000:]
    assert assert_latest_intact(run_dir) >= 5
    for rank in range(8):
        assert rank_pid(run_dir, rank) is None, f"rank {rank} survived"


def slurm_submit(tmp_path: Path, name: str, steps: int) -> tuple[str, Path]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), str(TINY), *common(tmp_path, name, steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return submitted_job_id(proc.stdout), tmp_path / name


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_sigkill_on_slurm_ends_the_job(slurm_cluster, tmp_path):
    job_id, run_dir = slurm_submit(tmp_path, "slurm-killed", 400)
    wait_until(lambda: step_of(run_dir) >= 7, 300, "step 7", job_id)
    _, killed_at = signal_rank(run_dir, 5, signal.SIGKILL)  # a task on the second node
    state = wait_for_job(job_id, timeout=120)
    assert time.monotonic() - killed_at < 60 and state == "FAILED", state
    assert assert_latest_intact(run_dir) >= 5


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_resume_of_a_cancelled_slurm_run(slurm_cluster, tmp_path):
    steps = 30
    job_id, run_dir = slurm_submit(tmp_path, "cancelled", steps)
    wait_until(lambda: step_of(run_dir) >= 7, 300, "step 7", job_id)
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    assert wait_for_job(job_id, timeout=120) == "CANCELLED"
    # scancel sends SIGTERM first: the ranks agree, save at the next step, then SLURM kills them.
    wait_until(lambda: all(rank_pid(run_dir, r) is None for r in range(8)), 60, "the tasks to exit")
    saved = assert_latest_intact(run_dir)
    # `--resume` refuses while the job is still in the queue (issue 17, item 3): COMPLETING counts
    wait_until(lambda: job_state_in_queue(job_id) not in LIVE_JOB_STATES, 120, "the job to leave the queue")

    resumed = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), "--resume", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    new_job = submitted_job_id(resumed.stdout)
    assert new_job != job_id and wait_for_job(new_job, timeout=400) == "COMPLETED"
    log = (run_dir / "job" / f"{new_job}_0_log.out").read_text()
    assert f"step_{saved:06d} at step {saved} (same topology)" in log
    assert tb_first_steps(run_dir) == [1, saved + 1]  # the new job trained on from the save, not from step 1
    assert [s for s, _ in tb_losses(run_dir)] == list(range(1, steps + 1))
    assert step_of(run_dir) == steps
