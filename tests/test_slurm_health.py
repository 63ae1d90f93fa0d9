"""A slow node is named, excluded, and the job continues without it on the real two-node cluster.

The test-only fault hook ``NANOTRAIN_TEST_SLOW_NODE=n2`` (exported to the job through
``slurm.env``) makes the timed matmul and all-reduces of the tasks on n2 ten times slower. A job
of ``slurm.nodes: 1-2`` (dp2 x tp2, 2 tasks per node; with both nodes idle SLURM gives it both)
with ``slurm.health`` on runs the health check after its smoke step: n2 is named, recorded in
``<run>/excluded_nodes.json``, and the job is requeued held, its ``ExcNodeList`` set to n2, its
node range given back (a requeued job is pinned to its last node count) and released. It then
starts on n1 alone at the planner's layout for two ranks (the global batch kept), passes its
check (one node, nothing slow) and completes: sacct shows the REQUEUED run on n[1-2] and the
COMPLETED one on n1, ``--status`` the exclusion. (A job of a fixed two-node count would wait
for a second node forever here, ``Reason=BadConstraints``; the log says so and how to go on, and
``--resume`` submits with the run's exclusions: tests/test_health.py.) The thresholds are 4x
(the hook slows 10x): four tasks of one 2-core machine share its cores, so a task's matmul may
take twice the median's.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from helpers.processes import step_of
from helpers.runs import TINY, cli, set_args, warm_data_cache
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

STEPS = 4


def _sacct(job_id: str) -> list[list[str]]:
    out = subprocess.run(
        ["sacct", "-j", job_id, "-X", "-n", "-P", "-D", "-o", "JobID,State,NodeList,ExitCode"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return [line.split("|") for line in out.splitlines() if line.strip()]


def _status(run_dir: Path) -> str:
    proc = subprocess.run(cli("--status", str(run_dir)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_slow_node_is_excluded_on_requeue_and_the_job_continues_on_the_other(slurm_cluster, tmp_path):
    assert {"n1", "n2"} <= set(slurm_cluster), slurm_cluster
    warm_data_cache(tmp_path)
    run_dir = tmp_path / "slow-node"
    items = [
        f"logging.dir={tmp_path}",
        "logging.run_name=slow-node",
        f"training.train_steps={STEPS}",
        "logging.log_interval=1",
        "checkpoints.interval=0",
        "parallelism.pp=1",
        "training.batch_accumulation_per_replica=2",
        "slurm.tasks_per_node=2",
        "slurm.nodes=1-2",
        "slurm.health.enabled=true",
        "slurm.health.matmul_slowdown=4",
        "slurm.health.allreduce_slowdown=4",
        "slurm.max_excluded_nodes=1",
        "slurm.max_requeues=2",
        "slurm.env.NANOTRAIN_TEST_SLOW_NODE=n2",
    ]
    job = None
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cli(str(TINY), *set_args(items)), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        job = submitted_job_id(proc.stdout)

        # the health check names n2, the job is requeued without it and runs on n1 alone
        wait_until(lambda: restart_count(job) >= 1, 120, "the requeue after the health check", job)
        print(f"submit -> requeued by the health check: {time.monotonic() - t0:.1f} s")

        def finished():  # a requeued job waits cred_expire (30 s) in BeginTime: start it at once
            state = job_state(job)
            if state == "PENDING":
                start_now_if_requeued(job)
            return state if state in TERMINAL else None

        assert wait_until(finished, 180, "the job to finish on n1", job, interval=1.0) == "COMPLETED"
        print(f"submit -> continued on one node and completed: {time.monotonic() - t0:.1f} s")
        assert job_field(job, "ExcNodeList") == "n2"
        record = json.loads((run_dir / "excluded_nodes.json").read_text())
        assert [(e["node"], e["source"]) for e in record["nodes"]] == [("n2", "health")], record
        assert record["applied"][-1]["nodes"] == ["n2"] and record["applied"][-1]["job_id"] == job
        checks = [json.loads(line) for line in (run_dir / "health" / "startup.jsonl").read_text().splitlines()]
        first, last = checks[0], checks[-1]
        assert first["slow_nodes"] == ["n2"] and first["node_count"] == 2 and first["seconds"] < 10, first
        assert all(s["node"] == "n2" for s in first["slow"])
        assert last["node_count"] == 1 and not last["slow_nodes"], last
        rows = _sacct(job)  # one record per run: the first one REQUEUED on both nodes, then n1
        assert [r[1:3] for r in rows] == [["REQUEUED", "n[1-2]"], ["COMPLETED", "n1"]], rows
        logs = "".join(p.read_text() for p in (run_dir / "job").glob(f"{job}_0_log.out"))
        assert re.search(r"nodes: 1 of slurm.nodes 1-2 \(2 ranks\): planned layout", logs), logs[-3000:]
        assert step_of(run_dir) == STEPS
        status = _status(run_dir)
        assert "excluded nodes: n2 (health" in status and "nodes: n1" in status, status
        assert "requeues: 1" in status and f"step {STEPS}/{STEPS}" in status, status
        assert re.search(r"health \(job \d+ restart 1, [\d.]+ s, 1 node\(s\), 2 tasks\): ok", status), status
        print(status)
        print("sacct:", rows)
    finally:
        cancel(job)
