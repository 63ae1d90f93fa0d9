"""Values that `--dry-run` used to accept but that make every rank fail or silently do the wrong
thing: each is now one `error:` line naming the field and the fix, exit 2, before anything runs.
Edge values that are legitimate (the smallest accepted AdamW epsilon, betas at their bounds, an
RMSNorm epsilon of 0, a wsd schedule that decays over the whole run, a warm-up longer than the
run) train without NaN."""

from __future__ import annotations

import math

import pytest
import torch

from nanotrain.config import ModelArgs, OptimizerArgs
from nanotrain.config.schema import FLOAT32_TINY
from nanotrain.optim.schedule import lr_at

from helpers.cli import run_cli
from helpers.dist import run_distributed
from helpers.runs import TINY

# (id, --set items, words the one error line must hold: the field, and the fix or the reason)
REFUSED = [
    ("eps-zero", ["optimizer.eps=0"], ["optimizer.eps", "NaN", "1e-8"]),
    ("eps-below-float32", ["optimizer.eps=1e-300"], ["optimizer.eps", "minimum"]),
    ("clip-zero", ["optimizer.clip_grad=0"], ["optimizer.clip_grad", "null to disable"]),
    ("decay-flips-weights", ["optimizer.weight_decay=1000"], ["optimizer.weight_decay", "below 1"]),
    ("decay-overflows", ["optimizer.weight_decay=1e308"], ["optimizer.weight_decay", "below 1"]),
    ("init-std-zero", ["model.init_std=0"], ["model.init_std", "never learn"]),
    ("timeout-overflow", ["training.collective_timeout_s=1e300"], ["training.collective_timeout_s", "lower it"]),
    (
        "stdlib-too-small",
        ["model.max_position_embeddings=1048576", "training.sequence_length=1048576", "training.micro_batch_size=16"],
        ["too little data for one global batch", "'stdlib'"],
    ),
    (
        "weights-overflow",
        ["data.sources=[{name: a, source: stdlib, weight: 1.0e308}, {name: b, source: stdlib, weight: 1.0e308}]"],
        ["data.sources", "scale them down"],
    ),
    (
        "weight-never-read",
        ["data.sources=[{name: a, source: stdlib, weight: 1.0}, {name: b, source: stdlib, weight: 1.0e-6}]"],
        ["data.sources[1].weight", "never be read"],
    ),
    (
        "eval-beyond-fraction",
        ["training.eval_interval=10", "data.validation={fraction: 0.001}", "training.eval_batches=100"],
        ["training.eval_batches", "read windows twice"],
    ),
]


def _dry_run(capsys, items, *extra):
    args = [TINY, "--dry-run", *extra]
    for item in items:
        args += ["--set", item]
    return run_cli(args, capsys)


def _assert_one_error_line(code, out, err, words):
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("items,words", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_value_that_fails_in_the_ranks_is_refused_in_one_line(items, words, capsys):
    _assert_one_error_line(*_dry_run(capsys, items, "--local"), words)


def test_slurm_signal_before_the_job_starts_is_refused(capsys):
    """slurm.signal_delay_s at least slurm.time: the job is signalled to save as it starts."""
    _assert_one_error_line(
        *_dry_run(capsys, ["slurm.time=30", "slurm.signal_delay_s=1800"]), ["slurm.signal_delay_s", "slurm.time"]
    )
    code, _, err = _dry_run(capsys, ["slurm.time=30", "slurm.signal_delay_s=1799"])
    assert code == 0, err


def test_eval_beyond_a_small_validation_source_is_refused(capsys, tmp_path):
    """A validation corpus of ~10 windows cannot give 16 samples without reading some twice."""
    small = tmp_path / "val.txt"
    small.write_text("x" * 64 * 10 + "\n")
    _assert_one_error_line(
        *_dry_run(capsys, ["training.eval_interval=10", f"data.validation={{source: {small}}}"], "--local"),
        ["training.eval_batches", str(small), "read windows twice"],
    )


def test_warmup_longer_than_the_run_is_a_finite_ramp():
    """warmup_steps > train_steps is accepted (a smoke run shorter than its warm-up): the lr rises
    linearly over the whole run, positive and below the peak, never 0/0."""
    args = OptimizerArgs(lr=3e-3, warmup_steps=100, min_lr=0.0)
    lrs = [lr_at(s, args, 5) for s in range(5)]
    assert lrs == [3e-3 * (s + 1) / 100 for s in range(5)]


EDGE = dict(
    model=dict(rms_norm_eps=0.0),
    optim=dict(
        lr=3e-3,
        eps=FLOAT32_TINY,
        betas=(0.0, 0.99999999),
        weight_decay=0.1,
        clip_grad=1.0,
        lr_decay_style="wsd",
        decay_fraction=1.0,
        warmup_steps=0,
        min_lr=0.0,
    ),
)
STEPS, SEQ, BATCH = 4, 16, 4


def train_edges() -> dict:
    """A 1-rank run of a tiny Llama at the edge values of EDGE; its losses and weights."""
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer, optimizer_groups
    from nanotrain.parallel.data_parallel import build_grad_sync
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.training.step import train_step

    pc = ParallelContext(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1)
    args = ModelArgs(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        dtype="float32",
        **EDGE["model"],
    )
    optim = OptimizerArgs(**EDGE["optim"])
    model = build_llama(args, pc.tp_pg, seed=0, compute_dtype="float32")
    sync = build_grad_sync(list(model.parameters()), pc)
    optimizer = build_optimizer(model.named_parameters(), optim, **optimizer_groups(pc))
    scheduler = build_lr_scheduler(optimizer, optim, STEPS)
    losses = []
    for step in range(STEPS):
        # 16 distinct tokens of 256: most embedding rows get a zero gradient, AdamW's 0/(0+eps) case
        ids = torch.randint(0, 16, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        losses.append(
            float(train_step(model, [(ids[:, :-1], ids[:, 1:])], sync, optimizer, scheduler, pc, optim.clip_grad).loss)
        )
    weights = {n: bool(torch.isfinite(p).all()) for n, p in model.named_parameters()}
    pc.destroy()
    return {"losses": losses, "finite": weights}


def test_legitimate_edge_values_train_without_nan():
    result = run_distributed(train_edges, 1, timeout=60)[0]
    assert all(math.isfinite(x) for x in result["losses"]), result["losses"]
    assert all(result["finite"].values()), [n for n, ok in result["finite"].items() if not ok]
    assert result["losses"][-1] < result["losses"][0], result["losses"]
