"""Launch-time user errors (issue 17, items 7, 8, 10): places that cannot be written, run-directory
files that are not what submit.py wrote, a partition the cluster lacks, and Ctrl-C of a local run.
Each is one `error:` line that names the field or file, exit 2 (130 for Ctrl-C), no traceback, and
nothing left behind. Tests that spawn processes have hard timeouts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotrain.commands import cli
from nanotrain.commands.cli import main
from nanotrain.runtime.rundir import write_launch_record

from helpers.needs import unavailable

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
SUBMIT = [sys.executable, str(ROOT / "submit.py")]


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ------------------------------------------------------------------ places that cannot be written
@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--dry-run", "--set", "logging.dir={f}"], ["logging.dir:", "is a file, not a directory"]),
        (["--dry-run", "--set", "logging.dir={f}/sub"], ["logging.dir:", "is a file, not a directory"]),
        (["--dry-run", "--set", "checkpoints.path={f}/ckpt"], ["checkpoints.path:", "is a file"]),
        (["--emit", "{f}"], ["--emit:", "is a file, not a directory"]),
        (["--local", "--set", "logging.dir={f}"], ["logging.dir:", "is a file"]),
        (["--dry-run", "--set", "logging.dir={d}/" + "x" * 300], ["logging.dir:", "300 bytes", "255"]),
    ],
)
def test_unwritable_places(args, fragments, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    argv = [TINY, *[a.format(f=blocker, d=tmp_path) for a in args]]
    code, out, err = run_cli(argv, capsys)
    line = one_error_line(err)
    assert code == 2 and out == ""
    for fragment in fragments:
        assert fragment in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_long_config_name_gets_a_short_default_run_name(tmp_path, capsys, monkeypatch):
    """A 250-character config name used to become a 266-character run directory name."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / ("c" * 250 + ".yaml")
    shutil.copy(TINY, config)
    code, out, err = run_cli([config, "--dry-run"], capsys)
    assert code == 0, err
    run_dir = next(text for text in out.splitlines() if text.startswith("run directory:")).split(": ", 1)[1]
    assert len(Path(run_dir).name) <= 120


