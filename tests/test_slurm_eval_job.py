"""The evaluation job per checkpoint on the real local SLURM cluster: a one-rank run of the tiny
config saves two checkpoints with `checkpoints.eval_job` on; each gets a job of its own that
writes `eval/held/loss` and the samples into the run's TensorBoard at its step, equal to the
in-loop `val/loss` (`data.validation.source` is the same corpus) and to `submit.py --evaluate`
run by hand on the same checkpoint. A second evaluation source is deleted right after the
submission (a corpus moved away while the run queued): both evaluation jobs fail on it after
writing `held`, `--status` shows them failed with that source's line, and training completes.
Protection by `checkpoints.keep_last` and the fields' errors: tests/test_eval_job.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nanotrain.runtime import eval_record

from helpers.slurm import cancel, submitted_job_id, wait_for_job, wait_until

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
pytestmark = [pytest.mark.slurm]


def corpus() -> str:
    """Some Python source (the json package's): plain text of a few thousand tokens."""
    return "".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py")))


def tb_scalars(run_dir: Path, tag: str) -> dict[int, list[float]]:
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    out: dict[int, list[float]] = {}
    for e in events.Scalars(tag):
        out.setdefault(e.step, []).append(e.value)
    return out


@pytest.mark.timeout(300)
def test_eval_jobs_write_both_checkpoints_and_a_failed_one_shows_in_status(slurm_cluster, tmp_path):
    held, gone = tmp_path / "held.txt", tmp_path / "gone.txt"
    held.write_text(corpus())
    gone.write_text(corpus())
    items = [
        f"logging.dir={tmp_path}",
        "logging.run_name=ev",
        "parallelism.dp=1",
        "parallelism.tp=1",
        "parallelism.pp=1",
        "slurm.tasks_per_node=1",
        "training.train_steps=20",
        "checkpoints.interval=10",
        "training.eval_interval=10",
        f"data.validation={{source: {held}}}",
        f"eval.sources=[{{name: held, source: {held}}}, {{name: gone, source: {gone}}}]",
        "eval.prompts=['def ']",
        "eval.sample_tokens=8",
        "checkpoints.eval_job={enabled: true, cpus: 1, time: 5}",
    ]
    argv = [sys.executable, str(ROOT / "submit.py"), str(TINY)]
    for item in items:
        argv += ["--set", item]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gone.unlink()  # checked at submission; gone before any evaluation job reads it
    job_id, run_dir = submitted_job_id(proc.stdout), tmp_path / "ev"
    try:
        assert wait_for_job(job_id, 180) == "COMPLETED"  # the failed evaluations never touched it

        def both_finished():
            records = eval_record.read_records(run_dir)
            done = [r for r in records if r.get("state") in eval_record.FINISHED]
            return records if len(done) == 2 else None

        records = wait_until(both_finished, 180, "both evaluation jobs to finish", job_id)
    finally:
        cancel(job_id)
        for record in eval_record.read_records(run_dir):
            cancel(record.get("job_id"))
    assert [r["step"] for r in records] == [10, 20]
    for r in records:
        assert r["state"] == "failed" and r["read"] and r["job_id"] != job_id, r
        assert r["error"].startswith("gone: eval.sources[1].source: no such file"), r["error"]
        assert set(r["results"]) == {"held"}, r

    losses, in_loop = tb_scalars(run_dir, "eval/held/loss"), tb_scalars(run_dir, "val/loss")
    assert sorted(losses) == [10, 20] and sorted(tb_scalars(run_dir, "eval/held/perplexity")) == [10, 20]
    for step in (10, 20):
        (job_loss,) = losses[step]
        assert job_loss == pytest.approx(in_loop[step][0], abs=1e-5), (step, job_loss, in_loop[step])
        assert job_loss == pytest.approx(records[step // 10 - 1]["results"]["held"]["loss"], rel=1e-6)
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    # Each job writes its own event file, read in file-name (creation) order: the two jobs run at
    # once, so step 20's file may come first. TensorBoard shows the events by step.
    assert sorted(e.step for e in events.Tensors("eval/samples/text_summary")) == [10, 20]

    status = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), "--status", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    assert "state: COMPLETED" in status.stdout and "eval jobs: 2 (2 failed)" in status.stdout, status.stdout
    for r in records:
        line = f"  step {r['step']}: job {r['job_id']} failed: held loss "
        assert line in status.stdout and "eval.sources[1].source: no such file" in status.stdout, status.stdout

    gone.write_text(corpus())  # back: by hand, both sources evaluate (the two steps at once)
    by_hand = {
        step: subprocess.Popen(
            [sys.executable, str(ROOT / "submit.py"), "--evaluate", str(run_dir), "--step", str(step)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for step in (10, 20)
    }
    for step, child in by_hand.items():
        try:
            out, err = child.communicate(timeout=120)
        finally:
            child.kill()
        assert child.returncode == 0, out + err
        rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:4] in ("held", "gone")}
        assert rows["held"][4] == rows["gone"][4], out  # one corpus under two names
        assert float(rows["held"][4]) == pytest.approx(losses[step][0], abs=1e-4), out
    after = tb_scalars(run_dir, "eval/held/loss")
    for step in (10, 20):
        assert len(after[step]) == 2, after  # the job's and the one by hand, at the checkpoint's step
        assert after[step][1] == pytest.approx(after[step][0], rel=1e-6), after
