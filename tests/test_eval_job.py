"""`checkpoints.eval_job` and `--evaluate` without a scheduler: `keep_last` keeps a checkpoint its
evaluation job has yet to read (and lets it go once read, or once the job is found gone without
reading it: recorded `skipped`), the fields' one-line errors, and `--evaluate`'s refusals. The
jobs themselves on the real SLURM cluster: tests/test_slurm_eval_job.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanotrain.checkpoint import save_checkpoint
from nanotrain.checkpoint.format import complete_checkpoints
from nanotrain.runtime import eval_record

from helpers.checkpoints import tiny
from helpers.cli import run_cli
from helpers.runs import TINY


def saved_steps(root) -> list[int]:
    return sorted(step for step, _ in complete_checkpoints(root))


def test_keep_last_keeps_a_checkpoint_until_its_eval_job_read_it(tmp_path):
    run_dir, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    model, opt, sched = tiny()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # an evaluation still running
    try:

        def protected(step: int) -> bool:
            return eval_record.protects(run_dir, step)

        def save(step: int) -> None:
            save_checkpoint(root, step, model, opt, sched, keep_last=1, run_id="r", protected=protected)

        save(1)
        eval_record.update_record(
            run_dir, 1, state="running", launcher="local", **{**eval_record.here(), "pid": alive.pid}
        )
        save(2)  # keep_last 1 would delete step 1: its evaluation has not read it
        assert saved_steps(root) == [1, 2]
        eval_record.update_record(
            run_dir, 2, state="running", launcher="local", **{**eval_record.here(), "pid": alive.pid}
        )
        eval_record.update_record(run_dir, 1, read=True)
        save(3)  # step 1 was read: pruned; step 2 not yet
        assert saved_steps(root) == [2, 3]
        alive.kill()
        alive.wait()
        save(4)  # step 2's evaluation ended without reading it: skipped, pruned
        assert saved_steps(root) == [4]
        assert eval_record.read_record(run_dir, 2)["state"] == "skipped"
        assert eval_record.read_record(run_dir, 1)["state"] == "running"  # read: nothing to skip
    finally:
        alive.kill()
        alive.wait()


def test_a_queued_job_slurm_no_longer_holds_is_skipped(tmp_path, monkeypatch):
    """A SLURM job is asked of squeue (all of the user's jobs); one squeue does not answer for
    keeps its checkpoint, one it does not list releases it."""
    from nanotrain.runtime import slurm_commands

    eval_record.update_record(tmp_path, 5, state="queued", launcher="slurm", job_id="4242")
    monkeypatch.setattr(slurm_commands, "answer", lambda argv: None)
    assert eval_record.protects(tmp_path, 5)
    monkeypatch.setattr(slurm_commands, "answer", lambda argv: "17\n4242\n")
    assert eval_record.protects(tmp_path, 5)
    monkeypatch.setattr(slurm_commands, "answer", lambda argv: "17\n")
    assert not eval_record.protects(tmp_path, 5)
    assert eval_record.read_record(tmp_path, 5)["state"] == "skipped"
    assert not eval_record.protects(tmp_path, 6)  # no evaluation job for that step: nothing to wait for


EVAL = "eval.sources=[{name: held, source: stdlib}]"
BAD = [
    (["--set", "eval.sources=[{source: stdlib}]"], "eval.sources[0].name: every evaluation source needs a name"),
    (["--set", "eval.sources=[{name: a/b, source: stdlib}]"], "eval.sources[0].name: 'a/b' must be letters"),
    (
        ["--set", "eval.sources=[{name: a, source: stdlib}, {name: a, source: stdlib}]"],
        "eval.sources[1].name: 'a' is used twice",
    ),
    (["--set", "eval.sources=[{name: a}]"], "eval.sources[0].source: missing"),
    (
        ["--set", "eval.sources=[{name: a, source: stdlib, batches: 0}]"],
        "eval.sources[0].batches: 0 is below the minimum 1",
    ),
    (["--set", "eval.sources=[{name: a, source: /nonexistent/x.txt}]"], "eval.sources[0].source: no such file"),
    (["--set", "eval.sources=[{name: a, source: stdlib, batchs: 2}]"], "eval.sources[0].batchs: unknown key"),
    (["--set", "eval.prompts=['']"], "eval.prompts[0]: an empty prompt"),
    (["--set", "eval.prompts=[x]", "--set", "eval.sample_tokens=0"], "eval.sample_tokens: 0 is below the minimum 1"),
    (
        ["--set", "eval.prompts=[x]", "--set", "eval.sample_tokens=300"],
        "eval.prompts[0]: 1 tokens + eval.sample_tokens 300",
    ),
    (["--set", "checkpoints.eval_job={enabled: true}"], "checkpoints.eval_job.enabled: eval.sources and eval.prompts"),
    (
        ["--set", EVAL, "--set", "checkpoints.eval_job={enabled: true, cpus: 0}"],
        "checkpoints.eval_job.cpus: 0 is below",
    ),
    (
        ["--set", EVAL, "--set", "checkpoints.eval_job={enabled: true, gpus: -1}"],
        "checkpoints.eval_job.gpus: -1 is below",
    ),
    (["--set", EVAL, "--set", "checkpoints.eval_job={enabled: true, time: 0}"], "checkpoints.eval_job.time"),
    (["--set", EVAL, "--set", "checkpoints.eval_job={enabled: true, mem_gb: 0}"], "checkpoints.eval_job.mem_gb"),
    (["--set", EVAL, "--set", "checkpoints.eval_job={enabled: maybe}"], "checkpoints.eval_job.enabled"),
    (
        ["--set", EVAL, "--set", "checkpoints.eval_job={enabled: true, partition: 'a b'}"],
        "checkpoints.eval_job.partition: 'a b' contains characters",
    ),
    (["--set", EVAL, "--set", "checkpoints.eval_job={enable: true}"], "checkpoints.eval_job.enable: unknown key"),
]


@pytest.mark.parametrize("extra,fragment", BAD, ids=[b[1].split(":")[0] + str(i) for i, b in enumerate(BAD)])
def test_every_eval_field_refuses_in_one_line(extra, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli([TINY, "--dry-run", *extra], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (out, err)
    assert fragment in lines[0], lines[0]
    assert not (tmp_path / "logs").exists()


def test_evaluate_refusals(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code, _, err = run_cli(["--evaluate", run_dir], capsys)
    assert code == 2 and "not a run directory (no config.yaml)" in err
    (run_dir / "config.yaml").write_text(TINY.read_text())
    code, _, err = run_cli(["--evaluate", run_dir], capsys)
    assert code == 2 and "has no eval.sources and no eval.prompts" in err, err
    code, _, err = run_cli(["--evaluate", run_dir, "--set", EVAL], capsys)
    assert code == 2 and "no complete checkpoint" in err, err
    code, _, err = run_cli(["--step", "3", str(TINY)], capsys)
    assert code == 2 and "--step" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(["--evaluate", run_dir, "--local"], capsys)
    assert code == 2 and "--evaluate" in err and "--local" in err, err


def test_the_child_gets_no_variable_of_the_training_job(monkeypatch):
    """An sbatch run inside an allocation would hand the evaluation job this job's layout."""
    from nanotrain.runtime.eval_jobs import child_env

    for name in ("SLURM_NTASKS", "SLURM_JOB_ID", "SBATCH_PARTITION", "RANK", "MASTER_ADDR", "SUBMITIT_FOLDER"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("KEPT_FOR_THE_JOB", "yes")
    env = child_env()
    assert env["KEPT_FOR_THE_JOB"] == "yes" and env["PATH"] == os.environ["PATH"]
    assert not [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SUBMITIT_")) or k in ("RANK", "MASTER_ADDR")]


def test_a_local_run_evaluates_each_async_checkpoint_beside_its_ranks(tmp_path):
    """`--local`: each committed checkpoint (here async saves, committed a step later or at the
    end) is evaluated by a process beside the ranks; the run returns once they are done, with
    `eval/held/loss` at both steps equal to the in-loop `val/loss` on the same corpus, even with
    keep_last 1 (the first checkpoint stays until its evaluation has read it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    held = tmp_path / "held.txt"
    held.write_text("".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))))
    items = [
        f"logging.dir={tmp_path}",
        "logging.run_name=loc",
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "training.train_steps=10",
        "checkpoints.interval=5",
        "checkpoints.keep_last=1",
        "checkpoints.async_save=true",
        "training.eval_interval=5",
        f"data.validation={{source: {held}}}",
        f"eval.sources=[{{name: held, source: {held}}}]",
        "eval.prompts=['def ']",
        "eval.sample_tokens=4",
        "checkpoints.eval_job.enabled=true",
    ]
    argv = [sys.executable, str(TINY.parents[1] / "submit.py"), str(TINY), "--local"]
    for item in items:
        argv += ["--set", item]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "loc"
    records = eval_record.read_records(run_dir)
    assert [(r["step"], r["state"], r["launcher"], r["read"]) for r in records] == [
        (5, "done", "local", True),
        (10, "done", "local", True),
    ], records
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    val = {e.step: e.value for e in events.Scalars("val/loss")}
    evals = {e.step: e.value for e in events.Scalars("eval/held/loss")}
    assert sorted(evals) == [5, 10] and all(evals[s] == pytest.approx(val[s], abs=1e-5) for s in evals), (evals, val)
    assert "eval job: evaluating step 5" in proc.stdout, proc.stdout[-3000:]


def test_eval_fields_built_in_code_meet_the_same_checks():
    import re

    from nanotrain.config import Config, ConfigError, validate
    from nanotrain.config.schema import EvalSourceArgs

    for mutate, fragment in [
        (
            lambda c: setattr(c.eval, "sources", [EvalSourceArgs("a", "stdlib", 0)]),
            "eval.sources[0].batches: 0 is below",
        ),
        (lambda c: setattr(c.checkpoints.eval_job, "cpus", 0), "checkpoints.eval_job.cpus: 0 is below the minimum 1"),
        (lambda c: setattr(c.eval, "sample_tokens", 5000), "eval.sample_tokens: 5000 is above the maximum 4096"),
    ]:
        config = Config()
        mutate(config)
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            validate(config)


def test_status_asks_the_scheduler_about_a_job_that_died_without_a_word(tmp_path, monkeypatch):
    """A job killed before it could record anything (a time limit, a node failure) still says
    `queued` in its record; `--status` shows what the scheduler knows."""
    from nanotrain.commands import status

    eval_record.update_record(tmp_path, 10, state="queued", launcher="slurm", job_id="77", read=False)
    results = {"held": {"loss": 3.25, "perplexity": 25.79}}
    eval_record.update_record(tmp_path, 20, state="done", launcher="slurm", job_id="78", read=True, results=results)
    monkeypatch.setattr(status, "slurm_job_info", lambda job: status.JobInfo(job, state="TIMEOUT", exit_code=0))
    assert status.eval_lines(tmp_path) == [
        "eval jobs: 2 (1 done, 1 queued)",
        "  step 10: job 77 queued, but the job is TIMEOUT (exit code 0)",
        "  step 20: job 78 done: held loss 3.2500 ppl 25.79",
    ]


def test_a_checkpoint_is_evaluated_once_and_again_only_when_saved_anew(tmp_path, monkeypatch):
    """A resumed run committing a step it already evaluated starts nothing; the same step saved
    again with other weights (its COMPLETE, meta.json's sha256, differs) is evaluated again."""
    from types import SimpleNamespace

    from nanotrain.runtime import eval_jobs

    started = []

    class Child:
        pid = os.getpid()

        def __init__(self, argv, **kwargs):
            started.append(argv)

        def poll(self):
            return 0

    monkeypatch.setattr(eval_jobs.subprocess, "Popen", Child)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step_000010").mkdir(parents=True)
    (checkpoints / "step_000010" / "COMPLETE").write_text("aaa\n")
    config = SimpleNamespace(checkpoints=SimpleNamespace(eval_job=SimpleNamespace(enabled=True), path=str(checkpoints)))
    jobs = eval_jobs.EvalJobs(config, tmp_path, "local", rank=0)
    jobs.committed(10)
    eval_record.update_record(tmp_path, 10, state="done", read=True, results={"held": {}})
    jobs.committed(10)
    assert len(started) == 1 and started[0][-3:] == [str(tmp_path), "10", "--local"]
    (checkpoints / "step_000010" / "COMPLETE").write_text("bbb\n")
    jobs.committed(10)
    record = eval_record.read_record(tmp_path, 10)
    assert len(started) == 2 and record["state"] == "submitting" and not record["read"] and "results" not in record
    assert eval_jobs.EvalJobs(config, tmp_path, "local", rank=1).enabled is False  # rank 0 only


def test_status_names_a_record_edited_by_hand_instead_of_failing(tmp_path):
    from nanotrain.commands import status

    eval_record.update_record(tmp_path, 10, state="done", results=["not", "a", "mapping"])
    eval_record.update_record(tmp_path, 20, state="failed", error="bad\x1b[31m line\nsecond")
    lines = status.eval_lines(tmp_path)
    assert lines[1] == f"  step 10: {eval_record.record_path(tmp_path, 10)} is unreadable", lines
    assert lines[2] == "  step 20: - failed: bad\\x1b[31m line; second", lines
