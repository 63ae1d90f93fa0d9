"""Asynchronous checkpoints (issue 16, item 2): `checkpoints.async_save: true` trains exactly like
a synchronous run, resumes bit-exactly from a checkpoint written in the background, keeps the
previous checkpoint as `latest` when a rank is killed during a background write, and a
preemption during an in-flight save commits it, saves the stop step once and exits 0. The slow
writes come from a test-only hook (tests/hooks/sitecustomize.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from nanotrain.checkpoint import read_latest
from nanotrain.checkpoint.format import update_latest, verify_checkpoint

from helpers.processes import signal_rank, step_of
from helpers.runs import SETTINGS, TINY, cli, final_weights, set_args, tb_losses
from helpers.slurm import wait_until

HOOKS = Path(__file__).resolve().parent / "hooks"
ASYNC = ["checkpoints.async_save=true", "checkpoints.interval=5", "checkpoints.keep_last=5"]


def sets(items: list[str]) -> list[str]:
    return set_args(items)


def hooked(**variables: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]), **variables}


@pytest.mark.timeout(600)
def test_async_run_and_resume_are_bit_exact(tmp_path, shared_runs):
    straight = shared_runs.straight("2-2-2")  # synchronous saves (at the end only)
    run_dir = tmp_path / "async"
    proc = subprocess.run(
        cli(str(TINY), "--local", *sets([f"logging.dir={tmp_path}", "logging.run_name=async", *SETTINGS, *ASYNC])),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert tb_losses(run_dir) == tb_losses(straight)
    root = run_dir / "checkpoints"
    assert read_latest(root) == "step_000015"
    for step in (5, 10, 15):
        assert verify_checkpoint(root / f"step_{step:06d}") == []
    a, b = final_weights(straight), final_weights(run_dir)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

    # Resume from step 10, written by the background thread while steps 11.. trained.
    shutil.rmtree(root / "step_000015")
    update_latest(root, "step_000010")
    resumed = subprocess.run(cli("--resume", str(run_dir), "--local"), capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "at step 10 (same topology)" in resumed.stdout
    assert tb_losses(run_dir) == tb_losses(straight)
    b = final_weights(run_dir)
    assert all((a[k] == b[k]).all() for k in a)


@pytest.mark.timeout(400)
def test_kill_9_during_background_write_keeps_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "killed"
    items = [
        f"logging.dir={tmp_path}",
        "logging.run_name=killed",
        "training.train_steps=400",
        "logging.log_interval=1",
        *ASYNC,
    ]
    env = hooked(NANOTRAIN_TEST_SLOW_WRITE="step_000010:120")
    proc = subprocess.Popen(
        cli(str(TINY), "--local", *sets(items)), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # Training goes on while step 10's files are being written (the writer sleeps).
        wait_until(lambda: step_of(run_dir) >= 12 or proc.poll() is not None, 300, "step 12")
        assert proc.poll() is None
        assert read_latest(run_dir / "checkpoints") == "step_000005"
        signal_rank(run_dir, 2, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "rank 2 exited with status 137" in out, out[-2000:]
    root = run_dir / "checkpoints"
    assert read_latest(root) == "step_000005" and verify_checkpoint(root / "step_000005") == []
    assert not (root / "step_000010").exists()


@pytest.mark.timeout(300)
def test_preemption_during_an_in_flight_save(tmp_path):
    run_dir = tmp_path / "preempted"
    items = [
        f"logging.dir={tmp_path}",
        "logging.run_name=preempted",
        "training.train_steps=400",
        "logging.log_interval=1",
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=2",
        *ASYNC,
    ]
    release = tmp_path / "release"  # step 5's background write waits for it (tests/hooks)
    env = hooked(NANOTRAIN_TEST_SLOW_WRITE=f"step_000005:until={release}")
    proc = subprocess.Popen(
        cli(str(TINY), "--local", *sets(items)), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_until(lambda: step_of(run_dir) >= 6 or proc.poll() is not None, 200, "step 6")
        assert not (run_dir / "checkpoints" / "step_000005").exists()  # still being written
        proc.send_signal(signal.SIGUSR2)  # what SLURM sends before a preemption
        release.touch()  # step 5's files may now be written: the stop waits for them, then saves its own
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    stopped = json.loads((run_dir / "progress.json").read_text())["step"]
    assert f"preempted at step {stopped}" in out, out[-2000:]
    root = run_dir / "checkpoints"
    assert read_latest(root) == f"step_{stopped:06d}"
    saved = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    # The in-flight step 5, then the stop, each committed once; the stop is agreed a step or more
    # after the signal, so an interval save (every 5) may fall between them, committed once too.
    assert saved == [f"step_{s:06d}" for s in range(5, stopped, 5)] + [f"step_{stopped:06d}"], saved
    assert out.count("preempted at step") == 1, out[-2000:]
    assert all(verify_checkpoint(root / name) == [] for name in saved)


@pytest.mark.timeout(120)
def test_background_save_holds_the_step_boundary_state(tmp_path):
    """The host copies are taken on the writer thread while the next step computes; the update
    may run once ``wait_snapshot()`` returned and does not reach the checkpoint. A second save
    reuses the kept host buffers and holds its own step's state."""
    import torch

    from nanotrain.checkpoint import begin_save, load_checkpoint
    from nanotrain.optim.optimizer import optimizer_state_by_name

    from helpers.checkpoints import tiny, tiny_step

    def state(objs):
        params = {n: p.detach().clone() for n, p in objs[0].named_parameters()}
        opt = {
            n: (s["exp_avg"].clone(), s["exp_avg_sq"].clone(), float(s["step"]))
            for n, s in optimizer_state_by_name(objs[1]).items()
        }
        return params, opt

    objs = tiny()
    root = tmp_path / "ck"
    saved = {}
    for step in (1, 2):
        tiny_step(objs, step - 1)
        saved[step] = state(objs)
        pending = begin_save(root, step, *objs, background=True)
        pending.wait_snapshot()
        tiny_step(objs, step)  # what the trainer's update does right after the wait
        changed = state(objs)
        pending.finish()
        assert any(not torch.equal(changed[0][n], saved[step][0][n]) for n in changed[0])
    for step in (1, 2):
        fresh = tiny(9)
        res = load_checkpoint(root, *fresh, path=root / f"step_{step:06d}")
        assert res.step == step
        got = state(fresh)
        for n, p in saved[step][0].items():
            assert torch.equal(got[0][n], p), (step, n)
        for n, (m, v, count) in saved[step][1].items():  # AdamW's step count is updated in place too
            assert torch.equal(got[1][n][0], m) and torch.equal(got[1][n][1], v) and got[1][n][2] == count, (step, n)
