"""Hangs end loudly, with a culprit (issue 16, item 1): one of 8 local ranks SIGSTOPped, and one
rank asleep inside a pipeline step (a test-only hook, tests/hooks/sitecustomize.py). The job
exits non-zero (4: hung) within collective_timeout_s + 60 s, the other ranks' reports
(`<run>/hang/rank-R.json`) name the phase and the collective, the last checkpoint is intact,
and `submit.py --status` names the culprit rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from nanotrain.runtime.hang import EXIT_HUNG, is_comm_failure, is_timeout
from nanotrain.runtime.hang_status import culprit

from helpers.processes import assert_latest_intact, rank_pid, signal_rank, step_of
from helpers.runs import TINY, cli, set_args, warm_data_cache
from helpers.slurm import wait_until

HOOKS = Path(__file__).resolve().parent / "hooks"
TIMEOUT_S = 8  # training.collective_timeout_s of these runs


def overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    items = [
        f"logging.dir={tmp_path}",
        f"logging.run_name={name}",
        "training.train_steps=400",
        "logging.log_interval=1",
        "checkpoints.interval=5",
        f"training.collective_timeout_s={TIMEOUT_S}",
        *extra,
    ]
    return set_args(items)


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    """One logging.dir for this module's runs, its data cache filled once."""
    path = tmp_path_factory.mktemp("hang-logs")
    warm_data_cache(path)
    return path


def reports(run_dir: Path) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in (run_dir / "hang").glob("rank-*.json")}


