"""A SLURM command that never answers (a hung slurmctld), put first on PATH for one process.

The real cluster cannot be made to hang on demand, so these stand-ins do: each starts a child
`sleep`, writes the child's pid to ``<bin dir>/<name>.pid`` and waits for it; the launch must kill
the command and its child."""

from __future__ import annotations

import os
from pathlib import Path


def hung_command(bin_dir: Path, name: str) -> Path:
    """Write the hung ``name`` into ``bin_dir``; returns the file its child's pid will be in."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    pid_file = bin_dir / f"{name}.pid"
    script = bin_dir / name
    script.write_text(f"#!/bin/sh\nsleep 600 &\necho $! > {pid_file}\nwait\n")
    script.chmod(0o755)
    return pid_file


def env_with(bin_dir: Path, timeout_s: float | None = None) -> dict:
    """This process's environment with ``bin_dir`` first on PATH (and a SLURM command timeout)."""
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    if timeout_s is not None:
        env["NANOTRAIN_SLURM_TIMEOUT_S"] = str(timeout_s)
    return env


def running(pid_file: Path) -> bool:
    """Whether the child the hung command wrote to ``pid_file`` still runs (a zombie does not)."""
    try:
        pid = int(pid_file.read_text())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError):
        return False
    return state not in ("Z", "X")
