"""A 2 x 2 sweep on the real local SLURM cluster (issue 32, item 1): one job array of four
one-rank points (`sacct` lists the array's four tasks), every point finishes, `--status SWEEP_DIR`
shows four rows with their values, and one point preempted mid-way (`scancel --signal=USR2` of
its array task, what SLURM sends before a preemption) saves, requeues itself alone and finishes.
A bad point is refused before anything is submitted. Expansion, naming and the other refusals
without a scheduler: tests/test_sweep.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.processes import step_of
from helpers.slurm import (
    TERMINAL,
    cancel,
    job_state,
    restart_count,
    start_now_if_requeued,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
pytestmark = [pytest.mark.slurm]
STEPS = 40


def submit_sweep(tmp_path: Path, *sweeps: str) -> subprocess.CompletedProcess:
    """``submit.py`` of a sweep of one-rank points; ``sweeps``: ``--sweep`` values, or ``--set`` and its value."""
    items = [
        f"logging.dir={tmp_path}",
        "logging.run_name=sw",
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "slurm.tasks_per_node=1",
        f"training.train_steps={STEPS}",
        "logging.log_interval=1",
        "training.eval_interval=20",
        "data.validation={fraction: 0.01}",
        "checkpoints.interval=0",
        "slurm.max_requeues=3",
    ]
    args = [sys.executable, str(ROOT / "submit.py"), str(TINY)]
    for item in items:
        args += ["--set", item]
    for spec in sweeps:
        args += [spec] if spec == "--set" or args[-1] == "--set" else ["--sweep", spec]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(420)
def test_sweep_runs_as_one_array_and_a_preempted_point_resumes(slurm_cluster, tmp_path):
    bad = submit_sweep(tmp_path, "optimizer.lr=1e-3,3e-3", "model.hidden_size=64,60")
    assert bad.returncode == 2 and bad.stderr.startswith("error: sweep point optimizer.lr=1e-3,model.hidden_size=60:")
    assert list(tmp_path.iterdir()) == []  # refused before anything was written or queued

    proc = submit_sweep(tmp_path, "optimizer.lr=1e-3,3e-3", "model.hidden_size=64,128")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep_dir = tmp_path / "sw"
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    array_id = manifest["job_id"]
    assert f"submitted job array {array_id}: 4 points" in proc.stdout
    tasks = [p["job_id"] for p in manifest["points"]]
    assert tasks == [f"{array_id}_{i}" for i in range(4)]
    try:
        preempted, run_dir = tasks[0], sweep_dir / manifest["points"][0]["name"]

        def training_past_step_3():
            state = job_state(preempted)
            if state in TERMINAL:
                raise AssertionError(f"{preempted} ended ({state}) before it was preempted")
            return state == "RUNNING" and step_of(run_dir) > 3

        wait_until(training_past_step_3, 240, "point 0 training past step 3", array_id)
        subprocess.run(["scancel", "--signal=USR2", preempted], check=True, timeout=30)
        wait_until(lambda: restart_count(preempted) >= 1, 120, "point 0 to requeue", array_id)

        def finished(task: str):
            state = job_state(task)
            if state == "PENDING":
                start_now_if_requeued(task)  # a requeued task waits cred_expire (30 s) otherwise
            return state if state in TERMINAL else None

        for task in tasks:
            assert wait_until(lambda: finished(task), 240, f"{task} to finish", array_id) == "COMPLETED", task
    finally:
        cancel(array_id)
    out = subprocess.run(
        ["sacct", "-j", array_id, "-X", "-n", "-P", "-o", "JobID,State"], capture_output=True, text=True, timeout=30
    ).stdout
    listed = {row.split("|")[0] for row in out.splitlines() if row.strip()}
    assert set(tasks) <= listed, out  # one array, four tasks
    log = (run_dir / "job" / f"{preempted}_0_log.out").read_text()
    assert "preempted at step" in log and "requeued job" in log, log[-3000:]
    assert json.loads((run_dir / "progress.json").read_text())["step"] == STEPS

    status = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), "--status", str(sweep_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr
    rows = status.stdout.splitlines()[2:6]
    expected = [("1e-3", "64"), ("1e-3", "128"), ("3e-3", "64"), ("3e-3", "128")]
    for row, (lr, hidden) in zip(rows, expected):
        cells = row.split()
        assert cells[0] == f"lr-{lr}_hidden_size-{hidden}" and cells[1:3] == [lr, hidden], status.stdout
        assert cells[3] == "COMPLETED" and f"{STEPS}/{STEPS}" in cells, status.stdout
    assert "requeued 1" in rows[0], status.stdout


@pytest.mark.timeout(120)
def test_an_array_sbatch_refuses_leaves_nothing_behind(slurm_cluster, tmp_path):
    """sbatch refuses after every point's run directory and the pickles were written: all go."""
    proc = submit_sweep(tmp_path, "optimizer.lr=1e-3,3e-3", "--set", "slurm.sbatch_extra={begin: not-a-time}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: sbatch refused the sweep's job array: sbatch: error:"), lines[0]
    assert list(tmp_path.iterdir()) == []
