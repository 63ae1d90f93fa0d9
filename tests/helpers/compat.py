"""The checkpoint of an older format kept as a test fixture (``tests/fixtures/checkpoint_v1``):
where its parts lie, the command that trains or resumes it, and what a checkpoint's parameters
are compared by.

The fixture directory holds ``config.yaml`` and ``data.txt`` (the run's input: ``data.source`` is
``data.txt``, relative to the working directory, so every run here starts in a directory holding
it), ``run/`` (the run directory as nanotrain wrote it, with the checkpoint of step
``RESUME_STEP`` only) and ``expected.json`` (what resuming it gave the code that wrote it).
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from safetensors.numpy import load_file

from helpers.runs import ROOT, cli

FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint_v1"
INPUTS = ("config.yaml", "data.txt")
RUN = "run"
RESUME_STEP, FINAL_STEP = 3, 6
TIMEOUT_S = 120


def submit(work: Path, *args: str) -> subprocess.CompletedProcess:
    """``submit.py ARGS --local`` run in ``work`` (it holds ``data.txt``) with a hard timeout; the
    launcher's fork server kills the ranks when the launcher is killed."""
    return subprocess.run(cli(*args, "--local"), cwd=work, capture_output=True, text=True, timeout=TIMEOUT_S)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def model_tensors(ckpt: Path) -> dict:
    """Parameter name -> array, from every ``model/*.safetensors`` file of the checkpoint ``ckpt``
    (one process: each name in one file; a name found twice is an error, not an overwrite)."""
    tensors: dict = {}
    for path in sorted((ckpt / "model").rglob("*.safetensors")):
        for name, value in load_file(str(path)).items():
            assert name not in tensors, f"{name} saved twice (again in {path})"
            tensors[name] = value
    return tensors


def param_digest(ckpt: Path) -> str:
    """sha256 over the checkpoint's parameters in name order: each name, dtype, shape and raw
    bytes. It names the values, not the files: the same weights written in other files (or
    another file order) give the same digest, one changed bit another."""
    digest = hashlib.sha256()
    for name, value in sorted(model_tensors(ckpt).items()):
        digest.update(f"{name}|{value.dtype.str}|{list(value.shape)}|".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()
