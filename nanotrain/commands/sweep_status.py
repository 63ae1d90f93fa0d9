"""`submit.py --status SWEEP_DIR`: one row per point of a sweep (commands/sweep.py).

A sweep is compared across its points, so the table puts their values side by side with what
each point's own `--status RUN_DIR` would say in brief: the scheduler's state of its array task
(`status.slurm_job_info`, asked by the task's own id `<array>_<index>`), and the step, loss,
validation loss and tokens/s of its progress.json. A point's full story stays one command away.
The scheduler is asked about the points concurrently (three short commands a point, each mostly
waiting on slurmctld), so a sweep of a hundred points answers in seconds rather than a minute.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TextIO

from nanotrain.commands import status
from nanotrain.commands.sweep import MANIFEST, read_manifest
from nanotrain.config import ConfigError


def is_sweep_dir(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _state(point: dict, run_dir: Path, launcher: str | None, progress: dict | None) -> str:
    job_id = point.get("job_id")
    if launcher == "slurm" and job_id:
        info = status.slurm_job_info(str(job_id))
        state = info.state or "unknown"
        if info.restarts:
            state += f" (requeued {info.restarts})"
        return state
    if not (run_dir / "launch.json").is_file():
        return "not started"
    done = progress and progress.get("step") is not None and progress.get("step") == progress.get("total_steps")
    return "done" if done else "local"


def _number(value, form: str) -> str:
    return "-" if value is None else format(value, form)


def _progress(run_dir: Path) -> dict:
    try:
        return status._read_progress(run_dir) or {}
    except ConfigError:
        return {}  # damaged: that point's own --status names the file


def rows(sweep_dir: Path) -> tuple[dict, list[list[str]]]:
    """The manifest and the table (a header row, then one row per point)."""
    manifest = read_manifest(sweep_dir)
    fields = [str(field) for field in manifest.get("fields") or []]
    table = [["point", *fields, "state", "step", "loss", "val loss", "tokens/s"]]
    points = manifest["points"]
    progresses = [_progress(sweep_dir / point["name"]) for point in points]
    with ThreadPoolExecutor(max_workers=8) as pool:
        states = list(
            pool.map(
                lambda pair: _state(pair[0], sweep_dir / pair[0]["name"], manifest.get("launcher"), pair[1]),
                zip(points, progresses),
            )
        )
    for point, progress, state in zip(points, progresses, states):
        values = point.get("values") if isinstance(point.get("values"), dict) else {}
        step, total = progress.get("step"), progress.get("total_steps")
        table.append(
            [
                point["name"],
                *(str(values.get(field, "-")) for field in fields),
                state,
                "-" if step is None else f"{step}/{total}" if total else str(step),
                _number(progress.get("loss"), ".4f"),
                _number(progress.get("val_loss"), ".4f"),
                _number(progress.get("tokens_per_sec"), ",.0f"),
            ]
        )
    return manifest, table


def show_any_status(path: str | Path, out: TextIO | None = None) -> int:
    """``--status PATH``: a sweep's table when PATH holds sweep.json, else the run's status."""
    if is_sweep_dir(Path(path).expanduser()):
        return show_sweep_status(path, out or sys.stdout)
    return status.show_status(path, out)


def show_sweep_status(sweep_dir: Path, out: TextIO) -> int:
    sweep_dir = Path(sweep_dir).expanduser()
    manifest, table = rows(sweep_dir)
    job = f", job array {manifest['job_id']}" if manifest.get("job_id") else ""
    launcher = manifest.get("launcher") or "unknown"
    print(
        f"sweep: {sweep_dir.resolve()} ({len(table) - 1} points, {manifest.get('mode', 'grid')}, {launcher}{job})",
        file=out,
    )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip(), file=out)
    print(f"one point: python submit.py --status {sweep_dir}/POINT", file=out)
    return 0
