"""The run directory `logs/<run>/`: the one place a run's config, job logs, metrics and
checkpoints live, so that `--status` and `--resume` need nothing but its path.

    logs/<run>/config.yaml   resolved config (what every task reads)
    logs/<run>/launch.json   how it was launched: mode, job id, command
    logs/<run>/job/          SLURM / local per-task stdout and stderr
    logs/<run>/tb/           TensorBoard events
    logs/<run>/checkpoints/  sharded checkpoints
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from nanotrain.config import Config, dump_config, load_config

CONFIG_FILE = "config.yaml"
LAUNCH_FILE = "launch.json"


def default_run_name(config_path: str | None) -> str:
    stem = Path(config_path).stem if config_path else "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_run(config: Config, config_path: str | None) -> Path:
    """Fill in the run name and make paths absolute (SLURM tasks may start elsewhere)."""
    if config.logging.run_name is None:
        config.logging.run_name = default_run_name(config_path)
    config.logging.dir = str(Path(config.logging.dir).expanduser().resolve())
    run_dir = Path(config.logging.dir) / config.logging.run_name
    if config.checkpoints.path is None:
        config.checkpoints.path = str(run_dir / "checkpoints")
    else:
        config.checkpoints.path = str(Path(config.checkpoints.path).expanduser().resolve())
    return run_dir


def run_dir_of(config: Config) -> Path:
    return Path(config.logging.dir) / str(config.logging.run_name)


def write_run_dir(config: Config, run_dir: Path) -> Path:
    """Create the run directory and write the resolved config; returns the config's path."""
    (run_dir / "job").mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    dump_config(config, path)
    return path


def write_launch_record(run_dir: Path, **record) -> None:
    record.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%S"))
    (run_dir / LAUNCH_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_launch_record(run_dir: Path) -> dict:
    path = run_dir / LAUNCH_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def load_run_config(run_dir: Path) -> Config:
    return load_config(run_dir / CONFIG_FILE)
