"""A requeued job with a node range (``slurm.nodes: 'min-max'``) must be able to land on fewer
nodes. SLURM (seen on 22.05) pins a job's counts to its allocation when it starts (``NumTasks``,
``NumCPUs`` = nodes x tasks per node (x CPUs per task), and the node count) and keeps them across
a requeue, so the requeued job of a 2-node allocation asks for 8 tasks of 4 per node: 2 nodes
again, its range notwithstanding, and it waits for them. Setting ``NumNodes``, ``NumTasks`` and
``NumCPUs`` back to the range and its minimum's counts on the *pending* job gives the range back
(SLURM refuses the update while the job runs, and the requeue ends every process of the job, the
one that asked included). The batch script then gives srun the task count of the nodes it got
(``sbatch.node_range_lines``): the requeued job's batch environment keeps the first count.

So rank 0 starts, just before it requeues, a detached process (its own session; its parent, a
shell, exits at once, so no process of the job is its ancestor) that waits for the job to be
pending again and then runs ``scontrol update JobId=J NumNodes=min-max NumTasks=K NumCPUs=C``,
for at most ``RESTORE_S`` seconds. Where SLURM tracks a job's processes by their parentage
(proctrack/linuxproc, the local cluster) the detached process outlives the job's end; under
proctrack/cgroup it is ended with the job, the requeued job then waits for its last node count,
and the line printed here names the command that gives the range back by hand.

Standard library only (``preemption.py`` calls it before torch is imported).
"""

from __future__ import annotations

import shlex
import subprocess

RESTORE_S = 120  # the pending job is normally updated within a second of the requeue
RETRY_S = 0.5


def restore_command(job_id: str, nodes: str, tasks: int, cpus: int) -> list[str]:
    """The shell loop of the detached process: once squeue says the job is PENDING (an update
    while it is still COMPLETING is taken, then overridden when it becomes pending), its node range
    and task count are set back, each command bounded, the whole bounded by ``RESTORE_S``."""
    job = shlex.quote(job_id)
    counts = f"NumNodes={shlex.quote(nodes)} NumTasks={int(tasks)} NumCPUs={int(cpus)}"
    update = f"timeout 15 scontrol update JobId={job} {counts}"
    pending = f'[ "$(timeout 15 squeue -h -j {job} -o %T 2>/dev/null)" = PENDING ]'
    tries = int(RESTORE_S / RETRY_S)
    loop = (
        f"i=0; while [ $i -lt {tries} ]; do {pending} && {update} >/dev/null 2>&1 && exit 0; "
        f"i=$((i+1)); sleep {RETRY_S}; done; exit 1"
    )
    return ["sh", "-c", loop]


def restore_after_requeue(job_id: str, nodes: str, tasks: int, cpus: int) -> None:
    """Start the detached restorer of job ``job_id``'s node range (``nodes``: 'min-max';
    ``tasks`` and ``cpus``: the tasks and CPUs of its fewest nodes) and say so; never raises (the
    requeue itself matters more)."""
    loop = shlex.join(restore_command(job_id, nodes, tasks, cpus))
    try:  # the shell backgrounds the loop and exits: the loop's parent is no process of the job
        subprocess.run(
            ["sh", "-c", f"{loop} </dev/null >/dev/null 2>&1 &"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"preemption: cannot start the node-range restorer ({exc})", flush=True)
    print(
        f"preemption: slurm.nodes {nodes}: the requeued job gets its range back once it is pending, so it may "
        f"start on fewer nodes (by hand: scontrol update JobId={job_id} NumNodes={nodes} NumTasks={tasks} "
        f"NumCPUs={cpus})",
        flush=True,
    )
