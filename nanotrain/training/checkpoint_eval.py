"""A checkpoint's evaluation in one process: each `eval.sources` entry's loss and perplexity, and
greedy samples from `eval.prompts` (what `submit.py --evaluate` and `checkpoints.eval_job` run).

The loss is the in-loop validation's number (``training/evaluate.py``) on another corpus: the
source's windows are read in order from its first, ``batches`` global batches of the training's
global batch G = dp x ep x micro-batches x micro_batch_size windows, cut into the same
micro-batches of micro_batch_size windows, each micro-batch's mean token loss averaged over all
of them. Given the corpus of ``data.validation.source`` and ``training.eval_batches`` batches it
therefore equals the run's ``val/loss`` at that step, whatever the topology it trained at: the
plain model holds the same weights (merged from the saved shards) and computes in the run's
``model.dtype`` (bf16 autocast where training used it). Document masking and the boundary
mask apply as in training.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from nanotrain.data.build import prepare_dataset
from nanotrain.data.dataset import default_cache_dir
from nanotrain.data.errors import DataError
from nanotrain.data.sampler import GlobalSampler, SourcePart
from nanotrain.models.generate import generate
from nanotrain.parallel import accelerator
from nanotrain.training.evaluate import perplexity
from nanotrain.training.step import micro_loss


@dataclass
class SourceResult:
    """One evaluation source's numbers at one checkpoint."""

    name: str
    loss: float
    perplexity: float
    windows: int
    tokens: int
    seconds: float


def global_batch(config) -> int:
    t = config.training
    return config.parallelism.batch_replicas * t.micro_batch_size * t.batch_accumulation_per_replica


def eval_sampler(config, where: str, data_args, batches: int) -> GlobalSampler:
    """The windows of one evaluation source in order, as one process's micro-batches of a whole
    global batch (``batch(b * G, 0)``: global batch b). Tokenises the source into the run's
    cache if it is not there (``data.max_build_mb`` bounds it as in training). Raises DataError
    naming ``where`` when it holds fewer windows than ``batches`` global batches need (it would
    read windows twice)."""
    t, d = config.training, config.data
    dataset = prepare_dataset(
        data_args,
        seq_len=t.sequence_length,
        cache_dir=default_cache_dir(config),
        vocab_size=config.model.vocab_size,
        max_build_mb=d.max_build_mb,
    )
    g = global_batch(config)
    if dataset.num_windows < batches * g:
        raise DataError(
            f"{where}.batches: {batches} global batches of {g} samples = {batches * g} windows of "
            f"training.sequence_length+1={t.sequence_length + 1} tokens, but {data_args.source!r} holds "
            f"{dataset.num_windows}: lower batches or add data"
        )
    return GlobalSampler(
        [SourcePart("eval", dataset, shuffle=False)],
        seed=t.seed,
        dp=1,
        micro_batch_size=t.micro_batch_size,
        batch_accumulation=g // t.micro_batch_size,
        document_masking=d.document_masking,
        mask_boundary_loss=d.mask_boundary_loss,
    )


@torch.no_grad()
def source_loss(model, sampler: GlobalSampler, batches: int, compute_dtype: torch.dtype) -> float:
    """Mean token loss over ``batches`` global batches of ``sampler``: per batch the mean of its
    micro-batches' losses (as dp ranks' means averaged over dp), then the mean over batches."""
    device = model.embed.weight.device
    total = 0.0
    for b in range(batches):
        micro = [tuple(x.to(device) for x in mb) for mb in sampler.batch(b * sampler.global_batch_size, 0)]
        model.begin_step(len(micro))
        if compute_dtype == torch.float32:
            loss = sum(micro_loss(model, mb) for mb in micro) / len(micro)
        else:
            with accelerator.autocast(device.type, dtype=compute_dtype):
                loss = sum(micro_loss(model, mb) for mb in micro) / len(micro)
        total += float(loss.to(torch.float64))
    return total / batches


def evaluate_source(model, config, where: str, name: str, data_args, batches: int) -> SourceResult:
    started = time.perf_counter()
    sampler = eval_sampler(config, where, data_args, batches)
    loss = source_loss(model, sampler, batches, getattr(torch, config.model.dtype))
    if not math.isfinite(loss):
        raise FloatingPointError(f"{where} ({name}): the loss is not finite ({loss}): the checkpoint's weights are")
    windows = batches * sampler.global_batch_size
    return SourceResult(
        name, loss, perplexity(loss), windows, windows * config.training.sequence_length, time.perf_counter() - started
    )


def decode(tokenizer, ids: list[int]) -> str:
    """The text of ``ids``; an id past the tokenizer's vocabulary (a padded model vocabulary)
    shows as U+FFFD rather than failing."""
    parts, run = [], []
    for i in ids:
        if i < tokenizer.vocab_size:
            run.append(i)
        else:
            parts += [tokenizer.decode(run), "\ufffd"]
            run = []
    return "".join(parts) + tokenizer.decode(run)


def greedy_samples(model, tokenizer, prompts: list[str], new_tokens: int, eos: int) -> list[tuple[str, str]]:
    """(prompt, its greedy continuation) for each prompt, stopping at ``eos`` (not shown)."""
    out = []
    for prompt in prompts:
        ids = [int(i) for i in tokenizer.encode_batch([prompt])[0]]
        new = generate(model, ids, new_tokens, stop_ids=(eos,))
        out.append((prompt, decode(tokenizer, new[:-1] if new and new[-1] == eos else new)))
    return out


def samples_markdown(samples: list[tuple[str, str]]) -> str:
    """The samples as TensorBoard text (Markdown): each prompt and continuation as an indented
    code block, so that neither is read as Markdown."""
    blocks = []
    for i, (prompt, text) in enumerate(samples):
        body = "\n".join("    " + line for line in (prompt + text).splitlines() or [""])
        blocks.append(f"**prompt {i}** ({len(prompt)} characters, then the model's continuation):\n\n{body}")
    return "\n\n".join(blocks)
