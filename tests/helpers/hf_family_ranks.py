"""The rank side of tests/test_hf_families.py, in a module without transformers (each of 8 ranks
imports it; transformers would cost each of them seconds of start-up).

``family_runs``: for each family, in one launch: import the Hugging Face directory at the
family's layout, gather the logits of a batch from the last pipeline stage's tp and cp shards
(``parallel_logits``), take two lr-0 steps (loss and grad norm) and save a checkpoint for the
export round trip."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from nanotrain.checkpoint import save_checkpoint
from nanotrain.config import config_from_dict
from nanotrain.hf.import_weights import load_hf_weights
from nanotrain.optim import build_lr_scheduler, build_optimizer, optimizer_groups
from nanotrain.parallel.data_parallel import build_grad_sync
from nanotrain.training.builder import build_engine, build_model, build_parallel_context
from nanotrain.training.step import train_step


def parallel_logits(model, pc, ids: torch.Tensor) -> torch.Tensor | None:
    """The logits ``[B, S, V]`` of ``ids`` ``[B, S]`` (every rank passes the same ids): the first
    stage's hidden state is broadcast to the next stage (pp 2: one chunk each), the last stage's
    vocabulary shards are gathered over tp and its zig-zag sequence chunks over cp and put back
    in order. None on ranks that are not on the last stage."""
    with torch.no_grad():
        hidden = None
        if pc.pp_size > 1:
            assert pc.pp_size == 2, "one boundary: first stage -> last stage"
            message = model.pipeline_message(ids.shape[0], ids.shape[1])
            buffer = torch.empty(message.shape, dtype=message.dtype)
            if pc.is_pipeline_first_stage:
                buffer = model(input_ids=ids)
            dist.broadcast(buffer, dist.get_global_rank(pc.pp_pg, 0), group=pc.pp_pg)
            if pc.is_pipeline_first_stage:
                return None
            hidden = buffer
        logits = model(input_ids=None if hidden is not None else ids, hidden=hidden)  # [S/cp, B, V/tp]
        if pc.tp_size > 1:
            shards = [torch.empty_like(logits) for _ in range(pc.tp_size)]
            dist.all_gather(shards, logits.contiguous(), group=pc.tp_pg)
            logits = torch.cat(shards, dim=-1)
        logits = logits[..., : model.args.vocab_size]
        if model.cp.enabled:
            seq = ids.shape[1]
            positions = model.cp.positions(seq, logits.device)
            parts = [torch.empty_like(logits) for _ in range(pc.cp_size)]
            where = [torch.empty_like(positions) for _ in range(pc.cp_size)]
            dist.all_gather(parts, logits.contiguous(), group=pc.cp_pg)
            dist.all_gather(where, positions, group=pc.cp_pg)
            full = torch.empty((seq, *logits.shape[1:]), dtype=logits.dtype)
            for part, pos in zip(parts, where):
                full[pos] = part
            logits = full
        return logits.transpose(0, 1).contiguous()


def family_runs(hf_dirs: dict, sections: dict, layouts: dict, ids: torch.Tensor, out_root: str) -> dict:
    """On every rank, for each family ``name`` of ``sections`` (its ``model:`` section, as
    ``scripts/hf_config.py`` prints it): import ``hf_dirs[name]`` at ``layouts[name]``, the logits
    of ``ids[:, :-1]`` (``parallel_logits``), two lr-0 steps on ``ids`` (each data rank its share,
    one sample per micro-batch: the losses and grad norms), then a checkpoint in
    ``out_root/name``. Returns ``{name: {"logits", "losses", "grad_norms"}}`` (logits None off the
    last stage)."""
    dist.init_process_group("gloo")
    out = {}
    for name, section in sections.items():
        layout = layouts[name]
        config = config_from_dict(
            {
                "model": {**section, "dtype": "float32"},
                "parallelism": layout,
                "training": {"sequence_length": ids.shape[1] - 1, "batch_accumulation_per_replica": 2},
                "optimizer": {"lr": 0.0, "min_lr": 0.0, "weight_decay": 0.0, "clip_grad": None},
            }
        )
        pc = build_parallel_context(config)
        model = build_model(config, pc)
        load_hf_weights(hf_dirs[name], model, config.model)
        logits = parallel_logits(model, pc, ids[:, :-1])
        engine = build_engine(config, pc)
        sync = build_grad_sync(list(model.parameters()), pc)
        opt = build_optimizer(model.named_parameters(), config.optimizer, **optimizer_groups(pc))
        sched = build_lr_scheduler(opt, config.optimizer, 10)
        per = ids.shape[0] // pc.data_size
        mine = ids[pc.data_rank * per : (pc.data_rank + 1) * per]
        micro = [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(1)]
        stats = [train_step(model, micro, sync, opt, sched, pc, None, engine=engine) for _ in range(2)]
        save_checkpoint(Path(out_root) / name, 2, model, opt, sched, pc, extra={"consumed_samples": 0}, config=config)
        out[name] = {
            "logits": logits,
            "losses": [float(s.loss) for s in stats],
            "grad_norms": [float(s.grad_norm) for s in stats],
        }
        del model, engine, sync, opt, sched
        pc.destroy()
    return out


class _Batches:
    """``evaluate``'s view of the validation stream: the same micro-batches for every global batch."""

    def __init__(self, micro):
        self.micro = micro

    def get(self, start: int):
        return self.micro


