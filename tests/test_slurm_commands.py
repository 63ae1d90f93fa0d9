"""Every SLURM command the package runs is bounded (nanotrain/runtime/slurm_commands.py): a hung
`sbatch` is one `error:` line, exit 2, its process tree killed and the run directory undone;
a missing command or a bad bound is one line too. The hung command is a stand-in on PATH
(tests/helpers/fake_slurm.py): the real cluster cannot be made to hang. Hard timeouts throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotrain.runtime import slurm_commands

from helpers.fake_slurm import env_with, hung_command, running

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def test_hung_sbatch_is_one_line_and_leaves_nothing(tmp_path):
    pid_file = hung_command(tmp_path / "bin", "sbatch")
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), str(TINY), "--set", "logging.run_name=hung"],
        cwd=work,
        env=env_with(tmp_path / "bin", 1),
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: sbatch did not answer in 1 s: is slurmctld up?"), lines[0]
    assert lines[0].endswith("(nothing was submitted)"), lines[0]
    assert pid_file.is_file() and not running(pid_file)  # the hung command's child was killed too
    assert list(work.iterdir()) == []  # the run directory (and logs/) made for it is gone


def test_missing_command_and_bad_bound(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(slurm_commands.SlurmCommandError, match="^squeue could not be run .*installed"):
        slurm_commands.run(["squeue"])
    assert slurm_commands.answer(["squeue"]) is None
    monkeypatch.setenv(slurm_commands.TIMEOUT_ENV, "soon")
    with pytest.raises(slurm_commands.SlurmCommandError, match="NANOTRAIN_SLURM_TIMEOUT_S='soon': give a positive"):
        slurm_commands.run(["squeue"])


@pytest.mark.parametrize(
    "hung, args, line",
    [
        ("sinfo", ["--dry-run", "--set", "slurm.partition=p"], "terminated: no run was started"),
        ("sbatch", [], "terminated: nothing was submitted"),
    ],
)
def test_sigterm_ends_a_command_stuck_in_slurm(hung, args, line, tmp_path):
    """SIGTERM is held from submit.py's first line (for a local run's ranks), but a command still
    checking or submitting ends at once with one line, exit 143, and nothing left behind."""
    pid_file = hung_command(tmp_path / "bin", hung)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "submit.py"), str(TINY), *args],
        cwd=work,
        env=env_with(tmp_path / "bin"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not pid_file.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until the command is stuck in the hung one
        assert pid_file.is_file(), proc.communicate(timeout=30)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and err.strip() == line, err
    assert not running(pid_file)
    assert list(work.iterdir()) == []


@pytest.fixture
def tiny_submission(tmp_path):
    from nanotrain.config import load_config, validate

    config = load_config(TINY, [f"logging.dir={tmp_path / 'logs'}", "logging.run_name=stop"])
    return config, validate(config, slurm=True), tmp_path / "logs" / "stop"


def test_stop_while_sbatch_runs_undoes_the_run_dir(tiny_submission, monkeypatch, capsys):
    from nanotrain.commands import cli, stopping
    from nanotrain.launch import submission

    def stopped(*_args, **_kwargs):
        raise stopping.Terminated()

    monkeypatch.setattr(submission, "submit", stopped)
    config, layout, run_dir = tiny_submission
    assert cli.submit_slurm(config, layout, run_dir) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip() == "terminated: nothing was submitted"
    assert not run_dir.parent.exists()


def test_stop_after_the_submission_names_the_job(tiny_submission, monkeypatch, capsys):
    from nanotrain.commands import cli
    from nanotrain.launch import submission
    from nanotrain.runtime import rundir

    class Job:
        job_id = "42"

    monkeypatch.setattr(submission, "submit", lambda *_args, **_kwargs: Job())

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir, "write_launch_record", interrupted)
    config, layout, run_dir = tiny_submission
    assert cli.submit_slurm(config, layout, run_dir) == 130
    assert (
        capsys.readouterr().err.strip() == f"interrupted: job 42 was submitted; see it with: "
        f"python submit.py --status {run_dir}"
    )
    assert (run_dir / rundir.CONFIG_FILE).is_file()  # the job's run directory stays
