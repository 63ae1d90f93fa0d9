"""Rank 0's side of ``checkpoints.eval_job``: after each committed checkpoint, start the child
process that submits (SLURM) or runs (``--local``) its evaluation, without waiting for it
(``launch/eval_job.py``), and tell ``checkpoints.keep_last`` which checkpoints an evaluation job
has yet to read (``eval_record.protects``).

The child gets the rank's environment less the variables of this job and of torch.distributed
(``SLURM_*``, ``RANK``, ``MASTER_ADDR``...): an sbatch run from inside an allocation would
otherwise hand the evaluation job this job's task layout. Its output goes to
``<run>/eval/step_<N>.log``. At the rank's end, however it ends, rank 0 waits for the children it started:
on SLURM the submissions (seconds: the job would end and take them with it), locally the
evaluations themselves, so that a ``--local`` run returns with every checkpoint evaluated.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from nanotrain.runtime import eval_record

# Variables of the training job a child must not pass on to the job it submits or to itself.
_JOB_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SUBMITIT_", "TORCHELASTIC_")
_JOB_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"}
_JOB_NAMES |= {"NANOTRAIN_LAUNCHER"}


def child_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(_JOB_PREFIXES) and k not in _JOB_NAMES}


class EvalJobs:
    """The evaluation jobs of one training process (a no-op but on rank 0 with the field on)."""

    def __init__(self, config, run_dir: Path, launcher: str, rank: int):
        self.enabled = rank == 0 and config.checkpoints.eval_job.enabled
        self.checkpoints = Path(config.checkpoints.path or Path(run_dir) / "checkpoints")
        slurm = launcher == "slurm" or (launcher == "torchrun" and "SLURM_JOB_ID" in os.environ)
        self.run_dir, self.local = Path(run_dir), not slurm
        self.children: list[tuple[int, subprocess.Popen]] = []

    def committed(self, step: int) -> None:
        """Start the evaluation of the checkpoint of ``step``, just committed, unless one was
        started for it already (a resumed run saving a step again). Never raises: a record that
        cannot be written (a full disk) is a warning, and training goes on."""
        if not self.enabled:
            return
        try:
            self._start(step)
        except Exception as exc:  # noqa: BLE001 - nothing of an evaluation may stop training
            print(f"warning: the evaluation of step {step} was not started: {exc}", file=sys.stderr, flush=True)

    def _start(self, step: int) -> None:
        self.children = [(s, p) for s, p in self.children if p.poll() is None]  # reap the ended
        # The checkpoint's identity: its COMPLETE file holds meta.json's sha256. A step saved
        # again with other weights (a resume from an older checkpoint after the latest was found
        # damaged) is evaluated again; the same checkpoint (a resumed run) is not.
        try:
            identity = (self.checkpoints / f"step_{step:06d}" / "COMPLETE").read_text().strip()
        except OSError:
            identity = None
        earlier = eval_record.read_record(self.run_dir, step)
        if earlier is not None and earlier.get("checkpoint") == identity:
            return
        launcher = "local" if self.local else "slurm"
        log = eval_record.record_path(self.run_dir, step).with_suffix(".log")
        eval_record.update_record(
            self.run_dir,
            step,
            fresh=True,
            state="submitting",
            launcher=launcher,
            submitted=time.time(),
            read=False,
            log=str(log),
            checkpoint=identity,
        )
        argv = [sys.executable, "-m", "nanotrain.launch.eval_job", str(self.run_dir), str(step)]
        try:
            with open(log, "ab") as out:
                child = subprocess.Popen(
                    argv + (["--local"] if self.local else []),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=child_env(),
                )
        except OSError as exc:  # never the training's problem: recorded, said once
            eval_record.update_record(self.run_dir, step, state="not submitted", error=f"cannot start {argv[2]}: {exc}")
            print(f"warning: the evaluation of step {step} was not started: {exc}", file=sys.stderr, flush=True)
            return
        eval_record.update_record(
            self.run_dir, step, only_if_state=("submitting",), whole=True, **{**eval_record.here(), "pid": child.pid}
        )
        self.children.append((step, child))
        what = "evaluating" if self.local else "submitting the evaluation job of"
        print(f"eval job: {what} step {step} (pid {child.pid}, log {log})", flush=True)

    def protects(self, step: int) -> bool:
        """Whether ``keep_last`` must keep the checkpoint of ``step`` for its evaluation."""
        if not self.enabled:
            return False
        try:
            return eval_record.protects(self.run_dir, step)
        except Exception:  # noqa: BLE001 - an unreadable record: keep the checkpoint, never fail the save
            return True

    def wait(self) -> None:
        """Wait for the children still running (the rank's end, however it ends)."""
        for step, child in self.children:
            if child.poll() is None:
                if self.local:
                    print(f"eval job: waiting for the evaluation of step {step} (pid {child.pid})", flush=True)
                child.wait()
        self.children = []
