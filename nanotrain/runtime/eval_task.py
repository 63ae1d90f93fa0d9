"""What an evaluation of one checkpoint does, in whichever process runs it: the SLURM job that
``checkpoints.eval_job`` submits (``EvalTask``, pickled by submitit), the process a local run
starts beside its ranks, and ``submit.py --evaluate`` by hand.

It loads the checkpoint at whatever topology it was saved into the plain model (one process, CPU
or one GPU: ``checkpoint/plain_model.py``), computes each ``eval.sources`` entry's loss and
perplexity (``training/checkpoint_eval.py``), continues ``eval.prompts`` greedily, prints one row
per source and writes ``eval/<name>/loss``, ``eval/<name>/perplexity`` and the text
``eval/samples`` into the run's TensorBoard at the checkpoint's step, in an event file of its
own beside the training's. A source that fails does not stop the others: their numbers are
written, then the evaluation fails naming the first failed source (``EvalFailed``).

The job's record (``eval_record.py``) says ``read`` as soon as the weights are in memory: from
then on ``checkpoints.keep_last`` may delete the checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, TextIO

from nanotrain.checkpoint.offline_checks import plan_generate
from nanotrain.config import Config, load_config
from nanotrain.data.check import as_entry, eval_source_args
from nanotrain.runtime import eval_record
from nanotrain.runtime.rundir import CONFIG_FILE

TB_DIR = "tb"  # the training's event files' folder (logging.metrics.TB_DIR)


class EvalFailed(Exception):
    """An evaluation source (or the samples) failed; the others were written (``report``). One line."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


def run_config(run_dir: Path, overrides: list[str] = ()) -> Config:
    """The run's own config (``<run>/config.yaml``), with ``--set`` overrides."""
    return load_config(Path(run_dir) / CONFIG_FILE, overrides)


def _device(gpus: int) -> str:
    import torch

    return "cuda" if gpus and torch.cuda.is_available() else "cpu"


def evaluate_checkpoint(
    run_dir: Path,
    step: Optional[int],
    config: Config,
    out: TextIO | None = None,
    on_read: Callable[[], None] | None = None,
    device: str = "cpu",
) -> dict:
    """Evaluate the checkpoint of ``step`` (None: the latest complete one) of ``run_dir`` with
    ``config``'s ``eval`` section; print the rows to ``out``; write TensorBoard (unless
    ``logging.tensorboard`` is off). ``on_read()`` is called once the weights are loaded.
    Returns {"step", "checkpoint", "results": {name: {...}}, "samples": [...], "errors": [...]};
    raises EvalFailed after writing what worked when a source or the samples failed, and
    CheckpointError / DataError before anything is computed."""
    import torch

    from nanotrain.checkpoint.plain_model import load_plain_model
    from nanotrain.data.hf_tokenizer import special_token_ids
    from nanotrain.data.tokenizer import load_tokenizer
    from nanotrain.training.checkpoint_eval import evaluate_source, greedy_samples, samples_markdown

    out = out or sys.stdout
    ckpt, meta = plan_generate(run_dir, step)
    step = int(meta["step"])
    started = time.perf_counter()
    model = load_plain_model(ckpt, meta, torch.float32, device)
    if on_read is not None:
        on_read()
    print(f"evaluating {ckpt} (step {step}) on {device}: loaded in {time.perf_counter() - started:.2f} s", file=out)
    results, errors, samples = {}, [], []
    if config.eval.sources:
        print(f"{'source':<16} {'batches':>7} {'windows':>8} {'tokens':>10} {'loss':>8} {'perplexity':>11}", file=out)
    for (where, args), entry in zip(eval_source_args(config), config.eval.sources):
        try:
            r = evaluate_source(model, config, where, entry.name, args, entry.batches)
        except (ValueError, OSError, FloatingPointError) as exc:  # DataError is a ValueError
            errors.append(f"{entry.name}: {as_entry(str(exc), where)}")
            print(f"{entry.name:<16} failed: {as_entry(str(exc), where)}", file=out, flush=True)
            continue
        results[entry.name] = asdict(r)
        print(
            f"{r.name:<16} {entry.batches:>7} {r.windows:>8} {r.tokens:>10,} {r.loss:>8.4f} {r.perplexity:>11.2f}",
            file=out,
            flush=True,
        )
    if config.eval.prompts:
        try:
            tok = load_tokenizer(config.data.tokenizer, config.model.vocab_size)
            eos = special_token_ids(config.data.tokenizer, tok)["eos_token_id"]
            samples = greedy_samples(model, tok, config.eval.prompts, config.eval.sample_tokens, eos)
        except (ValueError, OSError, FloatingPointError) as exc:
            errors.append(f"eval.prompts: {exc}")
        for i, (prompt, text) in enumerate(samples):
            print(f"sample {i}: {prompt!r} -> {text!r}", file=out, flush=True)
    if config.logging.tensorboard:
        write_tensorboard(Path(run_dir), step, results, samples_markdown(samples) if samples else None)
    report = {"step": step, "checkpoint": str(ckpt), "results": results, "samples": samples, "errors": errors}
    if errors:
        raise EvalFailed(errors[0] + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""), report)
    return report


def write_tensorboard(run_dir: Path, step: int, results: dict, samples: Optional[str]) -> None:
    """``eval/<name>/loss``, ``eval/<name>/perplexity`` and ``eval/samples`` at ``step``, in an
    event file of this process's own in the run's TensorBoard folder (TensorBoard reads every
    file of the folder as one run; the training's writer keeps its own file)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir / TB_DIR), filename_suffix=f".eval-step{step}")
    try:
        for name, r in results.items():
            writer.add_scalar(f"eval/{name}/loss", r["loss"], global_step=step)
            writer.add_scalar(f"eval/{name}/perplexity", r["perplexity"], global_step=step)
        if samples is not None:
            writer.add_text("eval/samples", samples, global_step=step)
        writer.flush()
    finally:
        writer.close()


def run_recorded(run_dir: str | Path, step: int, launcher: str) -> dict:
    """One evaluation job's whole life for its record: ``running`` (with this process's host,
    pid and SLURM job id), ``read``, then ``done`` with the results or ``failed`` with the error
    line, which is raised again so that the job itself fails."""
    run_dir = Path(run_dir)
    job_id = os.environ.get("SLURM_JOB_ID")
    fields = {"job_id": job_id} if job_id else {}
    eval_record.update_record(run_dir, step, state="running", launcher=launcher, **eval_record.here(), **fields)
    try:
        config = run_config(run_dir)
        report = evaluate_checkpoint(
            run_dir,
            step,
            config,
            on_read=lambda: eval_record.update_record(run_dir, step, read=True),
            device=_device(config.checkpoints.eval_job.gpus),
        )
    except Exception as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        results = exc.report["results"] if isinstance(exc, EvalFailed) else {}
        eval_record.update_record(run_dir, step, state="failed", error=message[:2000], results=results)
        raise
    eval_record.update_record(run_dir, step, state="done", results=report["results"])
    return report["results"]


class EvalTask:
    """What submitit runs in the evaluation job (pickled by reference): ``run_recorded``."""

    def __call__(self, run_dir: str, step: int) -> dict:
        return run_recorded(run_dir, step, "slurm")
