"""Smoke test of the real local SLURM cluster (slurm/local-cluster.sh).

Submits a real 2-node x 2-task batch job and checks that it completes with tasks on
both emulated nodes. Everything else that talks to SLURM builds on this working.
"""

import subprocess
import time

import pytest

pytestmark = pytest.mark.slurm

# States after which a job never runs again (sacct spelling, first word only).
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def _run(*cmd: str, timeout: float = 30) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=timeout).stdout


def _wait_for_job(job_id: str, limit_s: float = 60) -> str:
    """Poll sacct until the job ends; scancel and fail after limit_s.

    Not `sbatch --wait`: a job that can never be scheduled (e.g. asks for more than the
    nodes offer) waits in the queue forever, and the test must not hang with it.
    """
    deadline = time.monotonic() + limit_s
    state = ""
    while time.monotonic() < deadline:
        # Empty right after submission: slurmctld reports to slurmdbd asynchronously.
        out = _run("sacct", "-j", job_id, "-n", "-X", "-P", "-o", "State").split()
        state = out[0] if out else ""
        if state in TERMINAL:
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    pytest.fail(f"job {job_id} not finished after {limit_s:.0f}s (last state {state!r}); cancelled")


def test_two_node_job_completes(slurm_cluster, tmp_path):
    """A -N2 --ntasks-per-node=2 job runs 4 tasks, two on each of n1 and n2."""
    assert len(slurm_cluster) >= 2, f"slurm/local-cluster.sh brings up 2 nodes; usable: {slurm_cluster}"
    out_file = tmp_path / "job.out"
    # `hostname` prints the real host on every emulated node, so report SLURMD_NODENAME.
    job_id = (
        _run(
            "sbatch",
            "--parsable",
            "-N2",
            "--ntasks-per-node=2",
            "--time=2",
            f"--chdir={tmp_path}",
            f"--output={out_file}",
            "--job-name=nanotrain-smoke",
            "--wrap",
            'srun bash -c "echo node=\\$SLURMD_NODENAME rank=\\$SLURM_PROCID"',
        )
        .strip()
        .split(";")[0]
    )

    state = _wait_for_job(job_id)

    output = out_file.read_text() if out_file.exists() else "<no output file>"
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{output}"
    lines = sorted(line for line in output.splitlines() if line.startswith("node="))
    assert len(lines) == 4, output
    nodes = {line.split()[0].removeprefix("node=") for line in lines}
    assert {"n1", "n2"} <= nodes, output