def _share(pc, rows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data rank's rows of ``rows`` ``[B, S + 1]``, one sample per micro-batch."""
    per = rows.shape[0] // pc.data_size
    mine = rows[pc.data_rank * per : (pc.data_rank + 1) * per]
    return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(1)]


def train_and_evaluate(
    hf_dirs: dict, sections: dict, layouts: dict, batches: torch.Tensor, heldout: torch.Tensor, out_root: str
) -> dict:
    """On every rank, for each family: import ``hf_dirs[name]`` at ``layouts[name]``, train one
    step per batch of ``batches`` ``[steps, B, S + 1]`` (AdamW, ZeRO-1, clipping, weight decay),
    save the checkpoint in ``out_root/name`` and evaluate it on ``heldout`` ``[B, S + 1]`` with
    nanotrain's own ``training.evaluate``. Returns ``{name: {"losses", "heldout"}}``."""
    from nanotrain.training.evaluate import evaluate

    dist.init_process_group("gloo")
    out = {}
    for name, section in sections.items():
        config = config_from_dict(
            {
                "model": {**section, "dtype": "float32"},
                "parallelism": layouts[name],
                "training": {"sequence_length": batches.shape[-1] - 1, "batch_accumulation_per_replica": 2},
                "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5, "zero_stage": 1},
            }
        )
        pc = build_parallel_context(config)
        model = build_model(config, pc)
        load_hf_weights(hf_dirs[name], model, config.model)
        engine = build_engine(config, pc)
        sync = build_grad_sync(list(model.parameters()), pc)
        opt = build_optimizer(model.named_parameters(), config.optimizer, **optimizer_groups(pc))
        sched = build_lr_scheduler(opt, config.optimizer, batches.shape[0])
        clip = config.optimizer.clip_grad
        losses = [
            float(train_step(model, _share(pc, rows), sync, opt, sched, pc, clip, engine=engine).loss)
            for rows in batches
        ]
        save_checkpoint(
            Path(out_root) / name, len(losses), model, opt, sched, pc, extra={"consumed_samples": 0}, config=config
        )
        micro = _share(pc, heldout)
        message = model.pipeline_message(1, heldout.shape[1] - 1)
        loss = evaluate(model, _Batches(micro), pc, 1, heldout.shape[0], len(micro), engine, message)
        out[name] = {"losses": losses, "heldout": float(loss)}
        del model, engine, sync, opt, sched
        pc.destroy()
    return out
