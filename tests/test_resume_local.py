"""Preempt a local run with SIGUSR2 (what SLURM sends), resume it, and compare with a run that was
never interrupted: the loss sequence and the final weights are bit-identical (`==`) on CPU,
at (1,1,1), at (dp2, tp2, pp2) and at (cp2, tp2, pp2) with ZeRO-1."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
STEPS = 20
TOPOLOGIES = {
    "1-1-1": ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "training.batch_accumulation_per_replica=8"],
    "2-2-2": [],
    # context parallel, sequence-parallel tp, ZeRO-1 over dp x cp: the optimizer shards sit on cp ranks
    "cp2-tp2-pp2-zero1": ["parallelism.dp=1", "parallelism.cp=2", "parallelism.tp_mode=REDUCE_SCATTER",
                          "optimizer.zero_stage=1", "training.batch_accumulation_per_replica=8"],
}


def cli(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "submit.py"), *args]


def overrides(tmp_path: Path, name: str, topology: str) -> list[str]:
    items = [f"logging.dir={tmp_path}", f"logging.run_name={name}", f"training.train_steps={STEPS}",
             "logging.log_interval=1", "checkpoints.interval=0", *TOPOLOGIES[topology]]
    return [arg for item in items for arg in ("--set", item)]


def tb_losses(run_dir: Path) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def final_weights(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest")
    step_dir = latest.resolve() if latest.is_symlink() else run_dir / "checkpoints" / latest.read_text().strip()
    tensors = {}
    for path in sorted((step_dir / "model").rglob("*.safetensors")):
        for key, value in load_file(str(path)).items():
            tensors[f"{path.relative_to(step_dir)}:{key}"] = value
    return tensors


def preempt_when_past(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float) -> None:
    """Send SIGUSR2 to `submit.py --local` once the run has logged `step`."""
    deadline = time.monotonic() + timeout
    progress = run_dir / "progress.json"
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.is_file() and json.loads(progress.read_text())["step"] >= step:
            proc.send_signal(signal.SIGUSR2)
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"run never reached step {step} (exit {proc.poll()})")


def run_until_preempted(tmp_path: Path, name: str, topology: str) -> int:
    """A local run that gets SIGUSR2 past step 5: it saves and exits 0; returns the saved step."""
    run_dir = tmp_path / name
    proc = subprocess.Popen(cli(str(TINY), "--local", *overrides(tmp_path, name, topology)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        preempt_when_past(proc, run_dir, 5, timeout=300)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "preempted at step" in out and f"--resume {run_dir}" in out, out[-3000:]
    stopped = json.loads((run_dir / "progress.json").read_text())["step"]
    assert 5 <= stopped < STEPS
    return stopped


@pytest.mark.timeout(900)
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_preempt_and_resume_is_bit_exact(tmp_path, topology):
    straight = subprocess.run(cli(str(TINY), "--local", *overrides(tmp_path, "straight", topology)),
                              capture_output=True, text=True, timeout=400)
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-2000:]

    run_dir = tmp_path / "interrupted"
    stopped = run_until_preempted(tmp_path, "interrupted", topology)

    resumed = subprocess.run(cli("--resume", str(run_dir), "--local"), capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"at step {stopped} (same topology, bit-exact)" in resumed.stdout

    expected, got = tb_losses(tmp_path / "straight"), tb_losses(run_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert got == expected  # bit for bit, every step
    a, b = final_weights(tmp_path / "straight"), final_weights(run_dir)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
