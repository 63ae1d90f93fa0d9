"""`training.spike` (issue 31 item 2): poisoned steps — an injected non-finite gradient, a gradient
1000x too large (the test hook ``NANOTRAIN_TEST_SPIKE``, tests/hooks/sitecustomize.py) — under
`skip` apply no update, under `rewind` send the run back to its last checkpoint without the data
read since; the run finishes either way, and a preemption in between changes nothing.

References: for `skip`, a run without the poison whose AdamW is simply not called at the
recorded steps (the hook's ``noupdate``), at dp2 x pp2 with ZeRO-1 (the loss crosses the pipeline
before the update; the sharded update skips on both dp ranks before the all-gather); for
`rewind`, a run whose data leaves out exactly the recorded samples (the hook's ``drop``). The
runs compared with them are preempted between or after the spikes and resumed, so their equality
(bit for bit, losses and final weights) is also the bit-exact resume.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from nanotrain.commands.status import show_status

from helpers.runs import TINY, TOPOLOGIES, cli, final_weights, set_args, tb_losses

HOOKS = Path(__file__).resolve().parent / "hooks"
COMMON = ["logging.log_interval=1", "optimizer.warmup_steps=3", "training.spike.window=4"]
SKIP = [
    "training.train_steps=12",
    "checkpoints.interval=0",
    "parallelism.dp=2",
    "parallelism.tp=1",
    "parallelism.pp=2",
    "optimizer.zero_stage=1",
    "training.spike.policy=skip",
]
REWIND = ["training.train_steps=16", "checkpoints.interval=4", "training.spike.policy=rewind", *TOPOLOGIES["1-1-1"]]


def run(logs: Path, name: str, hook: str, settings: list[str], *args: str, code: int = 0) -> str:
    """``submit.py --local`` (or ``args``) with the test hook; returns its output."""
    env = dict(os.environ, NANOTRAIN_TEST_SPIKE=hook)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), env.get("PYTHONPATH", "")])
    items = [f"logging.dir={logs}", f"logging.run_name={name}", *COMMON, *settings]
    proc = subprocess.run(
        cli(*(args or (str(TINY), "--local", *set_args(items)))), capture_output=True, text=True, timeout=400, env=env
    )
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr + (logs / name / "job" / "rank-0.log").read_text()  # the rank's lines


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "spikes.jsonl").read_text().splitlines()]


def last_losses(run_dir: Path) -> dict[int, float]:
    """Each step's last logged loss: a rewound run logs the steps after its checkpoint twice."""
    return dict(tb_losses(run_dir))


def same_weights(a: Path, b: Path) -> bool:
    x, y = final_weights(a), final_weights(b)
    return x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x)


@pytest.mark.timeout(600)
def test_skip_equals_no_update_at_the_recorded_steps_across_a_preemption(tmp_path, capsys):
    logs = tmp_path / "logs"
    # Preempted between the two poisoned steps (the stop lands a step after the signal), resumed.
    out = run(logs, "skip", "poison=5:inf,9:1000;preempt=6", SKIP)
    assert "preempted at step 7" in out and "step 5: skipped (training.spike)" in out and "not finite" in out
    meta = json.loads((logs / "skip" / "checkpoints" / "step_000007" / "meta.json").read_text())
    assert [r["step"] for r in meta["extra"]["spike"]["log"]] == [5]
    out = run(logs, "skip", "poison=5:inf,9:1000", SKIP, "--resume", str(logs / "skip"), "--local")
    assert "step 9: skipped (training.spike)" in out and "above 6 x the median" in out, out[-3000:]
    found = records(logs / "skip")
    assert [r["step"] for r in found] == [5, 9], found
    assert math.isinf(found[0]["loss"]) and found[1]["grad_norm"] > 6 * found[1]["median_grad_norm"]

    # The reference: no poison, and no AdamW call at exactly the recorded steps.
    run(logs, "reference", "noupdate=5,9", SKIP)
    skipped, reference = last_losses(logs / "skip"), last_losses(logs / "reference")
    assert sorted(skipped) == list(range(1, 13))
    for step in (5, 9):
        del skipped[step], reference[step]
    assert skipped == reference
    assert same_weights(logs / "skip", logs / "reference")
    assert not records(logs / "reference")  # nothing spiked there

    capsys.readouterr()
    show_status(logs / "skip")
    assert f"skipped steps: 2 (5, 9; details in {logs / 'skip' / 'spikes.jsonl'})" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_rewind_equals_a_run_without_the_recorded_samples_across_a_preemption(tmp_path):
    logs = tmp_path / "logs"
    # 16 samples a step: step 10 reads from position 144. Checkpoints at 4 and 8; the spike is
    # seen a step late (at 11), the run goes back to 8 and reads on from 160; preempted at 12
    # (a saving step: it reads its own vote).
    out = run(logs, "rewind", "poisondata=144:inf;preempt=12", REWIND)
    assert "step 10: rewind 1/3 (training.spike.policy rewind) to the checkpoint of step 8" in out, out[-3000:]
    assert "samples 128..159 are left out" in out and "preempted at step 12" in out, out[-3000:]
    meta = json.loads((logs / "rewind" / "checkpoints" / "step_000012" / "meta.json").read_text())
    assert meta["extra"]["consumed_samples"] == 12 * 16 + 32 and len(meta["extra"]["spike"]["log"]) == 1
    run(logs, "rewind", "poisondata=144:inf", REWIND, "--resume", str(logs / "rewind"), "--local")
    (found,) = records(logs / "rewind")
    assert (found["rewind"], found["at_step"], found["to_step"], found["skipped_samples"]) == (1, 10, 8, [128, 160])
    assert math.isinf(found["loss"])

    run(logs, "reference", "poisondata=144:inf;drop=128-160", REWIND)
    rewound, reference = last_losses(logs / "rewind"), last_losses(logs / "reference")
    assert sorted(rewound) == list(range(1, 17)) and rewound == reference
    assert same_weights(logs / "rewind", logs / "reference")
    assert not records(logs / "reference")


