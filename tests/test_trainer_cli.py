"""`submit.py --local` trains on the real corpus (Python's standard library sources): the loss
falls, and the same config at (1,1,1), at (dp2, tp2, pp2) and at (cp2, tp2, pp2) gives the same
loss sequence,
read back from the TensorBoard event files the runs wrote. The runs are the session's shared ones
(``helpers.runs``), which the resume tests compare against too."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.runs import STEPS, tb_losses


def losses(run_dir: Path) -> list[float]:
    steps, values = zip(*tb_losses(run_dir))
    assert list(steps) == list(range(1, STEPS + 1))
    return list(values)


@pytest.fixture(scope="module")
def single(shared_runs) -> list[float]:
    """(1,1,1) runs the whole global batch of (2,2,2) (dp2 x 4 micro-batches of 2) in one process."""
    return losses(shared_runs.straight("1-1-1"))


@pytest.mark.timeout(900)
def test_same_loss_at_1_1_1_and_2_2_2_and_it_falls(single, shared_runs):
    parallel = losses(shared_runs.straight("2-2-2"))
    assert single[-1] < single[0] - 1.0, f"the loss did not fall: {single}"
    for step, (a, b) in enumerate(zip(single, parallel), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: 1 process {a} vs dp2 tp2 pp2 {b}"


@pytest.mark.timeout(900)
def test_context_parallel_run_has_the_same_losses(single, shared_runs):
    """cp2 x tp2 (sequence parallel) x pp2 with ZeRO-1 sharded over dp x cp: every sequence is
    split over two ranks, yet the run is the single process's, step for step."""
    cp = losses(shared_runs.straight("cp2-tp2-pp2-zero1"))
    for step, (a, b) in enumerate(zip(single, cp), start=1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: 1 process {a} vs cp2 tp2 pp2 {b}"
