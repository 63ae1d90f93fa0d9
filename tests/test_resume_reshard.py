"""Save at (dp2, tp2, pp2) through the CLI, resume at other topologies (pp4, ZeRO-1 over dp4, one
process, context parallel): the losses continue within rel. 1e-5 of the run that was never
interrupted (both are the session's shared runs, ``helpers.runs``). The data position is global
consumed samples, so every layout reads the same next samples."""

from __future__ import annotations

import subprocess

import pytest

from helpers.runs import STEPS, cli, set_args, tb_losses

# Every layout keeps the global batch: dp * batch_accumulation_per_replica * micro_batch = 16.
RESUME_AT = {
    "dp1-tp2-pp4": [
        "parallelism.dp=1",
        "parallelism.tp=2",
        "parallelism.pp=4",
        "training.batch_accumulation_per_replica=8",
    ],
    "dp4-tp2-pp1-zero1": [
        "parallelism.dp=4",
        "parallelism.tp=2",
        "parallelism.pp=1",
        "training.batch_accumulation_per_replica=2",
        "optimizer.zero_stage=1",
    ],
    "dp1-tp1-pp1": [
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "training.batch_accumulation_per_replica=8",
    ],
    "dp1-cp2-tp2-pp2": ["parallelism.dp=1", "parallelism.cp=2", "training.batch_accumulation_per_replica=8"],
}


@pytest.mark.timeout(1200)
def test_resume_at_other_topologies(tmp_path, shared_runs):
    expected = dict(tb_losses(shared_runs.straight("2-2-2")))
    saved, stopped = shared_runs.preempted_copy("2-2-2", tmp_path / "saved")

    for name, layout in RESUME_AT.items():
        run_dir = tmp_path / name
        subprocess.run(["cp", "-r", str(saved), str(run_dir)], check=True)
        args = set_args(layout)
        resumed = subprocess.run(
            cli("--resume", str(run_dir), "--local", *args), capture_output=True, text=True, timeout=400
        )
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        assert f"at step {stopped} (resharded from another topology: dp2 tp2 pp2 cp1 ep1)" in resumed.stdout, (
            resumed.stdout[-2000:]
        )
        got = dict(tb_losses(run_dir))
        assert sorted(got) == list(range(1, STEPS + 1))
        for step in range(stopped + 1, STEPS + 1):
            assert abs(got[step] - expected[step]) <= 1e-5 * abs(expected[step]), (
                name,
                step,
                got[step],
                expected[step],
            )
