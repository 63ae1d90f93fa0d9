"""Submitting a submitit job with its `sbatch` call bounded (slurm_commands.run).

submitit's `SlurmExecutor` runs `sbatch` through `utils.CommandFunction`, which waits for ever: a
hung slurmctld hung the launch with its run directory half made. `SlurmExecutor._submit_command`
is the one method that runs the command, so `BoundedExecutor` overrides it: the same steps as
submitit 1.5's (write the batch file, run it, name the job, move the file into the job's
folder), with the call going through `slurm_commands.run`. Any sbatch refusal, timeout or
missing binary becomes `SubmitRefused`, whose message is the one line to print. A sweep's job
array (`submit_array`) goes through the same bounded call: submitit's own `map_array` would not.
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
        job_id = self._get_job_id_from_submission_command(done.stdout)
        job = self.job_class(
            # An array's folder may name its index (%a): its one script goes with task 0's files.
            folder=self.folder,
            job_id=f"{job_id}_0" if self.parameters.get("map_count") else job_id,
            tasks=list(range(self._num_tasks())),
        )
        job.paths.move_temporary_file(script, "submission_file", keep_as_symlink=True)
        self._write_job_id(job.job_id, uid)
        self._set_job_permissions(job.paths.folder)
        return job

    def submit_array(self, task, arg_lists: list[tuple]) -> list[submitit.core.core.Job]:
        """``task(*args)`` for each of ``arg_lists`` as one SLURM job array: one sbatch call, one
        script, array index i running ``arg_lists[i]``. (submitit's own ``map_array`` submits
        through a plain ``SlurmExecutor``, whose sbatch call is unbounded.)"""
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickles = []
        for args in arg_lists:
            delayed = utils.DelayedSubmission(task, *args)
            delayed.set_timeout(self.parameters.get("time", 5), self.max_num_timeout)
            pickles.append(folder / f"{uuid.uuid4().hex}.pkl")
            delayed.dump(pickles[-1])
        self.parameters["map_count"] = len(arg_lists)
        try:
            first = self._submit_command(self._submitit_command_str)
        finally:  # on a refusal the caller removes the folder, pickles and all
            del self.parameters["map_count"]
        array_id = first.job_id.split("_")[0]
        jobs = [
            self.job_class(folder=self.folder, job_id=f"{array_id}_{i}", tasks=list(range(self._num_tasks())))
            for i in range(len(pickles))
        ]
        for job, path in zip(jobs, pickles):
            job.paths.move_temporary_file(path, "submitted_pickle")
        return jobs


def submit(
    folder: Path, max_num_timeout: int, parameters: dict, task, *args, what: str = "the job"
) -> submitit.core.core.Job:
    """Queue ``task(*args)`` as a SLURM job (``parameters`` for `update_parameters`); sbatch's
    warnings of an accepted job go to stderr. Raises SubmitRefused with sbatch's one informative
    line (``what`` names the job), or the timeout's."""
    return _submitted(folder, max_num_timeout, parameters, lambda executor: executor.submit(task, *args), what)


def submit_array(
    folder: Path, max_num_timeout: int, parameters: dict, task, arg_lists: list[tuple], what: str = "the job array"
) -> list[submitit.core.core.Job]:
    """Queue ``task(*args)`` for each of ``arg_lists`` as one SLURM job array (``folder`` may name
    the array index, %a); refusals as ``submit``'s."""
    return _submitted(
        folder, max_num_timeout, parameters, lambda executor: executor.submit_array(task, arg_lists), what
    )


def _submitted(folder: Path, max_num_timeout: int, parameters: dict, queue, what: str):
    executor = BoundedExecutor(folder=folder, max_num_timeout=max_num_timeout)
    executor.update_parameters(**parameters)
    captured = io.StringIO()  # submitit prints sbatch's stderr itself; we say it in one line
    try:
        with contextlib.redirect_stderr(captured):
            job = queue(executor)
    except slurm_commands.SlurmCommandError as exc:
        raise SubmitRefused(f"{exc} (nothing was submitted)") from None
    except (OSError, subprocess.CalledProcessError, utils.FailedJobError) as exc:
        detail = str(getattr(exc, "stderr", None) or exc) + "\n" + captured.getvalue()
        raise SubmitRefused(f"sbatch refused {what}: {sbatch.sbatch_error(detail)}") from None
    sys.stderr.write(captured.getvalue())
    return job
