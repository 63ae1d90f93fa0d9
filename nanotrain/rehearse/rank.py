"""One rank of the real job, rehearsed in this process: build, train, evaluate, save, load, train.

``rehearse_rank(config, rank, steps)`` runs the real ``DistributedTrainer`` of global rank
``rank`` at the config's model shape and world size, on the stand-in device and world
(``stand_in.py``), watched by the ``DeviceTracker`` (placement, host syncs, memory) and
``Traffic`` (the collectives' contract and bytes). The legs, each a *window* of the report:

  build            ParallelContext, model, optimizer, data, prefetcher
  step 1 .. N      the training loop (only step N logs and saves: steps 1 .. N-1 are silent)
  eval             one evaluation, when the config has validation data
  save             the final checkpoint (the loop's own), written to a temporary directory
  load             a fresh trainer resuming from it; where its optimizer state landed
  step N+1         one more step of the resumed trainer (fused AdamW reads the loaded state)

The checkpoint protocol needs the other ranks' answers (plans, reports, the commit). In one
process this rank plays rank 0's part of the protocol as well and every other rank is taken to
answer as it does (a world of copies), so its own files are written, committed, verified and
read back exactly as in the job. ``python -m nanotrain.rehearse.rank`` runs it in a fresh
process (the fake world and the stubs are process-wide) and prints the JSON report.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from nanotrain.parallel import accelerator
from nanotrain.rehearse.stand_in import STUBS, LowerRight, fake_world, fused_attention
from nanotrain.rehearse.tracker import DeviceTracker, watch_storage_resizes, watch_tensor_factories
from nanotrain.rehearse.traffic import Traffic


class _AlsoRankZero(int):
    """This rank's number that also equals 0: the rank plays rank 0's part of the checkpoint
    protocol (prepare, commit, candidates) while its files and plans keep its own number."""

    def __eq__(self, other):
        return other == 0 or int(self) == other

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = int.__hash__


def _world_of_copies():
    """The checkpoint World: this rank answers for every rank, and plays rank 0's part."""
    from nanotrain.checkpoint import comm

    original = {name: getattr(comm.World, name) for name in ("broadcast", "all_gather", "gather", "any")}
    init = comm.World.__init__

    def __init__(self, pc=None):
        init(self, pc)
        self.rank = _AlsoRankZero(self.rank)

    def run_then(name, answer):
        def method(self, obj, *args, **kwargs):
            with contextlib.suppress(Exception):  # the fake backend delivers no bytes to decode
                original[name](self, obj, *args, **kwargs)
            return answer(self, obj) if self.active else original[name](self, obj, *args, **kwargs)

        return method

    patches = {
        "__init__": __init__,
        "broadcast": run_then("broadcast", lambda self, obj: obj),
        "all_gather": run_then("all_gather", lambda self, obj: [obj] * self.size),
        "gather": run_then("gather", lambda self, obj: [obj] * self.size),
        "any": run_then("any", lambda self, obj: bool(obj)),
    }
    return _patched(comm.World, patches)


