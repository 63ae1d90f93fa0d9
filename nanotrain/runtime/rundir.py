"""The run directory `logs/<run>/`: the one place a run's config, job logs, metrics and
checkpoints live, so that `--status` and `--resume` need nothing but its path.

    logs/<run>/config.yaml   resolved config (what every task reads)
    logs/<run>/launch.json   how it was launched: mode, job id, command
    logs/<run>/job/          SLURM / local per-task stdout and stderr
    logs/<run>/tb/           TensorBoard events
    logs/<run>/checkpoints/  sharded checkpoints
"""

from __future__ import annotations

import enum
import json
import time
from pathlib import Path

from nanotrain.config import Config, ConfigError, dump_config, load_config
from nanotrain.config.paths import CREATE_DIR, check_path

CONFIG_FILE = "config.yaml"
LAUNCH_FILE = "launch.json"


class Launcher(str, enum.Enum):
    """How a run was launched: launch.json's "mode" (a str, so the record is plain JSON)."""

    SLURM = "slurm"
    LOCAL = "local"


def default_run_name(config_path: str | None) -> str:
    stem = Path(config_path).stem[:100] if config_path else "run"  # a file name has 255 bytes
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_can_create(path: Path, what: str) -> None:
    """Raise ConfigError unless `path` is, or can be made, a directory we may write in.

    Checked before anything is submitted or created, so that a `logging.dir` that is a file, a
    read-only file system, an over-long name, a symbolic-link loop or a pseudo file system
    (/proc) is one line at `--dry-run` time instead of a traceback after the job is queued: the
    one path checker, `config.paths`. (Writes still catch OSError: permissions can change.)"""
    check_path(what, path, CREATE_DIR, ConfigError)


def os_error(what: str, exc: OSError) -> ConfigError:
    """A failed write as one line that names what was being written."""
    name = f" {exc.filename}" if exc.filename else ""
    return ConfigError(f"{what}: cannot write{name}: {exc.strerror or exc}")


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
    if config.data.cache_dir is not None:
        config.data.cache_dir = str(Path(config.data.cache_dir).expanduser().resolve())
    return run_dir


def run_dir_of(config: Config) -> Path:
    return Path(config.logging.dir) / str(config.logging.run_name)


def write_run_dir(config: Config, run_dir: Path) -> Path:
    """Create the run directory and write the resolved config; returns the config's path."""
    try:
        (run_dir / "job").mkdir(parents=True, exist_ok=True)
        path = run_dir / CONFIG_FILE
        dump_config(config, path)
    except OSError as exc:
        raise os_error("logging.dir", exc) from None
    return path


def write_launch_record(run_dir: Path, **record) -> None:
    record.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%S"))
    try:
        (run_dir / LAUNCH_FILE).write_text(json.dumps(record, indent=2) + "\n")
    except OSError as exc:
        raise os_error("logging.dir", exc) from None


# launch.json field -> accepted types (it is ours, but it sits in a user-writable directory)
_LAUNCH_FIELDS = {"mode": (str,), "job_id": (str, int), "time": (str,), "argv": (list,), "kind": (str,)}


def read_launch_record(run_dir: Path) -> dict:
    """launch.json as a dict ({} when absent); anything else is a ConfigError naming the file."""
    path = run_dir / LAUNCH_FILE
    if not path.is_file():
        return {}
    fix = "it is written by submit.py: restore it, or delete it (the launcher is then chosen again)"
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
        reason = (
            "not UTF-8 text"
            if isinstance(exc, UnicodeDecodeError)
            else f"not JSON ({exc.msg})"
            if isinstance(exc, json.JSONDecodeError)
            else str(exc)
        )
        raise ConfigError(f"{path}: {reason}; {fix}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path}: expected a JSON object, found a {type(record).__name__}; {fix}")
    for key, types in _LAUNCH_FIELDS.items():
        value = record.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise ConfigError(f"{path}: '{key}' is {type(value).__name__} {str(value)[:40]!r}; {fix}")
    if record.get("mode") not in (None, *(launcher.value for launcher in Launcher)):
        raise ConfigError(f"{path}: 'mode' is {record['mode'][:40]!r}, not 'slurm' or 'local'; {fix}")
    return record


def recorded_launcher(record: dict) -> Launcher | None:
    """The launcher of a ``read_launch_record`` record; None when it names none."""
    return None if record.get("mode") is None else Launcher(record["mode"])


def load_run_config(run_dir: Path) -> Config:
    return load_config(run_dir / CONFIG_FILE)
