"""Evaluation and mixtures in real `submit.py --local` runs of the tiny config.

The eval runs use the shared runs' settings and training data plus a validation corpus of its own
(`data.validation.source`), so the training stream is that of `shared_runs.straight(...)`: a run
with evaluation on must give the identical `train/loss` sequence, and `val/loss` must agree at
(1,1,1), (2,2,2) and (cp2, tp2 under sequence parallelism, pp2, ZeRO-1) to rel 1e-5. One more run
trains on a 0.6/0.3/0.1 mixture and reports `data/tokens/*` in those shares.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers.runs import ROOT, STEPS, TINY, cli, overrides, set_args, tb_losses

EVAL_INTERVAL = 5
WEIGHTS = {"web": 0.6, "code": 0.3, "books": 0.1}


def scalars(run_dir, tag) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def run(logs, name, topology, extra) -> tuple:
    args = overrides(logs, name, topology) + set_args(extra)
    proc = subprocess.run(cli(str(TINY), "--local", *args), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return logs / name, proc.stdout


class EvalRuns:
    """The eval-on runs, each made on first use (a test's timeout then covers its own runs)."""

    def __init__(self, root):
        self.root, self.done = root, {}
        val = root / "val.jsonl"
        lines = (ROOT / "README.md").read_text().splitlines()
        with open(val, "w") as fh:
            for i in range(0, len(lines), 20):
                fh.write(json.dumps({"text": "\n".join(lines[i : i + 20])}) + "\n")
        self.extra = [
            f"data.validation={{source: {val}}}",
            f"training.eval_interval={EVAL_INTERVAL}",
            "training.eval_batches=2",
        ]

    def __getitem__(self, topo):
        if topo not in self.done:
            self.done[topo] = run(self.root, f"eval-{topo}", topo, self.extra)
        return self.done[topo]


@pytest.fixture(scope="module")
def eval_runs(tmp_path_factory):
    return EvalRuns(tmp_path_factory.mktemp("eval"))


@pytest.mark.timeout(600)
def test_eval_leaves_training_unchanged(eval_runs, shared_runs):
    run_dir, out = eval_runs["2-2-2"]
    assert tb_losses(run_dir) == tb_losses(shared_runs.straight("2-2-2"))
    assert scalars(run_dir, "data/tokens/default")[-1] == (STEPS, STEPS * 16 * 64)  # the shorthand's name
    steps = [s for s, _ in scalars(run_dir, "val/loss")]
    assert steps == list(range(EVAL_INTERVAL, STEPS + 1, EVAL_INTERVAL))
    assert f"step {STEPS}/{STEPS} | val/loss" in out
    (_, loss), (_, ppl) = scalars(run_dir, "val/loss")[-1], scalars(run_dir, "val/ppl")[-1]
    assert ppl == pytest.approx(2.718281828**loss, rel=1e-5)


@pytest.mark.timeout(900)
def test_val_loss_equal_across_topologies(eval_runs):
    want = scalars(eval_runs["2-2-2"][0], "val/loss")
    for topo in ("1-1-1", "cp2-tp2-pp2-zero1"):
        got = scalars(eval_runs[topo][0], "val/loss")
        assert [s for s, _ in got] == [s for s, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert a == pytest.approx(b, rel=1e-5), topo


def test_mixture_run_reports_token_shares(tmp_path):
    paths = {}
    for name, docs in {"web": 300, "code": 150, "books": 4}.items():
        paths[name] = tmp_path / f"{name}.jsonl"
        with open(paths[name], "w") as fh:
            for d in range(docs):
                fh.write(json.dumps({"text": f"{name} document {d} " * 8}) + "\n")
    sources = ", ".join(f"{{name: {n}, source: {paths[n]}, weight: {w}}}" for n, w in WEIGHTS.items())
    run_dir, out = run(tmp_path / "logs", "mix", "1-1-1", [f"data.sources=[{sources}]"])
    final = {n: scalars(run_dir, f"data/tokens/{n}")[-1] for n in WEIGHTS}
    total = sum(v for _, v in final.values())
    assert total == STEPS * 16 * 64  # every target token of every step, once
    for name, w in WEIGHTS.items():
        assert final[name][0] == STEPS
        assert abs(final[name][1] / total - w) < 0.01, (name, final[name][1] / total)
    # books (4 documents: 9 windows) runs out and reshuffles; each new epoch is said once
    epochs = scalars(run_dir, "data/epoch/books")[-1][1]
    assert epochs > 2
    notices = [ln for ln in out.splitlines() if ln.startswith("data: source 'books'")]
    assert len(notices) == int(epochs) and "epoch 2 reads them in a new shuffled order" in notices[0]
