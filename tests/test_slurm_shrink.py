"""A job with a node range continues on fewer nodes, on the real local SLURM cluster.

The tiny config (dp2 x tp2 x pp2, 2 nodes x 4 tasks) is submitted with ``slurm.nodes: 1-2`` and
a node list of both nodes (so that its first incarnation has both whatever else runs). After a
few steps it is preempted (``scancel --signal=USR2``, what SLURM sends): it saves and requeues,
and its rank 0 gives the requeued job its range back (SLURM pins a requeued job's task count
to its last allocation). While the job is held pending, the test makes only one node available
to it (the node list cleared, the other node excluded), as a shrunken cluster would, and copies
the checkpoint. The job then runs on one node: every rank plans the same layout for 4 ranks,
prints it, reshards the checkpoint and finishes. Its losses equal, within 1e-6 relative, those
of the same 4-rank layout resumed locally from the copied checkpoint, and no step is lost or
repeated.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers.processes import step_of
from helpers.slurm import (
    TERMINAL,
    cancel,
    job_field,
    job_state,
    restart_count,
    start_now_if_requeued,
    submitted_job_id,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
STEPS = 8
pytestmark = [pytest.mark.slurm]


def losses(run_dir: Path) -> dict[int, float]:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}


def scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], check=True, capture_output=True, timeout=30)


@pytest.mark.timeout(600)
def test_requeued_onto_one_node_continues_at_the_planned_layout(slurm_cluster, tmp_path):
    from nanotrain.config import load_config
    from nanotrain.estimate.resize import global_batch, layout_for_nodes, set_args, summary

    assert len(slurm_cluster) >= 2, f"needs two nodes: {slurm_cluster}"
    kept, gone = slurm_cluster[0], slurm_cluster[1]
    items = [
        f"logging.dir={tmp_path}",
        "logging.run_name=shrink",
        f"training.train_steps={STEPS}",
        "logging.log_interval=1",
        "checkpoints.interval=0",
        "slurm.max_requeues=3",
        "slurm.nodes=1-2",
        f"slurm.sbatch_extra.nodelist={kept},{gone}",
    ]
    args = [sys.executable, str(ROOT / "submit.py"), str(TINY)] + [a for i in items for a in ("--set", i)]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1-2 node(s) x 4 tasks" in proc.stdout, proc.stdout
    job_id, run_dir = submitted_job_id(proc.stdout), tmp_path / "shrink"
    copy = tmp_path / "from-checkpoint"
    try:

        def past(step: int) -> bool:
            state = job_state(job_id)
            if state in TERMINAL:
                raise AssertionError(f"job {job_id} ended ({state}) before it was preempted")
            return state == "RUNNING" and step_of(run_dir) > step

        wait_until(lambda: past(2), 240, "training past step 2", job_id)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        # Requeued: pending until its begin time (cred_expire, 30 s here), then held by the test.
        wait_until(lambda: restart_count(job_id) >= 1 and job_state(job_id) == "PENDING", 120, "the requeue", job_id)
        scontrol("hold", job_id)
        # Its task count back to the range's minimum (rank 0's detached restorer), not 8 as SLURM left it.
        wait_until(lambda: job_field(job_id, "NumTasks") == "4", 60, "NumTasks=4 on the requeued job", job_id)
        scontrol("update", f"JobId={job_id}", "ReqNodeList=", f"ExcNodeList={gone}")  # one node left
        shutil.copytree(run_dir, copy, symlinks=True)
        scontrol("release", job_id)
        start_now_if_requeued(job_id)

        def finished():
            state = job_state(job_id)
            if state == "PENDING":
                start_now_if_requeued(job_id)
            return state if state in TERMINAL else None

        assert wait_until(finished, 300, "the job to finish on one node", job_id, interval=1.0) == "COMPLETED"
        assert job_field(job_id, "NodeList") == kept
    finally:
        cancel(job_id)

    log = (run_dir / "job" / f"{job_id}_0_log.out").read_text()
    saved = re.findall(r"preempted at step (\d+)", log)
    assert len(saved) == 1, log[-3000:]
    stopped = int(saved[0])
    config = load_config(run_dir / "config.yaml")
    planned = layout_for_nodes(config, 1)
    assert planned.parallelism.world_size == 4 and global_batch(planned) == global_batch(config) == 16
    assert "smoke: ok: world=8" in log and "smoke: ok: world=4" in log, log[-3000:]
    assert f"nodes: 1 of slurm.nodes 1-2 (4 ranks): planned layout {summary(planned)}, global batch 16 kept" in log
    assert f"at step {stopped} (resharded from another topology: dp2 tp2 pp2 cp1 ep1)" in log, log[-3000:]

    # The uninterrupted 1-node run from that checkpoint: the same layout, resumed locally.
    layout = [a.removeprefix("--set ") for a in set_args(planned)] + ["slurm.nodes=null"]
    reference = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), "--resume", str(copy), "--local"]
        + [a for i in layout for a in ("--set", i)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-2000:]
    got, expected = losses(run_dir), losses(copy)
    assert sorted(got) == list(range(1, STEPS + 1))  # no step lost, none repeated
    assert 1 <= stopped < STEPS
    for step in range(stopped + 1, STEPS + 1):
        assert abs(got[step] - expected[step]) <= 1e-6 * abs(expected[step]), (step, got[step], expected[step])
