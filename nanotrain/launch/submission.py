"""Submitting a submitit job with its `sbatch` call bounded (slurm_commands.run).

submitit's `SlurmExecutor` runs `sbatch` through `utils.CommandFunction`, which waits for ever: a
hung slurmctld hung the launch with its run directory half made. `SlurmExecutor._submit_command`
is the one method that runs the command, so `BoundedExecutor` overrides it: the same steps as
submitit 1.5's (write the batch file, run it, name the job, move the file into the job's
folder), with the call going through `slurm_commands.run`. Any sbatch refusal, timeout or
missing binary becomes `SubmitRefused`, whose message is the one line to print.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import uuid
from pathlib import Path

import submitit
from submitit.core import utils

from nanotrain.config import ConfigError
from nanotrain.launch import sbatch
from nanotrain.runtime import slurm_commands


class SubmitRefused(ConfigError):
    """sbatch did not queue the job (refused it, did not answer, or is missing): one line."""


class BoundedExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor whose sbatch call has a timeout and kills what it started."""

    def _submit_command(self, command: str) -> submitit.core.core.Job:
        uid = uuid.uuid4().hex
        script = utils.JobPaths.get_first_id_independent_folder(self.folder) / f".submission_file_{uid}.sh"
        script.write_text(self._make_submission_file_text(command, uid))
        argv = self._make_submission_command(script)
        done = slurm_commands.run(argv)
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, argv, done.stdout, done.stderr)
        job = self.job_class(
            folder=self.folder,
            job_id=self._get_job_id_from_submission_command(done.stdout),
            tasks=list(range(self._num_tasks())),
        )
        job.paths.move_temporary_file(script, "submission_file", keep_as_symlink=True)
        self._write_job_id(job.job_id, uid)
        self._set_job_permissions(job.paths.folder)
        return job


def submit(
    folder: Path, max_num_timeout: int, parameters: dict, task, *args, what: str = "the job"
) -> submitit.core.core.Job:
    """Queue ``task(*args)`` as a SLURM job (``parameters`` for `update_parameters`); sbatch's
    warnings of an accepted job go to stderr. Raises SubmitRefused with sbatch's one informative
    line (``what`` names the job), or the timeout's."""
    executor = BoundedExecutor(folder=folder, max_num_timeout=max_num_timeout)
    executor.update_parameters(**parameters)
    captured = io.StringIO()  # submitit prints sbatch's stderr itself; we say it in one line
    try:
        with contextlib.redirect_stderr(captured):
            job = executor.submit(task, *args)
    except slurm_commands.SlurmCommandError as exc:
        raise SubmitRefused(f"{exc} (nothing was submitted)") from None
    except (OSError, subprocess.CalledProcessError, utils.FailedJobError) as exc:
        detail = str(getattr(exc, "stderr", None) or exc) + "\n" + captured.getvalue()
        raise SubmitRefused(f"sbatch refused {what}: {sbatch.sbatch_error(detail)}") from None
    sys.stderr.write(captured.getvalue())
    return job
