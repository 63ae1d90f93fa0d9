"""`submit.py --status RUN_DIR`: progress of a local run, a bad directory, and a real SLURM job
followed through pending/running, a requeue, and completion on the local cluster."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotrain.commands.cli import main
from nanotrain.config.atomic_files import atomic_write_json as write_json_atomic
from nanotrain.runtime.rundir import write_launch_record

from helpers.slurm import wait_for_job

ROOT = Path(__file__).resolve().parents[1]


def status(run_dir, capsys) -> tuple[int, str, str]:
    code = main(["--status", str(run_dir)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_local_run_with_progress(tmp_path, capsys):
    write_launch_record(tmp_path, mode="local", argv=["configs/tiny_cpu.yaml", "--local"])
    write_json_atomic(
        tmp_path / "progress.json",
        {
            "step": 120,
            "total_steps": 2000,
            "loss": 2.34567,
            "tokens_per_sec": 12345.6,
            "eta_s": 754.0,
            "time": time.time(),
            "lr": 3e-4,
        },
    )
    code, out, err = status(tmp_path, capsys)
    assert code == 0 and err == ""
    assert f"run: {tmp_path.resolve()}" in out
    assert "mode: local" in out
    line = next(text for text in out.splitlines() if text.startswith("progress:"))
    assert "step 120/2000 (6.0%)" in line and "loss 2.3457" in line and "tokens/s 12,346" in line
    assert "ETA 0:12:3" in line  # 754 s less the second or so since it was written


def test_no_progress_yet(tmp_path, capsys):
    write_launch_record(tmp_path, mode="local", argv=[])
    code, out, _ = status(tmp_path, capsys)
    assert code == 0 and "progress: no progress yet" in out


def test_public_cli_finished_run(tmp_path):
    write_launch_record(tmp_path, mode="local", argv=[])
    write_json_atomic(
        tmp_path / "progress.json",
        {"step": 50, "total_steps": 50, "loss": 1.5, "tokens_per_sec": 900.0, "eta_s": 0.0, "time": time.time()},
    )
    res = subprocess.run(
        [sys.executable, "submit.py", "--status", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert "step 50/50 (100.0%) | loss 1.5000 | tokens/s 900 | done" in res.stdout


@pytest.mark.parametrize("make", ["empty", "missing", "file"])
def test_not_a_run_dir(tmp_path, capsys, make):
    target = {"empty": tmp_path, "missing": tmp_path / "nope", "file": tmp_path / "f.txt"}[make]
    if make == "file":
        target.write_text("x")
    code, out, err = status(target, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: --status:") and str(target) in err


def test_status_with_a_config_is_an_error(tmp_path, capsys):
    assert main(["configs/tiny_cpu.yaml", "--status", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: --status takes a run directory")


def test_scheduler_fallbacks(monkeypatch):
    """squeue forgets a finished job, sacct may be off or lagging: scontrol still answers; a job
    squeue lists as COMPLETING has ended, and sacct says how."""
    from nanotrain.commands import status as status_mod

    scontrol = (
        "JobId=7 JobName=x\n   JobState=COMPLETED Reason=None Dependency=(null)\n"
        "   Requeue=1 Restarts=2 BatchFlag=1\n   ReqNodeList=(null) ExcNodeList=(null)\n"
        "   NodeList=n[1-2]\n"
    )
    answers = {"squeue": "", "sacct": None, "scontrol": scontrol}
    monkeypatch.setattr(status_mod, "_query", lambda argv: answers[argv[0]])
    info = status_mod.slurm_job_info("7")
    assert (info.state, info.source, info.restarts, info.nodes) == ("COMPLETED", "scontrol", 2, "n[1-2]")

    answers["sacct"] = "7|REQUEUED|n1\n7|REQUEUED|n2\n7|FAILED|n[1-2]\n"
    info = status_mod.slurm_job_info("7")
    assert (info.state, info.source, info.restarts) == ("FAILED", "sacct", 2)
    answers["sacct"] = "7|REQUEUED|n1|0:0\n7|FAILED|n[1-2]|75:0\n"  # the ExitCode column: status:signal
    assert status_mod.slurm_job_info("7").exit_code == 75
    answers["sacct"] = "7|REQUEUED|n1\n7|REQUEUED|n2\n7|FAILED|n[1-2]\n"
    answers["scontrol"] = None  # past MinJobAge: only accounting remembers, one record per run
    assert status_mod.slurm_job_info("7").restarts == 2

    answers.update(squeue="PENDING||Priority\n", scontrol=scontrol.replace("COMPLETED", "PENDING"))
    info = status_mod.slurm_job_info("7")
    assert (info.state, info.source, info.reason, info.nodes) == ("PENDING", "squeue", "Priority", None)

    # COMPLETING (squeue, scontrol): the job has ended, SLURM still cleans up; sacct knows how it
    # ended (seen on the local cluster right after a preempted job exited 75)
    answers.update(squeue="COMPLETING|n[1-2]|\n", sacct="7|FAILED|n[1-2]|75:0\n", scontrol=None)
    info = status_mod.slurm_job_info("7")
    assert (info.state, info.source, info.exit_code) == ("FAILED", "sacct", 75)
    answers.update(sacct=None)  # no accounting: squeue's word is all there is
    assert (status_mod.slurm_job_info("7").state, status_mod.slurm_job_info("7").source) == ("COMPLETING", "squeue")

    answers.update(squeue=None, sacct=None, scontrol=None)
    assert status_mod.slurm_job_info("7").state is None


# ---------------------------------------------------------------------------- real SLURM
def sbatch(*args: str) -> str:
    res = subprocess.run(
        ["sbatch", "--parsable", "-o", "/dev/null", "-e", "/dev/null", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def field(out: str, name: str) -> str:
    return next(text.split(": ", 1)[1] for text in out.splitlines() if text.startswith(f"{name}: "))


def poll_status(run_dir, capsys, accept, timeout: float) -> str:
    deadline, out = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        code, out, err = status(run_dir, capsys)
        assert code == 0, err
        if accept(field(out, "state")):
            return out
        time.sleep(0.5)
    raise AssertionError(f"--status never reached the expected state in {timeout:.0f} s:\n{out}")


@pytest.mark.slurm
def test_slurm_job_running_then_completed(tmp_path, capsys, slurm_cluster):
    job_id = sbatch("-J", "nanotrain-status-test", "--wrap", "sleep 20")
    try:
        write_launch_record(tmp_path, mode="slurm", job_id=job_id, argv=["configs/tiny_cpu.yaml"])
        out = poll_status(tmp_path, capsys, lambda s: s.startswith(("RUNNING", "PENDING")), 60)
        assert field(out, "job") == job_id and field(out, "requeues") == "0"
        assert "(from squeue)" in field(out, "state")
        assert "progress: no progress yet" in out
        out = poll_status(tmp_path, capsys, lambda s: s.startswith("RUNNING"), 60)
        assert field(out, "nodes") in slurm_cluster
        assert wait_for_job(job_id, timeout=90) == "COMPLETED"
        out = poll_status(tmp_path, capsys, lambda s: s.startswith("COMPLETED"), 30)
        assert "(from sacct)" in field(out, "state") or "(from scontrol)" in field(out, "state")
        assert field(out, "requeues") == "0" and field(out, "nodes") in slurm_cluster
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


@pytest.mark.slurm
def test_slurm_requeue_is_counted(tmp_path, capsys, slurm_cluster):
    job_id = sbatch("-J", "nanotrain-status-requeue", "--wrap", "sleep 120")
    try:
        write_launch_record(tmp_path, mode="slurm", job_id=job_id, argv=[])
        poll_status(tmp_path, capsys, lambda s: s.startswith("RUNNING"), 60)
        res = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        out = poll_status(tmp_path, capsys, lambda s: not s.startswith("RUNNING"), 30)
        assert field(out, "requeues") == "1"
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
