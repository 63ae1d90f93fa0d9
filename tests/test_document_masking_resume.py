"""Document masking (issue 30) through the trainer: a local run at pp3 (the middle stage reads the
batch for its document ids) on a corpus of short documents (1 to ~80 bytes: every 64-token
window holds several boundaries), with ``data.document_masking`` and
``data.mask_boundary_loss``.

* Its first logged loss is the one-process masked loss of the same samples and weights (and not
  the unmasked one): the sampler's ids reach every stage through the prefetcher and the engine.
* Resumed from its step-3 checkpoint, it trains steps 4-6 bit for bit as the uninterrupted run
  (losses and final weights ``==``).
* Rehearsed (``--rehearse``, in this process) on a middle pipeline stage at cp rank 1 in bf16
  with selective recompute, the silent steps read nothing back: the document ids, positions and
  masks add no host sync to the step; nor does cp's balanced token order
  (``parallelism.cp_balance: documents``), computed by the sampler with the batch.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from helpers.runs import TINY, cli, final_weights, set_args, tb_losses

SETTINGS = [
    "training.train_steps=6",
    "logging.log_interval=1",
    "checkpoints.interval=3",
    "optimizer.warmup_steps=2",
    "parallelism.dp=1",
    "parallelism.tp=1",
    "parallelism.pp=3",
    "training.batch_accumulation_per_replica=4",
    "data.document_masking=true",
    "data.mask_boundary_loss=true",
]


def short_documents(path: Path) -> Path:
    """A JSON-lines corpus of 400 documents of 1 to 12 words."""
    words = "def return class import self lambda yield for while if else data token window mask".split()
    r = random.Random(0)
    texts = (" ".join(r.choice(words) for _ in range(r.randint(1, 12))) for _ in range(400))
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("docmask-run")
    items = [f"logging.dir={root / 'logs'}", "logging.run_name=straight", *SETTINGS]
    items.append(f"data.source={short_documents(root / 'docs.jsonl')}")
    proc = subprocess.run(cli(str(TINY), "--local", *set_args(items)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "logs" / "straight", items


def first_loss_in_one_process(run_dir: Path, masked: bool) -> float:
    """The step-1 loss of the run's config in this process: its sampler (the run's token cache) and
    its seeded initial weights, all micro-batches on one model."""
    from nanotrain.config import load_config
    from nanotrain.data import build_samplers
    from nanotrain.models.llama_parallelize import build_part
    from nanotrain.training.step import micro_loss

    config = load_config(str(run_dir / "config.yaml"))
    config.parallelism.pp = 1
    config.data.document_masking = masked
    sampler, _ = build_samplers(config)
    model = build_part(config)
    model.begin_step(config.training.batch_accumulation_per_replica)
    with torch.no_grad():
        micro = sampler.batch(0, 0)
        return float(sum(micro_loss(model, mb) for mb in micro) / len(micro))


@pytest.mark.timeout(300)
def test_first_step_is_the_one_process_masked_loss(straight):
    run_dir, _ = straight
    logged = tb_losses(run_dir)[0][1]  # float32
    masked, unmasked = (first_loss_in_one_process(run_dir, m) for m in (True, False))
    assert abs(logged - masked) <= 1e-5 * masked < abs(unmasked - masked)


@pytest.mark.timeout(300)
def test_resume_from_step_3_is_bit_exact(straight, tmp_path):
    run_dir, _ = straight
    copy = tmp_path / "resumed"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000006")
    (copy / "checkpoints" / "latest").write_text("step_000003\n")
    shutil.rmtree(copy / "tb")  # the resumed process's losses only

    proc = subprocess.run(cli("--resume", str(copy), "--local"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "at step 3 (same topology)" in proc.stdout
    assert tb_losses(copy) == tb_losses(run_dir)[3:]  # steps 4-6, bit for bit
    a, b = final_weights(run_dir), final_weights(copy)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.parametrize("balance", ["zigzag", "documents"])
def test_rehearsed_masked_step_holds_no_host_sync(tmp_path, balance):
    from nanotrain.config import load_config
    from nanotrain.rehearse import report as rehearsal
    from nanotrain.rehearse.rank import rehearse_rank

    sets = ["parallelism.dp=1", "parallelism.tp=1", "parallelism.cp=2", "parallelism.pp=4"]
    sets += [f"logging.dir={tmp_path}", "model.dtype=bfloat16", "training.recompute=selective"]
    config = load_config(TINY, [*sets, "data.document_masking=true", f"parallelism.cp_balance={balance}"])
    report = rehearse_rank(config, 3, 3)
    assert report["coords"] == {"ep": 0, "pp": 1, "dp": 0, "cp": 1, "tp": 0}
    assert rehearsal.defects(report) == [] and report["silent"]
    assert all(not rows for w, rows in report["syncs"].items() if w in report["silent"])
