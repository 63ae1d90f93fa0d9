"""`submit.py --local` trains on the real corpus (Python's standard library sources): the loss
falls, and the same config at (1,1,1), at (dp2, tp2, pp2) and at (cp2, tp2, pp2) gives the same
loss sequence,
read back from the TensorBoard event files the runs wrote."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
STEPS = 15
COMMON = [f"training.train_steps={STEPS}", "logging.log_interval=1", "checkpoints.interval=0",
          "optimizer.warmup_steps=3"]


def train(tmp_path: Path, name: str, *overrides: str) -> list[float]:
    args = [sys.executable, str(ROOT / "submit.py"), str(TINY), "--local",
            "--set", f"logging.dir={tmp_path}", "--set", f"logging.run_name={name}"]
    for item in (*COMMON, *overrides):
        args += ["--set", item]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / name / "tb"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    return losses


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[float]:
    """(1,1,1) runs the whole global batch of (2,2,2) (dp2 x 4 micro-batches of 2) in one process."""
    return train(tmp_path_factory.mktemp("single"), "single", "parallelism.dp=1", "parallelism.tp=1",
                 "parallelism.pp=1", "training.batch_accumulation_per_replica=8")


@pytest.mark.timeout(900)
def test_same_loss_at_1_1_1_and_2_2_2_and_it_falls(tmp_path, single):
    parallel = train(tmp_path, "parallel")
    assert single[-1] < single[0] - 1.0, f"the loss did not fall: {single}"
    for step, (a, b) in enumerate(zip(single, parallel), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: 1 process {a} vs dp2 tp2 pp2 {b}"


@pytest.mark.timeout(900)
def test_context_parallel_run_has_the_same_losses(tmp_path, single):
    """cp2 x tp2 (sequence parallel) x pp2 with ZeRO-1 sharded over dp x cp: every sequence is
    split over two ranks, yet the run is the single process's, step for step."""
    cp = train(tmp_path, "cp", "parallelism.dp=1", "parallelism.cp=2", "parallelism.tp_mode=REDUCE_SCATTER",
               "optimizer.zero_stage=1", "training.batch_accumulation_per_replica=8")
    for step, (a, b) in enumerate(zip(single, cp), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: 1 process {a} vs cp2 tp2 pp2 {b}"