def test_rewinds_are_bounded(tmp_path):
    settings = [*REWIND, "training.train_steps=8", "training.spike.max_rewinds=0"]
    out = run(tmp_path / "logs", "bounded", "poisondata=80:inf", settings, code=3)
    assert "error: training spiked at step 6 and cannot rewind: 0 rewinds (training.spike.max_rewinds) spent" in out
    assert "latest checkpoint step_000004 is untouched" in out, out[-3000:]


def test_the_guard_judges_against_the_median_of_applied_steps_only():
    """In-process (no launch): spikes are judged once the window is full, a skipped step stays
    out of the window, non-finite numbers are skipped from the first step; a saved window resumes
    at another `window` with its newest steps."""
    import torch

    from nanotrain.config.schema import SpikeArgs
    from nanotrain.training.spike import SpikeGuard

    guard = SpikeGuard(SpikeArgs(policy="skip", factor=6.0, window=2), "cpu", None, False)
    norm = torch.tensor(1.0)
    judged = [float(guard.judge(torch.tensor(v), norm)) for v in (100.0, math.inf, 1.0, 1.5, 9.0, 5.0, 1.25)]
    # the median of an even window is its lower middle value (torch.median): 1 of (1, 1.5), so
    # 9 > 6 x 1 spikes and 5 does not; then 1.25 against 1.5 of (1.5, 5)
    assert judged == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert guard.history.tolist() == [[5.0, 1.25], [1.0, 1.0]] == guard.state_dict()["history"]
    wider = SpikeGuard(SpikeArgs(policy="skip", window=3), "cpu", None, False, guard.state_dict())
    assert math.isnan(wider.history[0, 0]) and wider.history[:, 1:].tolist() == [[5.0, 1.25], [1.0, 1.0]]


def test_skipped_steps_in_a_row_are_bounded(tmp_path):
    """Three poisoned steps in a row with `max_consecutive_skips` 3: the run ends as a
    divergence does (exit 3) instead of training on without ever applying an update."""
    settings = [
        "training.train_steps=10",
        "checkpoints.interval=0",
        "training.spike.policy=skip",
        "training.spike.max_consecutive_skips=3",
        *TOPOLOGIES["1-1-1"],
    ]
    out = run(tmp_path / "logs", "in-a-row", "poison=3:inf,5:inf,6:inf,7:inf", settings, code=3)
    assert "step 3: skipped (training.spike)" in out and "step 7: skipped (training.spike)" in out, out[-3000:]
    assert "error: training spiked at step 7: 3 steps in a row skipped (training.spike.max_consecutive_skips)" in out, (
        out[-3000:]
    )
    assert [r["step"] for r in records(tmp_path / "logs" / "in-a-row")] == [3, 5, 6, 7]


def test_skips_in_a_row_are_counted_from_the_record():
    """The count a resumed run sees is the record's: consecutive step numbers back from the step,
    broken by an applied step or by a rewind (whose steps run once more)."""
    from nanotrain.config.schema import SpikeArgs
    from nanotrain.training.spike import SpikeGuard

    guard = SpikeGuard(SpikeArgs(policy="skip"), "cpu", None, False)
    counts = []
    for step in (2, 4, 5, 6):  # as the trainer asks: right after recording the step
        guard.record(step, [math.inf, 1.0, 1.0, 1.0])
        counts.append(guard.in_a_row(step))
    assert counts == [1, 1, 2, 3]
    guard.log.append({"rewind": 1, "at_step": 6, "to_step": 4})
    guard.record(5, [math.inf, 1.0, 1.0, 1.0])
    assert guard.in_a_row(5) == 1