@contextlib.contextmanager
def _model_stand_ins():
    """Context parallelism's mask: a marker (``stand_in.LowerRight``) that its ``sdpa`` hands to
    the stand-in's kernel choice. MoE on the meta device: the real routing runs (its syncs and
    placements are recorded), then
    its counts, read back as zeros, become an equal share per expert; the count exchange's
    answer is every ep rank sending this rank's experts the same."""
    from nanotrain.models import moe
    from nanotrain.parallel import context_parallel, expert_parallel
    from nanotrain.parallel.part import placement

    route, exchange = moe.route, expert_parallel.exchange_counts

    def balanced_route(logits, top_k, capacity_factor, *rest):  # rest: norm_topk_prob, as route takes it
        r = route(logits, top_k, capacity_factor, *rest)
        tokens, experts = logits.shape
        share = [tokens * top_k // experts + (e < tokens * top_k % experts) for e in range(experts)]
        order = torch.empty(sum(share), dtype=r.order.dtype, device=r.order.device)
        weights = torch.empty(sum(share), dtype=r.weights.dtype, device=r.weights.device)
        return dataclasses.replace(r, order=order, counts=share, weights=weights)

    def copies(counts, ep_pg, device):
        exchange(counts, ep_pg, device)
        ep, me = dist.get_world_size(ep_pg), dist.get_rank(ep_pg)
        local = len(counts) // ep
        return [counts[me * local : (me + 1) * local] for _ in range(ep)]

    inits = {"init_from_full_": _drawn_on_meta(placement.init_from_full_)}
    with (
        _patched(moe, {"route": balanced_route}),
        _patched(placement, inits),
        _patched(expert_parallel, {"exchange_counts": copies}),
        _patched(context_parallel, {"causal_lower_right": LowerRight, "sdpa": _sdpa_of(context_parallel.sdpa)}),
    ):
        yield


def _sdpa_of(sdpa):
    def stand_in_sdpa(q, k, v, attn_mask=None, **kwargs):
        if not isinstance(attn_mask, LowerRight):
            return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
        dtype = accelerator.autocast_dtype(q.device.type)  # autocast's cast of SDPA's inputs
        q, k, v = (t.to(dtype) if dtype is not None and t.is_floating_point() else t for t in (q, k, v))
        return fused_attention(q, k, v, attn_mask=attn_mask, **kwargs)

    return stand_in_sdpa


def _drawn_on_meta(init_from_full_):
    """Weight initialisation draws the full tensor on the host and keeps this rank's slices; on
    meta there is nothing to keep, and an 8B model's draws cost the rehearsal half a minute."""

    def init(param, fill_fn, dtype=None):
        return None if param.device.type == "meta" else init_from_full_(param, fill_fn, dtype)

    return init


def _built_on(device, build_model):
    """The model built on the stand-in device itself: a GPU rank builds it on the host and moves
    it (the same parameter objects: CPU and CUDA tensors swap storage in place), but a move to
    meta makes new parameters and drops what nanotrain records on them (shard info), and the
    host copy of a 70B shard would cost the rehearsal gigabytes and seconds of initialisation."""

    def build(*args, **kwargs):
        with torch.device(device):
            return build_model(*args, **kwargs)

    return build


def _skeletons_uncounted(tracker: DeviceTracker):
    """A model's meta skeleton (``placement.on_meta``) holds no memory on a GPU: not counted."""
    from nanotrain.parallel.part import placement

    on_meta = placement.on_meta

    @contextlib.contextmanager
    def uncounted_meta():
        with on_meta(), tracker.uncounted():
            yield

    return _patched(placement, {"on_meta": uncounted_meta})


def _others_arrive_at_once():
    """Meetings of the whole job on its store (the data build's) end when this rank arrives."""
    from nanotrain.data import build

    waits = {"wait_for_builders": lambda *args, **kwargs: None} if hasattr(build, "wait_for_builders") else {}
    return _patched(build, waits)


@contextlib.contextmanager
def _patched(owner, attributes: dict):
    before = {name: getattr(owner, name) for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(owner, name, value)


def _rehearsal_config(config, steps: int, work: Path):
    cfg = copy.deepcopy(config)
    t, c = cfg.training, cfg.checkpoints
    t.train_steps = steps
    t.eval_interval = 0  # the rehearsal runs its one evaluation itself
    t.profile = None
    cfg.logging.log_interval = 10**9  # only the last step logs (train_steps always does)
    c.path, c.interval, c.resume, c.keep_last = str(work / "checkpoints"), 0, False, None
    c.init_from_hf = None
    return cfg


def rehearse_rank(config, rank: int, steps: int = 3, train_only: bool = False) -> dict:
    """The report of one rank (see ``report.py`` for its fields); ``train_only``: build and the
    steps, no evaluation, save or load (a measurement of memory and traffic)."""
    from nanotrain.data import build_samplers
    from nanotrain.parallel.observe.hang_record import HANG_RECORD
    from nanotrain.training import builder as builder_module
    from nanotrain.training import trainer as trainer_module

    started = time.perf_counter()
    world = config.parallelism.world_size
    with tempfile.TemporaryDirectory(prefix="nanotrain-rehearsal-") as tmp, fake_world(world, rank) as device:
        work = Path(tmp)
        cfg = _rehearsal_config(config, steps, work)
        tracker = DeviceTracker(device)
        traffic = Traffic(device, on_call=lambda: tracker.phase("comm")).install()

        def windowed(name):
            tracker.window = traffic.window = name

        original_step = trainer_module.train_step
        steps_run = [0]

        def train_step(*args, **kwargs):
            steps_run[0] += 1
            windowed(f"step {steps_run[0]}")
            return original_step(*args, **kwargs)

        report: dict = {"rank": rank, "world_size": world, "stubs": list(STUBS), "train_only": train_only}
        loads = functools.partial(builder_module.load_checkpoint, strict=False)
        pc = None
        try:
            building = {"load_checkpoint": loads, "build_model": _built_on(device, builder_module.build_model)}
            with (
                tracker,
                watch_tensor_factories(tracker),
                watch_storage_resizes(tracker),
                _world_of_copies(),
                _others_arrive_at_once(),
                _model_stand_ins(),
                _patched(trainer_module, {"train_step": train_step}),
                _patched(builder_module, building),
                _skeletons_uncounted(tracker),
            ):
                build_samplers(cfg, builder=True, needs_data=True)  # the token cache rank 0 would make
                pc = builder_module.build_parallel_context(cfg)
                traffic.name_groups(pc)
                report["coords"] = dict(zip(("ep", "pp", "dp", "cp", "tp"), map(int, pc.coords)))

                def new_trainer():  # the job's own parts and trainer, from cfg as it is at the call
                    parts = builder_module.build_parts(cfg, pc, work / "run")
                    return trainer_module.DistributedTrainer(parts, lambda: 0)

                _legs(cfg, steps, tracker, windowed, report, new_trainer, train_only)
        except Exception as exc:  # a defect that stops the rank on a GPU too: the report says where
            report["failed"] = {
                "window": tracker.window,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "site": _innermost(exc),
            }
        finally:
            traffic.uninstall()
            HANG_RECORD.disarm()
            if pc is not None:
                pc.destroy(synchronize=False)
    report.update(
        placement=tracker.placement,
        collective_defects=traffic.defects,
        syncs={w: [[kind, site, n] for (kind, site), n in c.items()] for w, c in tracker.syncs.items()},
        bytes={w: [[*key, b, traffic.calls[w][key]] for key, b in c.items()] for w, c in traffic.bytes.items()},
        silent=[f"step {k}" for k in range(1, steps)],
        seconds=time.perf_counter() - started,
    )
    return report


def _legs(cfg, steps, tracker, windowed, report, new_trainer, train_only: bool) -> None:
    """Train ``steps`` steps (the last saves), evaluate, load into a fresh trainer, one more step."""
    with tracker.phase("other"):
        trainer = new_trainer()
    _label(tracker, trainer)
    tracker.label = "activations"  # what the steps allocate, unless a phase says otherwise
    _watch_optimizer(tracker, trainer)
    if train_only:
        trainer.save = lambda wait=True: None  # the loop's final save: not measured
    trainer.train()
    report["peak"] = {"total": tracker.peak_total, **tracker.peak}
    report["max_by_category"] = dict(tracker.max_by_category)
    if train_only:
        trainer.close()
        return
    windowed("eval")
    report["evaluated"] = trainer.val_batches is not None
    if trainer.val_batches is not None:
        trainer.evaluate()
    trainer.close()
    del trainer
    windowed("load")
    cfg.checkpoints.resume, cfg.training.train_steps = True, steps + 1
    trainer = new_trainer()
    report["resumed_at"] = trainer.step
    report["optimizer_state_off_device"] = _off_device(trainer.optimizer, tracker.device)
    _watch_optimizer(tracker, trainer)
    trainer.train()
    trainer.close()


def _innermost(exc: BaseException) -> str:
    """The innermost nanotrain line of ``exc``'s traceback."""
    site = "?"
    for frame in traceback.extract_tb(exc.__traceback__):
        path = frame.filename.replace("\\", "/")
        if "nanotrain/" in path and "nanotrain/rehearse/" not in path:
            site = f"{path[path.rindex('nanotrain/') :]}:{frame.lineno} ({frame.name})"
    return site


def _label(tracker: DeviceTracker, trainer) -> None:
    """Name what the build allocated: parameters, their gradient buffers, optimizer state."""
    params = list(trainer.model.parameters())
    tracker.relabel(params, "weights")
    tracker.relabel([p.grad for p in params if p.grad is not None], "grads")
    tracker.relabel([b.buffer for b in getattr(trainer.grad_sync, "buckets", ()) if b.buffer is not None], "grads")
    syncs = getattr(trainer.grad_sync, "syncs", [trainer.grad_sync])
    tracker.relabel([s.accumulator.flat for s in syncs if s.accumulator is not None], "grads")  # ZeRO-2
    tracker.relabel(_state_tensors(trainer.optimizer), "optimizer")
    stores = [d.store for d in getattr(trainer.optimizer, "domains", ()) if getattr(d, "store", None) is not None]
    tracker.relabel([s.shard for s in stores], "weights")  # ZeRO-3: the owned pieces of the parameters


def _watch_optimizer(tracker: DeviceTracker, trainer) -> None:
    """Allocations of the update are optimizer states; gradients made in backward are grads."""
    optimizer = trainer.optimizer
    step = optimizer.step

    def watched(*args, **kwargs):
        tracker.relabel([p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None], "grads")
        with tracker.phase("optimizer"):
            return step(*args, **kwargs)

    optimizer.step = watched


def _state_tensors(optimizer) -> list[torch.Tensor]:
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def _off_device(optimizer, device) -> list[str]:
    """Optimizer state entries not where torch's own loader would put them: with a fused or
    capturable update every tensor beside its parameter (shard), otherwise all but ``step``."""
    fused = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    names = {id(p): n for g in optimizer.param_groups for n, p in zip(g.get("param_names", ()), g["params"])}
    out = []
    for key, state in optimizer.state.items():
        for entry, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != key.device and (fused or entry != "step"):
                out.append(
                    f"{names.get(id(key), tuple(key.shape))}.{entry} on {value.device}, its parameter on {key.device}"
                )
    return sorted(set(out))


def main(argv: list[str]) -> int:
    """``python -m nanotrain.rehearse.rank CONFIG_JSON RANK STEPS``: one rank's JSON report."""
    from nanotrain.config import config_from_dict

    config = config_from_dict(json.loads(Path(argv[0]).read_text()))
    report = rehearse_rank(config, int(argv[1]), int(argv[2]))
    sys.stdout.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