@pytest.fixture
def read_only_dir(tmp_path):
    """A real read-only file system (a tmpfs mounted ro in a private mount namespace): the
    command given to the returned function runs inside it."""
    target = tmp_path / "ro"
    target.mkdir()
    if shutil.which("unshare") is None or os.geteuid() != 0:
        unavailable("private read-only mount", "needs root and unshare")

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        script = f'mount -t tmpfs -o ro none {target} && exec "$@"'
        return subprocess.run(
            ["unshare", "-m", "sh", "-c", script, "sh", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )

    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        unavailable("private read-only mount", "unshare -m is not permitted here")
    return target, run


@pytest.mark.parametrize(
    "args,field",
    [
        (["--dry-run", "--set", "logging.dir={ro}/logs"], "logging.dir"),
        (["--set", "logging.dir={ro}/logs"], "logging.dir"),
        (["--emit", "{ro}/scripts"], "--emit"),
    ],
)
def test_read_only_file_system(args, field, read_only_dir):
    target, run = read_only_dir
    proc = run([*SUBMIT, str(TINY), *[a.format(ro=target) for a in args]])
    line = one_error_line(proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    assert line.startswith(f"error: {field}: {target} is on a read-only file system"), line


# ------------------------------------------------------------------ run-directory files
@pytest.mark.parametrize(
    "content,fragment",
    [
        ("[1, 2, 3]", "expected a JSON object, found a list"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not UTF-8 text"),
        ("{not json", "not JSON"),
        ('{"mode": 7}', "'mode' is int"),
        ('{"mode": "kubernetes"}', "not 'slurm' or 'local'"),
    ],
)
@pytest.mark.parametrize("flag", ["--resume", "--status"])
def test_damaged_launch_json_is_named(flag, content, fragment, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(TINY, run_dir / "config.yaml")
    path = run_dir / "launch.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out, err = run_cli([flag, run_dir, *(["--dry-run"] if flag == "--resume" else [])], capsys)
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert line.startswith(f"error: {path}: ") and fragment in line, line


@pytest.mark.parametrize(
    "progress,fragment",
    [
        ({"step": "12", "total_steps": 100}, "'step' is '12', not a whole number"),
        ({"step": 12, "total_steps": 100, "loss": "2.5"}, "'loss' is '2.5', not a number"),
        ({"step": 12, "total_steps": True}, "'total_steps' is 'True'"),
        ([12, 100], "expected a JSON object"),
        ("garbage", "not a JSON progress record"),
    ],
)
def test_damaged_progress_json_is_named(progress, fragment, tmp_path, capsys):
    write_launch_record(tmp_path, mode="local", argv=[])
    path = tmp_path / "progress.json"
    path.write_text(progress if isinstance(progress, str) else json.dumps(progress))
    code, out, err = run_cli(["--status", tmp_path], capsys)
    line = one_error_line(err)
    assert code == 2 and line.startswith(f"error: {path}: ") and fragment in line, line


def test_nan_loss_in_progress_is_shown(tmp_path, capsys):
    """A NaN loss is a fact about the run, not a damaged file: --status shows it."""
    write_launch_record(tmp_path, mode="local", argv=[])
    (tmp_path / "progress.json").write_text('{"step": 3, "total_steps": 10, "loss": NaN, "eta_s": Infinity}')
    code, out, err = run_cli(["--status", tmp_path], capsys)
    assert code == 0 and err == "" and "step 3/10 (30.0%) | loss nan" in out


# ------------------------------------------------------------------ SLURM refusals leave nothing
# The real cluster (conftest's `slurm_cluster`: a failure under CI, a skip only on a developer box).
needs_slurm = pytest.mark.usefixtures("slurm_cluster")


@needs_slurm
def test_unknown_partition_is_one_line_before_anything_is_written(tmp_path):
    proc = subprocess.run(
        [*SUBMIT, str(TINY), "--set", "slurm.partition=no_such_partition"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = one_error_line(proc.stderr)
    assert proc.returncode == 2 and "slurm.partition: 'no_such_partition' is not a partition" in line
    assert list(tmp_path.iterdir()) == []


@needs_slurm
def test_dry_run_warns_about_a_partition_of_another_cluster(tmp_path):
    proc = subprocess.run(
        [*SUBMIT, str(TINY), "--dry-run", "--set", "slurm.partition=elsewhere"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stderr == ""
    assert "warning: slurm.partition: 'elsewhere' is not a partition of this cluster" in proc.stdout


@needs_slurm
def test_sbatch_refusal_is_one_line_and_removes_the_run_dir(tmp_path):
    """sbatch refuses after submitit pickled the job into the run directory: both go again."""
    proc = subprocess.run(
        [*SUBMIT, str(TINY), "--set", "slurm.sbatch_extra={begin: not-a-time}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = one_error_line(proc.stderr)
    assert proc.returncode == 2 and line.startswith("error: sbatch refused the job: sbatch: error:"), line
    assert list(tmp_path.iterdir()) == []


@needs_slurm
def test_refused_resume_keeps_the_run_dir_as_it_was(tmp_path, capsys):
    run_dir = tmp_path / "logs" / "kept"
    (run_dir / "job").mkdir(parents=True)
    shutil.copy(TINY, run_dir / "config.yaml")
    write_launch_record(run_dir, mode="slurm", job_id="1", argv=[])
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    code, _, err = run_cli(["--resume", run_dir, "--set", "slurm.sbatch_extra={begin: not-a-time}"], capsys)
    assert code == 2 and one_error_line(err).startswith("error: sbatch refused the job")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_before_anything_started(monkeypatch, capsys):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_config", interrupted)
    code, _, err = run_cli([TINY, "--dry-run"], capsys)
    assert code == 130 and err.strip() == "interrupted: no run was started"


def test_ctrl_c_of_a_local_run_saves_and_says_how_to_resume(tmp_path):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it): the ranks save at
    the next step boundary and stop; the launcher names the checkpoint and the resume command,
    exits 130, and nobody prints a traceback."""
    cmd = [
        *SUBMIT,
        str(TINY),
        "--local",
        "--set",
        "parallelism.dp=1",
        "--set",
        "parallelism.tp=1",
        "--set",
        "parallelism.pp=1",
        "--set",
        "training.train_steps=100000",
        "--set",
        "checkpoints.interval=1000",
        "--set",
        f"logging.dir={tmp_path / 'logs'}",
        "--set",
        "logging.run_name=cc",
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    progress = tmp_path / "logs" / "cc" / "progress.json"
    try:
        deadline = time.monotonic() + 240
        while not progress.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert progress.is_file(), "the run never logged a step"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    last = err.strip().splitlines()[-1]
    run_dir = tmp_path / "logs" / "cc"
    assert last.startswith(
        "interrupted: the ranks saved at a step boundary and stopped; latest checkpoint: "
        f"{run_dir / 'checkpoints' / 'step_'}"
    ), last
    assert last.endswith(f"resume with: python submit.py --resume {run_dir}"), last
    assert (run_dir / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize(
    "forced,failed,fragment",
    [
        (False, None, "the ranks saved at a step boundary and stopped"),
        (True, None, "the ranks were killed (second Ctrl-C)"),
        (False, "rank 3 exited with status 1 (log: x)", "rank 3 exited with status 1 (log: x) while stopping"),
    ],
)
def test_interrupt_report_without_a_checkpoint(forced, failed, fragment, tmp_path):
    from nanotrain.launch.local import Interrupted, report_interrupt

    line = report_interrupt(tmp_path / "run", tmp_path / "run" / "checkpoints", Interrupted(forced, failed))
    assert line == (
        f"interrupted: {fragment}; no checkpoint was saved yet, so "
        f"python submit.py --resume {tmp_path / 'run'} starts from step 0"
    )