def status_of(run_dir: Path) -> str:
    proc = subprocess.run(cli("--status", str(run_dir)), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.timeout(400)
def test_sigstop_of_one_of_8_local_ranks(logs):
    tmp_path = logs
    run_dir = tmp_path / "stopped"
    proc = subprocess.Popen(
        cli(str(TINY), "--local", *overrides(tmp_path, "stopped")),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: step_of(run_dir) >= 7 or proc.poll() is not None, 300, "step 7")
        _, stopped_at = signal_rank(run_dir, 3, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=TIMEOUT_S + 60)
        took = time.monotonic() - stopped_at
        print(f"SIGSTOP -> job exit: {took:.1f} s (collective_timeout_s {TIMEOUT_S})")
        assert took < TIMEOUT_S + 60
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_HUNG, out[-3000:]
    found = reports(run_dir)
    assert 3 not in found and len(found) >= 1, sorted(found)
    for rank, report in found.items():
        assert report["rank"] == rank and report["phase"] and report["stacks"], report
        assert any("MainThread" in name for name in report["stacks"])
    # The ranks that wait for rank 3 name a collective whose group holds it.
    assert any(3 in r["collective"]["group"]["ranks"] for r in found.values() if r["collective"])
    assert assert_latest_intact(run_dir) >= 5
    status = status_of(run_dir)
    # the culprit with its host (item 4 of issue 31: off SLURM the node is the host), from its smoke report
    host = json.loads((run_dir / "smoke" / "rank-3.json").read_text())["host"]
    assert f"rank 3 (host {host}) did not reach" in status and "hung at step" in status, status
    for rank in range(8):
        assert rank_pid(run_dir, rank) is None, f"rank {rank} survived"


@pytest.mark.timeout(300)
def test_rank_asleep_inside_a_pipeline_step(logs):
    tmp_path = logs
    run_dir = tmp_path / "asleep"
    layout = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=2"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
        "NANOTRAIN_TEST_SLEEP_IN_PP": "1:4",
    }
    started = time.monotonic()
    proc = subprocess.run(
        cli(str(TINY), "--local", *overrides(tmp_path, "asleep", *layout)),
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == EXIT_HUNG, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = reports(run_dir)
    asleep = found[1]
    assert asleep["step"] == 3 and asleep["phase"].startswith("forward (pp F micro-batch"), asleep
    assert not asleep["waiting_in_communication"] and "watchdog" in asleep["reason"]
    main = next(stack for name, stack in asleep["stacks"].items() if "MainThread" in name)
    assert "time.sleep(3600)" in main[-1], main[-1]
    if 0 in found:  # its peer waits for a pipeline message from it (or timed out already)
        assert found[0]["collective"]["group"]["ranks"] == [0, 1]
    status = status_of(run_dir)
    assert (
        "hung at step 3 in forward (pp F micro-batch" in status
        and f"rank 1 (host {asleep['host']}) did not reach" in status
    ), status
    assert time.monotonic() - started < 240


def _report(rank, step, phase, coll, ranks, waiting=True, world=4):
    return {
        "rank": rank,
        "world_size": world,
        "step": step,
        "phase": phase,
        "waiting_in_communication": waiting,
        "collective": {"name": coll, "group": {"name": "dp", "ranks": ranks}},
    }


@pytest.mark.parametrize(
    "reports_, expected",
    [
        (
            [
                _report(0, 7, "backward", "all_reduce gradient bucket 0", [0, 2]),
                _report(1, 7, "forward", "tp all_reduce", [0, 1]),
                _report(3, 7, "forward", "tp all_reduce", [2, 3]),
            ],
            "hung at step 7 in backward; rank 2 did not reach all_reduce gradient bucket 0 on dp (ranks 0, 2)",
        ),
        (
            [
                _report(0, 7, "backward", "all_reduce gradient bucket 0", [0, 1], world=2),
                _report(1, 7, "forward (pp F micro-batch 2)", "pipeline send", [0, 1], waiting=False, world=2),
            ],
            "hung at step 7 in forward (pp F micro-batch 2); rank 1 did not reach all_reduce gradient bucket 0 "
            "on dp (ranks 0, 1)",
        ),
        # SLURM continues a stopped task (SIGCONT) before it kills it: it reports late, frozen.
        (
            [
                _report(0, 7, "backward", "tp all_reduce", [0, 1], world=2),
                {**_report(1, 7, "backward", "tp all_reduce", [0, 1], world=2), "frozen_s": 9.5},
            ],
            "hung at step 7 in backward; rank 1 did not reach tp all_reduce on dp (ranks 0, 1); rank 1 was frozen",
        ),
    ],
)
def test_culprit_from_reports(reports_, expected):
    assert culprit(reports_).startswith(expected)


@pytest.mark.parametrize(
    "exc, comm, timeout",
    [
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv"), True, True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:23252"), True, False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"), False, False),
        (ValueError("timed out"), False, True),
        # NCCL/c10d, as ProcessGroupNCCL and NCCL word them: a lost peer or a timed-out collective ...
        (
            RuntimeError(
                "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, "
                "NumelIn=1, NumelOut=1, Timeout(ms)=60000) ran for 60003 milliseconds before timing out."
            ),
            True,
            True,
        ),
        (dist.DistBackendError("NCCL communicator was aborted on rank 1."), True, False),
        (
            dist.DistBackendError(
                "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a "
                "network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to "
                "a network error or a remote process exiting prematurely."
            ),
            True,
            False,
        ),
        (dist.DistNetworkError("Connection reset by peer"), True, False),
        (dist.DistStoreError("wait timeout after 300000ms, keys: /default_pg/0//cuda//0"), True, True),
        # ... and bugs that merely mention the backend: not a hang, never requeued.
        (
            dist.DistBackendError(
                "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid argument (run with NCCL_DEBUG=WARN "
                "for details), NCCL version 2.21.5\nncclInvalidArgument: Invalid value for an argument."
            ),
            False,
            False,
        ),
        (
            dist.DistBackendError(
                "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to "
                "CUDA function failed."
            ),
            False,
            False,
        ),
        (RuntimeError("[gloo/transport/tcp/pair.cc:208] Invalid peer rank: 7"), False, False),
    ],
)
def test_which_errors_count_as_a_hang(exc, comm, timeout):
    assert is_comm_failure(exc) is comm and is_timeout(exc) is timeout
