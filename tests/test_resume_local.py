"""Preempt a local run with SIGUSR2 (what SLURM sends), resume it, and compare with a run that was
never interrupted: the loss sequence and the final weights are bit-identical (`==`) on CPU,
at (1,1,1), at (dp2, tp2, pp2) and at (cp2, tp2, pp2) with ZeRO-1. The uninterrupted and the
preempted runs are the session's shared ones (``helpers.runs``); the resume works on a copy."""

from __future__ import annotations

import subprocess

import pytest

from helpers.runs import STEPS, TOPOLOGIES, cli, final_weights, tb_losses


@pytest.mark.timeout(900)
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_preempt_and_resume_is_bit_exact(tmp_path, topology, shared_runs):
    straight = shared_runs.straight(topology)
    run_dir, stopped = shared_runs.preempted_copy(topology, tmp_path / "interrupted")

    resumed = subprocess.run(cli("--resume", str(run_dir), "--local"), capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"at step {stopped} (same topology)" in resumed.stdout

    expected, got = tb_losses(straight), tb_losses(run_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert got == expected  # bit for bit, every step
    a, b = final_weights(straight), final_weights(run_dir)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
