"""Traces on demand and stragglers (issue 16, items 3-4): `training.profile: {start_step,
num_steps}` writes one torch.profiler trace per rank holding exactly the asked steps; every
log step the metrics rank logs `perf/step_time_max_over_median` (one all-gather of busy step
times; that it sees a slowed rank: test_stragglers.py);
a bad `training.profile` is one `error:` line and exit 2, before anything starts."""

from __future__ import annotations

import json
import subprocess

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers.runs import TINY, cli, set_args

LAYOUT = [
    "parallelism.dp=2",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "training.train_steps=6",
    "logging.log_interval=2",
    "checkpoints.interval=0",
]


def sets(items):
    return set_args(items)


@pytest.mark.timeout(300)
def test_profile_files_hold_the_asked_steps_only_and_stragglers_are_logged(tmp_path):
    run_dir = tmp_path / "profiled"
    items = [
        f"logging.dir={tmp_path}",
        "logging.run_name=profiled",
        *LAYOUT,
        "training.profile={start_step: 3, num_steps: 2}",
    ]
    proc = subprocess.run(cli(str(TINY), "--local", *sets(items)), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = sorted(p.name for p in (run_dir / "profile").iterdir())
    assert files == ["rank-0.steps-3-4.pt.trace.json", "rank-1.steps-3-4.pt.trace.json"], files
    trace = json.loads((run_dir / "profile" / files[0]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"ProfilerStep#3", "ProfilerStep#4"} <= names
    assert not {"ProfilerStep#2", "ProfilerStep#5"} & names
    assert "[memory]" in names  # memory events (profile_memory)
    assert any(str(n).startswith("aten::") for n in names)  # CPU operator activity

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    ratios = events.Scalars("perf/step_time_max_over_median")
    assert [e.step for e in ratios] == [2, 4, 6] and all(e.value >= 1.0 for e in ratios)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("training.profile={start: 3, num_steps: 2}", "training.profile.start: unknown key"),
        ("training.profile={num_steps: 2}", "training.profile.start_step: missing"),
        ("training.profile={start_step: 0, num_steps: 2}", "training.profile.start_step: 0 must be >= 1"),
        ("training.profile={start_step: 500, num_steps: 2}", "training.profile.start_step: 500 is after the last step"),
    ],
)
def test_bad_profile_setting_is_one_error_line(tmp_path, setting, message):
    proc = subprocess.run(
        cli(str(TINY), "--dry-run", *sets([f"logging.dir={tmp_path}", setting])),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {message}"), proc.stderr
