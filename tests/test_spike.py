"""`training.spike.policy: skip` (issue 31 item 2): a poisoned step — an injected non-finite
gradient, then a gradient 1000x too large (the test hook ``NANOTRAIN_TEST_SPIKE``,
tests/hooks/sitecustomize.py) — applies no update, is recorded, and the run finishes.

The reference is a run without the poison whose AdamW is simply not called at the recorded steps
(the hook's ``noupdate``): every other step's loss and the final weights must be equal bit for
bit, so a skipped step left no trace (weights, moments, step count, the median window). The
layout is dp2 x pp2 with ZeRO-1: the loss crosses the pipeline before the update and the sharded
update skips on both dp ranks before the all-gather. A run preempted between the two poisoned
steps and resumed equals the uninterrupted one bit for bit, its record included.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from helpers.runs import TINY, cli, final_weights, set_args, tb_losses

HOOKS = Path(__file__).resolve().parent / "hooks"
STEPS = 12
POISON = "poison=5:inf,9:1000"
SETTINGS = [
    f"training.train_steps={STEPS}",
    "logging.log_interval=1",
    "checkpoints.interval=0",
    "optimizer.warmup_steps=3",
    "parallelism.dp=2",
    "parallelism.tp=1",
    "parallelism.pp=2",
    "optimizer.zero_stage=1",
    "training.spike.policy=skip",
    "training.spike.window=4",
]


def run(logs: Path, name: str, hook: str, *args: str) -> str:
    """``submit.py --local`` with the test hook; returns its output (exit 0 asserted)."""
    env = dict(os.environ, NANOTRAIN_TEST_SPIKE=hook)
    env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), env.get("PYTHONPATH", "")])
    argv = args or (str(TINY), "--local", *set_args([f"logging.dir={logs}", f"logging.run_name={name}", *SETTINGS]))
    proc = subprocess.run(cli(*argv), capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def same(a: list, b: list) -> bool:
    """Equal bit for bit, an infinite loss included."""
    return [(s, repr(v)) for s, v in a] == [(s, repr(v)) for s, v in b]


@pytest.mark.timeout(600)
def test_skip_equals_no_update_at_the_recorded_steps_and_resumes_bit_exact(tmp_path):
    logs = tmp_path / "logs"
    out = run(logs, "skip", POISON)
    records = [json.loads(line) for line in (logs / "skip" / "spikes.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 9], records
    assert math.isinf(records[0]["loss"]) and records[1]["grad_norm"] > 6 * records[1]["median_grad_norm"]
    assert "step 5: skipped" in out and "not finite" in out and "step 9: skipped" in out, out[-3000:]

    # The reference: no poison, and no AdamW call at exactly the recorded steps.
    run(logs, "reference", "noupdate=" + ",".join(str(r["step"]) for r in records))
    skipped, reference = tb_losses(logs / "skip"), tb_losses(logs / "reference")
    assert [s for s, _ in skipped] == list(range(1, STEPS + 1))
    kept = {r["step"] for r in records}
    assert same([x for x in skipped if x[0] not in kept], [x for x in reference if x[0] not in kept])
    a, b = final_weights(logs / "skip"), final_weights(logs / "reference")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert not (logs / "reference" / "spikes.jsonl").read_text()  # nothing spiked there

    # Preempted between the two poisoned steps (the stop lands a step after the signal), resumed.
    out = run(logs, "preempted", POISON + ";preempt=6")
    assert "preempted at step 7" in out, out[-3000:]
    meta = json.loads((logs / "preempted" / "checkpoints" / "step_000007" / "meta.json").read_text())
    assert [r["step"] for r in meta["extra"]["spike"]["skipped"]] == [5]
    run(logs, "preempted", POISON, "--resume", str(logs / "preempted"), "--local")
    assert same(tb_losses(logs / "preempted"), skipped)
    c = final_weights(logs / "preempted")
    assert c.keys() == a.keys() and all((a[k] == c[k]).all() for k in a)
    assert (logs / "preempted" / "spikes.jsonl").read_text() == (logs / "skip" / "spikes.jsonl").read_text()
