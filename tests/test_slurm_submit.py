"""The full path on the real local SLURM cluster (slurm/local-cluster.sh): `submit.py` sends a
2-node x 4-task CPU job through submitit, and the `--emit` script goes through plain `sbatch`.
Every task must build the ParallelContext and get the right all-reduce sums."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.slurm import TERMINAL, job_state, submitted_job_id, wait_for_job

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]


def check_smoke_reports(run_dir: Path, job_id: str) -> None:
    reports = [json.loads(p.read_text()) for p in (run_dir / "smoke").glob("rank-*.json")]
    assert sorted(r["rank"] for r in reports) == list(range(8))
    assert {r["node_rank"] for r in reports} == {0, 1}  # two SLURM nodes, four tasks each
    assert sorted(r["local_rank"] for r in reports) == [0, 0, 1, 1, 2, 2, 3, 3]
    for report in reports:
        assert report["launcher"] == "slurm" and report["job_id"] == job_id
        assert report["ok"] and report["world_size"] == 8 and report["backend"] == "gloo"
        for axis, result in report["sums"].items():
            assert result["got"] == result["expected"] == sum(result["ranks"]), (report["rank"], axis)


def status(run_dir: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), "--status", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_submit_2_nodes_x_4_tasks_trains_and_reports_status(slurm_cluster, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "submit.py"),
            str(TINY),
            "--set",
            f"logging.dir={tmp_path}",
            "--set",
            "logging.run_name=slurm-smoke",
            "--set",
            "training.train_steps=40",
            "--set",
            "logging.log_interval=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = submitted_job_id(proc.stdout)
    run_dir = tmp_path / "slurm-smoke"
    assert f"run directory: {run_dir}" in proc.stdout and "tensorboard --logdir" in proc.stdout
    # --status while it runs: the scheduler's state and, once training started, the last step
    deadline, seen = time.monotonic() + 240, ""
    while time.monotonic() < deadline:
        seen = status(run_dir)
        if "state: RUNNING" in seen and "progress: step" in seen:
            break
        if job_state(job_id) in TERMINAL:
            break
        time.sleep(1.0)
    assert f"job: {job_id}" in seen and "state: RUNNING" in seen and "progress: step" in seen, seen
    state = wait_for_job(job_id, timeout=300)
    log = run_dir / "job" / f"{job_id}_0_log.out"
    assert state == "COMPLETED", log.read_text() if log.exists() else state
    check_smoke_reports(run_dir, job_id)
    assert "smoke: ok: world=8 backend=gloo launcher=slurm" in log.read_text()
    assert json.loads((run_dir / "launch.json").read_text())["job_id"] == job_id
    metrics_log = (run_dir / "job" / f"{job_id}_4_log.out").read_text()  # last stage, tp0, dp0
    assert "step 40/40 | loss" in metrics_log
    after = status(run_dir)
    assert "state: COMPLETED" in after and "step 40/40" in after, after


def test_emitted_script_runs_with_plain_sbatch(slurm_cluster, tmp_path):
    out_dir = tmp_path / "generated"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "submit.py"),
            str(TINY),
            "--emit",
            str(out_dir),
            "--set",
            f"logging.dir={tmp_path}",
            "--set",
            "logging.run_name=emitted",
            "--set",
            "training.train_steps=3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    submit = subprocess.run(
        ["sbatch", str(out_dir / "emitted.sbatch")], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert submit.returncode == 0, submit.stderr
    job_id = submitted_job_id(submit.stdout)
    state = wait_for_job(job_id, timeout=300)
    run_dir = tmp_path / "emitted"
    log = run_dir / "job" / f"{job_id}_0_log.out"
    assert state == "COMPLETED", log.read_text() if log.exists() else state
    check_smoke_reports(run_dir, job_id)
    assert (run_dir / "config.yaml").is_file()  # the task created its run directory itself
