"""The sbatch script a config becomes: what --dry-run prints, what --emit writes, and that the
two agree with the parameters submitit's executor receives."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import submitit

from nanotrain.commands.cli import main
from nanotrain.config import load_config, validate
from nanotrain.launch import sbatch
from nanotrain.runtime.rundir import resolve_run

ROOT = Path(__file__).resolve().parents[1]
CONFIG_3D = ROOT / "configs" / "3d_16gpu.yaml"
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def sbatch_options(script: str) -> dict[str, str]:
    options = {}
    for match in re.finditer(r"^#SBATCH --([a-z-]+)(?:=(.*))?$", script, re.M):
        options[match.group(1)] = match.group(2) if match.group(2) is not None else ""
    return options


def test_dry_run_3d_16gpu(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([str(CONFIG_3D), "--dry-run", "--set", f"logging.dir={tmp_path / 'logs'}"]) == 0
    out = capsys.readouterr().out
    assert "4 node(s) x 4 tasks, 4 GPUs per node" in out
    assert "world 16 = dp4 x tp2 x pp2 x cp1 x ep1" in out
    assert "tp: 8 groups of 2" in out and "pp: 8 groups of 2" in out and "dp: 4 groups of 4" in out
    script = out[out.index("#!/bin/bash") :]
    opts = sbatch_options(script)
    assert opts["nodes"] == "4"
    assert opts["ntasks-per-node"] == "4"
    assert opts["gpus-per-node"] == "4"
    assert opts["time"] == "1440"
    assert opts["partition"] == "gpu"
    assert opts["signal"] == "USR2@180"
    assert opts["cpus-per-task"] == "8"
    assert opts["mem"] == "256G"
    assert "exclusive" in opts and opts["open-mode"] == "append"
    assert "export NCCL_IB_DISABLE=0" in script and "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in script  # nothing relies on launch order (p2p.py); it only costs overlap
    assert "--kill-on-bad-exit=1" in script and "submitit.core._submit" in script
    assert not (tmp_path / "logs").exists(), "--dry-run must not create the run directory"


def test_srun_gets_cpus_per_task():
    """srun of Slurm 22.05 - 23.02 does not inherit the allocation's --cpus-per-task: the srun
    line itself must carry it, or each rank runs on one core."""
    config = load_config(CONFIG_3D)
    layout = validate(config, slurm=True)
    run_dir = resolve_run(config, str(CONFIG_3D))
    script = sbatch.render_sbatch(config, layout, run_dir, sbatch.submitit_command(run_dir))
    srun = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1, script
    assert f"--cpus-per-task={config.slurm.cpus_per_task}" in shlex.split(srun[0]), srun[0]
    assert sbatch_options(script)["cpus-per-task"] == "8"


def test_dry_run_equals_what_submitit_executor_writes(tmp_path, monkeypatch):
    """--dry-run renders with the same function and parameters the real executor uses."""
    if shutil.which("srun") is None:  # the executor only checks that srun exists; nothing runs
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "srun").write_text("#!/bin/sh\nexit 1\n")
        (fake / "srun").chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    config = load_config(TINY, [f"logging.dir={tmp_path}"])
    layout = validate(config, slurm=True)
    run_dir = resolve_run(config, str(TINY))
    printed = sbatch.render_sbatch(config, layout, run_dir, sbatch.submitit_command(run_dir))
    executor = submitit.SlurmExecutor(folder=sbatch.job_folder(run_dir))
    executor.update_parameters(**sbatch.executor_parameters(config, layout))
    written = executor._make_submission_file_text(sbatch.submitit_command(run_dir), "uid")
    assert written == printed
    opts = sbatch_options(printed)
    assert opts["nodes"] == "2" and opts["ntasks-per-node"] == "4" and "gpus-per-node" not in opts


def test_configured_signal_and_extra_options(tmp_path):
    config = load_config(
        TINY,
        [
            "slurm.signal=USR1",
            "slurm.signal_delay_s=45",
            "slurm.sbatch_extra={mail-type: END, comment: 'a b'}",
            "slurm.env.NCCL_DEBUG=INFO",
            "slurm.setup=['module load cuda/12']",
        ],
    )
    layout = validate(config, slurm=True)
    run_dir = resolve_run(config, str(TINY))
    script = sbatch.render_sbatch(config, layout, run_dir, sbatch.submitit_command(run_dir))
    opts = sbatch_options(script)
    assert opts["signal"] == "USR1@45" and opts["mail-type"] == "END"
    assert "export SUBMITIT_PREEMPT_SIGNAL=USR1" in script
    assert "export NCCL_DEBUG=INFO" in script
    assert script.index("module load cuda/12") < script.index("srun ")


def test_env_values_are_quoted(tmp_path):
    """A value with shell syntax reaches the job verbatim, never executed by the batch shell."""
    config = load_config(TINY, ["slurm.env.EVIL=$(touch /tmp/pwned); `id`"])
    layout = validate(config, slurm=True)
    run_dir = resolve_run(config, str(TINY))
    script = sbatch.render_sbatch(config, layout, run_dir, sbatch.submitit_command(run_dir))
    line = next(text for text in script.splitlines() if text.startswith("export EVIL="))
    assert shlex.split(line) == ["export", "EVIL=$(touch /tmp/pwned); `id`"]


def test_emit_writes_standalone_script_and_config(tmp_path, capsys):
    out_dir = tmp_path / "generated"
    assert (
        main(
            [
                str(TINY),
                "--emit",
                str(out_dir),
                "--set",
                f"logging.dir={tmp_path / 'logs'}",
                "--set",
                "logging.run_name=tiny_cpu",
            ]
        )
        == 0
    )
    script = (out_dir / "tiny_cpu.sbatch").read_text()
    config_path = out_dir / "tiny_cpu.yaml"
    assert config_path.is_file()
    assert f"-m nanotrain.runtime.task {config_path.resolve()}" in script
    assert "submitit.core._submit" not in script  # no pickled driver: plain sbatch can run it
    emitted = load_config(config_path)
    assert emitted.logging.run_name == "tiny_cpu" and Path(emitted.logging.dir).is_absolute()
    assert sbatch_options(script)["nodes"] == "2"
    assert "sbatch " in capsys.readouterr().out
