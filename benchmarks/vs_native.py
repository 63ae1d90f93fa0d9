#!/usr/bin/env python3
"""nanotrain side by side with the PyTorch-native way of doing the same thing, as measured ratios.

    make bench            # = .venv/bin/python benchmarks/vs_native.py           (< 20 min, 2 cores)
    make bench QUICK=1    # = .venv/bin/python benchmarks/vs_native.py --quick   (< 4 min)
    .venv/bin/python benchmarks/vs_native.py --only tp2_ar pp2_1f1b              # some jobs

Every row trains the same Llama (``MODEL``) on the same batches with the same AdamW, LR schedule
and global-norm clipping, from the same initial weights, once with nanotrain and once with the
native stack (``benchmarks/native_llama.py``), in the SAME processes: after a warm-up of each, the
two sides run alternately (A B A B ...) for ``--reps`` alternations of ``--steps`` steps. A step
is timed from a barrier to the slowest rank's end (all-reduce MAX, outside the timed region);
tokens/s = tokens per step / median over alternations of each block's median step; the paired
ratio is the median over alternations of native / nanotrain block time (load-robust). Both
sides train on identical batch sequences, so their losses are comparable step by step:
``same_loss`` is |loss_ours - loss_native| / loss_native <= 1e-4 on the first step (identical
weights and data; computed, not assumed), and ``loss_rel_max`` is the largest relative difference
over the warm-up steps (after optimizer steps).

One launch (local gloo processes, 1 thread each, ``nanotrain.launch.local.rank_env``) per job,
jobs listed in ``JOBS``. Results: ``benchmarks/results/latest.json`` (a list of rows: name, ours,
native, unit, ratio, target, same_loss, + details) and ``latest.md`` (the table, the command,
the machine, the date).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

# The research setting (../shared/research/torch-native-cpu.md): ~1 M parameters, 16 sequences of
# 64 tokens = 1,024 tokens per optimizer step (strong scaling: dp splits the batch).
MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=512, num_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, dtype="float32")
# Checkpoint rows: a bigger model, so that the bytes (not fixed costs) dominate: ~13 M parameters,
# ~155 MB of weights + AdamW states.
CKPT_MODEL = dict(vocab_size=4096, hidden_size=384, intermediate_size=1024, num_layers=6, num_attention_heads=6,
                  num_key_value_heads=6, max_position_embeddings=64, dtype="float32")
OPTIM = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0, warmup_steps=0,
             lr_decay_style="constant")
SEQ, GLOBAL_SEQS, MICRO_SEQS, PP_M, SEED = 64, 16, 8, 8, 1
SAME_LOSS_RTOL = 1e-4


# ============================================================================ worker-side helpers
class Bench:
    """What a job's functions share: settings, the batches, the timing loop."""

    def __init__(self, reps: int, steps: int, warmup: int):
        import torch

        self.reps, self.steps, self.warmup = reps, steps, warmup
        self.total_steps = 2 * (warmup + reps * steps) + 8
        gen = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, MODEL["vocab_size"], (GLOBAL_SEQS, SEQ + 1), generator=gen)
                        for _ in range(8)]

    def batch(self, i: int):
        return self.batches[i % len(self.batches)]

    @staticmethod
    def timed(fn, i: int) -> tuple[float, float, float]:
        import torch
        import torch.distributed as dist

        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = fn(i)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)  # CPU seconds of all ranks (gloo threads included)
        return elapsed.item(), cpu.item(), float(loss)

    def alternate(self, sides: dict) -> dict:
        """Warm up each side, then A B A B ...; per side: per-repetition median step seconds and
        every step's loss (same batch sequence on both sides)."""
        out = {k: {"rep_s": [], "losses": [], "cpu_s": []} for k in sides}
        index = {k: 0 for k in sides}

        def run(k: int, n: int) -> list[float]:
            times = []
            for _ in range(n):
                t, cpu, loss = self.timed(sides[k], index[k])
                index[k] += 1
                times.append(t)
                out[k]["cpu_s"].append(cpu)
                out[k]["losses"].append(loss)
            return times

        for k in sides:
            run(k, self.warmup)
        for _ in range(self.reps):
            for k in sides:
                out[k]["rep_s"].append(statistics.median(run(k, self.steps)))
        if os.environ.get("NANOTRAIN_BENCH_PROFILE"):
            for k in sides:
                self.profile(k, sides[k], index[k])
        return out

    def profile(self, side: str, fn, start: int, steps: int = 3) -> None:
        """torch.profiler over a few steps of one side; per-rank op tables in
        $NANOTRAIN_BENCH_PROFILE/<job>-<side>-rank<r>.txt, plus CPU vs wall time per step."""
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile

        directory = Path(os.environ["NANOTRAIN_BENCH_PROFILE"])
        directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        wall0, cpu0 = time.perf_counter(), time.process_time()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(steps):
                fn(start + i)
        wall, cpu = (time.perf_counter() - wall0) / steps, (time.process_time() - cpu0) / steps
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
        path = directory / f"{os.environ.get('NANOTRAIN_BENCH_JOB', 'job')}-{side}-rank{dist.get_rank()}.txt"
        path.write_text(f"{side}: {steps} steps under the profiler: {1e3 * wall:.1f} ms wall, "
                        f"{1e3 * cpu:.1f} ms process CPU per step\n\n{table}\n")

    def throughput_row(self, name: str, result: dict, tokens: int, target: float, **extra) -> dict:
        ours, native = result["ours"], result["native"]
        s_ours, s_nat = statistics.median(ours["rep_s"]), statistics.median(native["rep_s"])
        # Each repetition's pair ran back to back under about the same machine load: the median of
        # the per-pair ratios is the load-robust view of the same comparison.
        paired = statistics.median(n / o for o, n in zip(ours["rep_s"], native["rep_s"]))
        lo, ln = ours["losses"], native["losses"]
        rel = [abs(a - b) / abs(b) for a, b in zip(lo, ln)]
        n_warm = max(1, self.warmup)
        row = {
            "name": name, "ours": round(tokens / s_ours, 1), "native": round(tokens / s_nat, 1),
            "unit": "tokens/s", "ratio": round(s_nat / s_ours, 3), "target": target,
            "same_loss": bool(rel[0] <= SAME_LOSS_RTOL),
            "loss_ours": lo[0], "loss_native": ln[0], "loss_rel_first": rel[0],
            "loss_rel_max": max(rel[:n_warm]),
            "ratio_paired": round(paired, 3),
            "ms_ours": round(1e3 * s_ours, 2), "ms_native": round(1e3 * s_nat, 2),
            "cpu_ms_ours": round(1e3 * statistics.median(ours["cpu_s"][n_warm:] or ours["cpu_s"]), 2),
            "cpu_ms_native": round(1e3 * statistics.median(native["cpu_s"][n_warm:] or native["cpu_s"]), 2),
            "ms_ours_reps": [round(1e3 * s, 2) for s in ours["rep_s"]],
            "ms_native_reps": [round(1e3 * s, 2) for s in native["rep_s"]],
        }
        row["loadavg_1min"] = round(os.getloadavg()[0], 2)  # other load on the machine skews both sides
        row.update(extra)
        return row


def model_args(spec: dict = MODEL):
    from nanotrain.config import ModelArgs

    return ModelArgs(**spec)


def optim_args():
    from nanotrain.config import OptimizerArgs

    return OptimizerArgs(**OPTIM)


def micro_batches(batch, dp_rank: int, dp: int, micro: int):
    per = batch.shape[0] // dp
    mine = batch[dp_rank * per:(dp_rank + 1) * per]
    return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(micro)]


# ------------------------------------------------------------------------------ nanotrain side
class Ours:
    """nanotrain's public pieces, wired as nanotrain/trainer.py wires them."""

    def __init__(self, bench: Bench, dp=1, tp=1, pp=1, mode="ALL_REDUCE", engine="1f1b", v=1, micro=MICRO_SEQS,
                 spec: dict = MODEL, pc=None):
        from nanotrain.models.llama import LlamaModel
        from nanotrain.optim import build_lr_scheduler, build_optimizer
        from nanotrain.parallel.context import ParallelContext
        from nanotrain.parallel.data_parallel import BucketedGradSync
        from nanotrain.parallel.pipeline_parallel import PipelineEngine

        self.bench, self.micro = bench, micro
        self.pc = pc or ParallelContext(tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp)
        self.args = model_args(spec)
        self.model = LlamaModel(self.args, self.pc.tp_pg, mode=mode, pp_rank=self.pc.pp_rank, pp_size=pp,
                                virtual_stages=v, seed=SEED)
        self.grad_sync = BucketedGradSync(list(self.model.parameters()), self.pc.dp_cp_pg)
        self.optimizer = build_optimizer(self.model.named_parameters(), optim_args(), self.pc.dp_cp_pg)
        self.scheduler = build_lr_scheduler(self.optimizer, optim_args(), bench.total_steps)
        self.engine = PipelineEngine(engine, self.pc.pp_pg) if pp > 1 else None

    def step(self, i: int) -> float:
        from nanotrain.training.step import train_step

        micro = micro_batches(self.bench.batch(i), self.pc.dp_rank, self.pc.dp_size, self.micro)
        return train_step(self.model, micro, self.grad_sync, self.optimizer, self.scheduler, self.pc,
                          OPTIM["clip_grad"], self.engine).loss

    def layer_stages(self) -> dict[int, int]:
        """Virtual stage of every decoder layer (known on every rank), for the native split."""
        return {int(i): block.virtual_stage for i, block in self.model.layers.items()}


# ------------------------------------------------------------------------------- native side
def native_optimizer(modules, bench: Bench):
    import torch

    from native_llama import decay_groups
    from nanotrain.optim import build_lr_scheduler

    groups = [{"params": [], "weight_decay": OPTIM["weight_decay"]}, {"params": [], "weight_decay": 0.0}]
    for m in modules:
        for g, add in zip(groups, decay_groups(m, OPTIM["weight_decay"])):
            g["params"] += add["params"]
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"])
    return opt, build_lr_scheduler(opt, optim_args(), bench.total_steps)  # same LambdaLR factor


def native_clip_(params, max_norm: float, pp_group=None):
    """torchtitan's ``clip_grad_norm_``: the local (DTensor-aware) norm, squared-summed over pp.

    Gradients on different meshes (plain-TP norms are plain tensors; under FSDP2 + TP the norms
    live on the dp mesh, the projections on the dp x tp mesh) cannot share a foreach kernel, so
    the norm and the scaling run per mesh group, as torchtitan's does per parameter group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    parts = []
    for ps in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
        parts.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))
    if pp_group is not None:
        total = total ** 2
        dist.all_reduce(total, group=pp_group)
        total = total ** 0.5
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def plain_loss(loss) -> "torch.Tensor":
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class NativeFlat:
    """No pipeline: a plain loop (ws 1), DDP (dp), or DTensor TP (+SP) with loss_parallel."""

    def __init__(self, bench: Bench, dp=1, tp=1, sequence_parallel=False, micro=MICRO_SEQS):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from native_llama import apply_tp, build_native

        self.bench, self.micro, self.dp, self.tp = bench, micro, dp, tp
        self.model = build_native(model_args(), SEQ, SEED)
        self.ddp = False
        self.dp_rank = dist.get_rank() // tp if dist.is_initialized() else 0
        if tp > 1:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            apply_tp(self.model, mesh["tp"], sequence_parallel)
            if dp > 1:
                raise NotImplementedError("dp x tp natively needs FSDP2 (see Native3D)")
        elif dp > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
            self.ddp = True
        self.optimizer, self.scheduler = native_optimizer([self.model], bench)

    def step(self, i: int) -> float:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor.parallel import loss_parallel

        from native_llama import cross_entropy

        micro = micro_batches(self.bench.batch(i), self.dp_rank, self.dp, self.micro)
        total = None
        with loss_parallel() if self.tp > 1 else nullcontext():
            for j, (x, y) in enumerate(micro):
                last = j == len(micro) - 1
                with nullcontext() if last or not self.ddp else self.model.no_sync():
                    loss = cross_entropy(self.model(x), y) / len(micro)
                    loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
        native_clip_(list(self.model.parameters()), OPTIM["clip_grad"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        total = plain_loss(total)
        if self.dp > 1:  # the logged loss is the global batch's, as nanotrain's train_step returns
            dist.all_reduce(total)
            total = total / self.dp
        return total.item()


class NativePipeline:
    """``torch.distributed.pipelining``: manual split (the same layers per stage as nanotrain),
    ``PipelineStage`` per local stage, Schedule1F1B / ScheduleInterleaved1F1B; optionally DTensor
    TP and FSDP2 replicate/fully_shard per stage (the native 3D)."""

    def __init__(self, bench: Bench, layer_stages: dict[int, int], pp: int, v: int, m: int, dp=1, tp=1,
                 dp_kind="replicate", schedule="1f1b"):
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        from native_llama import apply_dp, apply_tp, build_native, cross_entropy, pipeline_stage_module

        self.bench, self.dp, self.tp, self.pp, self.m = bench, dp, tp, pp, m
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        self.pp_group = mesh["pp"].get_group()
        self.dp_group = mesh["dp"].get_group() if dp > 1 else None
        pp_rank, self.dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        full = build_native(model_args(), SEQ, SEED)
        num_stages = pp * v
        self.my_stages = [pp_rank + k * pp for k in range(v)]
        self.modules, stages = [], []
        for s in self.my_stages:
            layers = sorted(i for i, st in layer_stages.items() if st == s)
            module = pipeline_stage_module(full, layers, first=s == 0, last=s == num_stages - 1)
            if tp > 1:
                apply_tp(module, mesh["tp"], sequence_parallel=False)
            if dp > 1:
                apply_dp(module, mesh["dp"], dp_kind)
            self.modules.append(module)
            stages.append(PipelineStage(module, s, num_stages, torch.device("cpu"), group=self.pp_group))
        del full
        self.has_first, self.has_last = 0 in self.my_stages, num_stages - 1 in self.my_stages
        if schedule == "1f1b":
            self.schedule = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=cross_entropy)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=cross_entropy)
        self.optimizer, self.scheduler = native_optimizer(self.modules, bench)
        self.params = [p for mod in self.modules for p in mod.parameters()]
        self.pp_last_rank = dist.get_global_rank(self.pp_group, pp - 1)

    def step(self, i: int) -> float:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor.parallel import loss_parallel

        batch = self.bench.batch(i)
        per = batch.shape[0] // self.dp
        batch = batch[self.dp_rank * per:(self.dp_rank + 1) * per]
        x, y = batch[:, :-1], batch[:, 1:]
        losses: list = []
        with loss_parallel() if self.tp > 1 else nullcontext():
            if self.has_first:
                self.schedule.step(x, target=y if self.has_last else None, losses=losses)
            elif self.has_last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        native_clip_(self.params, OPTIM["clip_grad"], self.pp_group if self.pp > 1 else None)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        # The logged loss on every rank, as nanotrain's train_step returns it: mean over
        # micro-batches on the last stage, averaged over dp, broadcast along pp.
        if self.has_last:
            loss = torch.stack([plain_loss(l).detach() for l in losses]).mean().double()
            if self.dp_group is not None:
                dist.all_reduce(loss, group=self.dp_group)
                loss /= self.dp
        else:
            loss = torch.zeros((), dtype=torch.float64)
        dist.broadcast(loss, src=self.pp_last_rank, group=self.pp_group)
        return loss.item()


# ------------------------------------------------------------------------------ memory meter
class SavedBytes:
    """Bytes autograd saves for backward during a forward (storages counted once; parameters and
    buffers excluded; DTensors counted by their local shard)."""

    def __init__(self, modules):
        self.skip = set()
        for m in modules:
            for t in list(m.parameters()) + list(m.buffers()):
                self.skip.add(self._local(t).untyped_storage().data_ptr())
        self.bytes, self._seen = 0, set()

    @staticmethod
    def _local(t):
        from torch.distributed.tensor import DTensor

        return t._local_tensor if isinstance(t, DTensor) else t

    def _count(self, t) -> None:
        t = self._local(t)
        if hasattr(t, "__tensor_flatten__"):  # a wrapper subclass (e.g. AsyncCollectiveTensor)
            names, _ = t.__tensor_flatten__()
            for n in names:
                self._count(getattr(t, n))
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += storage.nbytes()

    def _pack(self, t):
        self._count(t)
        return t

    def __enter__(self):
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def max_over_ranks(value: float, group=None) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


# ===================================================================================== the jobs
def job_single(b: Bench) -> list[dict]:
    ours, native = Ours(b), NativeFlat(b)
    r = b.alternate({"ours": ours.step, "native": native.step})
    return [b.throughput_row("(1,1,1) vs plain single-process loop", r, GLOBAL_SEQS * SEQ, 0.97)]


def job_dp2(b: Bench) -> list[dict]:
    ours, native = Ours(b, dp=2), NativeFlat(b, dp=2)
    r = b.alternate({"ours": ours.step, "native": native.step})
    return [b.throughput_row("dp2 vs DistributedDataParallel", r, GLOBAL_SEQS * SEQ, 1.0)]


def _tp_memory(b: Bench, ours: Ours, native: NativeFlat) -> tuple[float, float]:
    """Saved-for-backward bytes of one micro-batch's forward, max over tp ranks, both sides."""
    from torch.distributed.tensor.parallel import loss_parallel

    from native_llama import cross_entropy

    (x, y), = micro_batches(b.batch(0), 0, 1, GLOBAL_SEQS)[:1]
    x, y = x[:MICRO_SEQS], y[:MICRO_SEQS]
    with SavedBytes([ours.model]) as meter_ours:
        loss = ours.model(x, y)
    del loss
    with loss_parallel(), SavedBytes([native.model]) as meter_native:
        loss = cross_entropy(native.model(x), y)
    del loss
    return max_over_ranks(meter_ours.bytes), max_over_ranks(meter_native.bytes)


def job_tp2(b: Bench, mode: str) -> list[dict]:
    sp = mode == "REDUCE_SCATTER"
    ours, native = Ours(b, tp=2, mode=mode), NativeFlat(b, tp=2, sequence_parallel=sp)
    r = b.alternate({"ours": ours.step, "native": native.step})
    mem_ours, mem_native = _tp_memory(b, ours, native)
    name = ("tp2 REDUCE_SCATTER vs Colwise/Rowwise + SequenceParallel" if sp
            else "tp2 ALL_REDUCE vs Colwise/Rowwise (DTensor)")
    return [b.throughput_row(name, r, GLOBAL_SEQS * SEQ, 1.3, activation_bytes_ours=mem_ours,
                             activation_bytes_native=mem_native)]


def job_tp2_ar(b: Bench) -> list[dict]:
    return job_tp2(b, "ALL_REDUCE")


def job_tp2_rs(b: Bench) -> list[dict]:
    return job_tp2(b, "REDUCE_SCATTER")


def job_pp2(b: Bench, schedule: str) -> list[dict]:
    v = 2 if schedule == "interleaved_1f1b" else 1
    ours = Ours(b, pp=2, engine=schedule, v=v, micro=GLOBAL_SEQS // PP_M)
    native = NativePipeline(b, ours.layer_stages(), pp=2, v=v, m=PP_M, schedule=schedule)
    r = b.alternate({"ours": ours.step, "native": native.step})
    if schedule == "1f1b":
        row = b.throughput_row(f"pp2 1f1b m={PP_M} vs Schedule1F1B", r, GLOBAL_SEQS * SEQ, 1.0)
        peak_1f1b = max_over_ranks(ours.engine.last_stats.peak_activation_bytes)
        live_1f1b = max_over_ranks(ours.engine.last_stats.peak_live_microbatches)
        afab = Ours(b, pp=2, engine="afab", micro=GLOBAL_SEQS // PP_M, pc=ours.pc)
        afab.step(0)
        peak_afab = max_over_ranks(afab.engine.last_stats.peak_activation_bytes)
        live_afab = max_over_ranks(afab.engine.last_stats.peak_live_microbatches)
        mem = {
            "name": f"memory: peak activation bytes, 1f1b vs afab (pp2, m={PP_M}, worst stage)",
            "ours": peak_1f1b, "native": peak_afab, "unit": "bytes", "ratio": round(peak_1f1b / peak_afab, 3),
            "target": round(2 / PP_M, 3), "lower_is_better": True, "same_loss": None,
            "columns": ["nanotrain 1f1b", "nanotrain afab"],
            "peak_live_microbatches": [live_1f1b, live_afab],
            "note": "engine instrumentation (saved-for-backward bytes of in-flight micro-batches); "
                    f"target = pp/m = 2/{PP_M}",
        }
        return [row, mem]
    return [b.throughput_row(f"pp2 interleaved_1f1b v=2 m={PP_M} vs ScheduleInterleaved1F1B", r,
                             GLOBAL_SEQS * SEQ, 1.0)]


def job_pp2_1f1b(b: Bench) -> list[dict]:
    return job_pp2(b, "1f1b")


def job_pp2_interleaved(b: Bench) -> list[dict]:
    return job_pp2(b, "interleaved_1f1b")


def job_3d(b: Bench) -> list[dict]:
    m = 4  # configs/tiny_cpu.yaml: micro-batch 2, 4 micro-batches per replica
    ours = Ours(b, dp=2, tp=2, pp=2, engine="1f1b", micro=GLOBAL_SEQS // 2 // m)
    native = NativePipeline(b, ours.layer_stages(), pp=2, v=1, m=m, dp=2, tp=2, dp_kind="replicate")
    r = b.alternate({"ours": ours.step, "native": native.step})
    return [b.throughput_row("dp2·tp2·pp2 (1f1b, m=4) vs DeviceMesh + DTensor TP + pipelining + FSDP2 replicate",
                             r, GLOBAL_SEQS * SEQ, 1.2)]


def job_checkpoint(b: Bench) -> list[dict]:
    """tp2, ~13 M parameters + AdamW states after one training step on each side."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from native_llama import apply_tp, build_native, cross_entropy
    from nanotrain.checkpoint import load_checkpoint, save_checkpoint

    args = model_args(CKPT_MODEL)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab_size, (4, SEQ + 1), generator=gen)
    x, y = batch[:, :-1], batch[:, 1:]
    rank = dist.get_rank()

    def ours_objects(seed: int, pc=None):
        o = Ours(b, tp=2, spec=CKPT_MODEL, micro=4, pc=pc)
        if seed != SEED:
            o.model.init_weights(seed)
        return o

    def native_objects(seed: int, mesh):
        model = build_native(args, SEQ, seed)
        apply_tp(model, mesh, sequence_parallel=False)
        opt, sched = native_optimizer([model], b)
        return model, opt, sched

    def ours_train(o):
        from nanotrain.training.step import train_step
        return train_step(o.model, [(x, y)], o.grad_sync, o.optimizer, o.scheduler, o.pc, OPTIM["clip_grad"]).loss

    def native_train(model, opt, sched):
        with loss_parallel():
            loss = cross_entropy(model(x), y)
            loss.backward()
        native_clip_(list(model.parameters()), OPTIM["clip_grad"])
        opt.step(), sched.step(), opt.zero_grad()
        return plain_loss(loss).item()

    def ours_eval(o):
        with torch.no_grad():
            return o.model(x, y).item()

    def native_eval(model):
        with torch.no_grad(), loss_parallel():
            return plain_loss(cross_entropy(model(x), y)).item()

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ours = ours_objects(SEED)
    native = native_objects(SEED, mesh)
    first = (ours_train(ours), native_train(*native))
    ref = (ours_eval(ours), native_eval(native[0]))
    ours_fresh = ours_objects(SEED + 7, pc=ours.pc)
    native_fresh = native_objects(SEED + 7, mesh)

    def state_bytes(params, opt) -> int:
        n = sum(plain_local(p).numel() * p.element_size() for p in params)
        for st in opt.state.values():
            n += sum(plain_local(t).numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
        return n

    def plain_local(t):
        from torch.distributed.tensor import DTensor
        return t._local_tensor if isinstance(t, DTensor) else t

    total_bytes = max_over_ranks(0)  # sync
    local_bytes = state_bytes(list(ours.model.parameters()), ours.optimizer)
    t = torch.tensor([float(local_bytes)], dtype=torch.float64)
    dist.all_reduce(t)
    total_bytes = t.item()

    root = Path(os.environ.get("NANOTRAIN_BENCH_TMP", tempfile.gettempdir())) / f"nanotrain-bench-ckpt-{os.getppid()}"
    dirs = {"ours": root / "ours", "native": root / "native", "raw": root / "raw"}
    if rank == 0:
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
    dist.barrier()
    counter = {"i": 0}

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return max_over_ranks(time.perf_counter() - t0)

    def clean(d: Path):
        dist.barrier()
        if rank == 0:
            for child in d.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        dist.barrier()

    def ours_save():
        counter["i"] += 1
        save_checkpoint(dirs["ours"], counter["i"], ours.model, ours.optimizer, ours.scheduler, ours.pc)

    def ours_load():
        load_checkpoint(dirs["ours"], ours_fresh.model, ours_fresh.optimizer, ours_fresh.scheduler, ours_fresh.pc,
                        load_rng=False)

    def native_save():
        msd, osd = get_state_dict(native[0], native[1])
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(dirs["native"] / "ckpt"))

    def native_load():
        msd, osd = get_state_dict(native_fresh[0], native_fresh[1])
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(dirs["native"] / "ckpt"))
        set_state_dict(native_fresh[0], native_fresh[1], model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    tensors = [plain_local(p).detach() for p in ours.model.parameters()]
    tensors += [plain_local(t) for st in ours.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]

    def raw_save():
        path = dirs["raw"] / f"rank{rank}.bin"
        with open(path, "wb") as f:
            for t in tensors:
                f.write(t.detach().contiguous().reshape(-1).numpy().data)  # no copy of the bytes
            f.flush()
            os.fsync(f.fileno())

    save = {"ours": [], "native": [], "raw": []}
    load = {"ours": [], "native": []}
    reps = max(2, b.reps)
    for rep in range(reps + 1):  # the first round is a warm-up
        for side, fn in (("ours", ours_save), ("native", native_save), ("raw", raw_save)):
            clean(dirs[side])  # every side writes into an empty directory; deleting is not timed
            s = timed(fn)
            if rep:
                save[side].append(s)
        for side, fn in (("ours", ours_load), ("native", native_load)):
            s = timed(fn)
            if rep:
                load[side].append(s)
    loaded = (ours_eval(ours_fresh), native_eval(native_fresh[0]))
    # One more training step from the loaded states: the optimizer states must be right too.
    after = (ours_train(ours_fresh), native_train(*native_fresh))
    after_ref = (ours_train(ours), native_train(*native))
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)

    def rel(a, c):
        return abs(a - c) / abs(c)

    same = (rel(first[0], first[1]) <= SAME_LOSS_RTOL and rel(loaded[0], ref[0]) <= 1e-6
            and rel(loaded[1], ref[1]) <= 1e-6 and rel(loaded[0], loaded[1]) <= SAME_LOSS_RTOL
            and rel(after[0], after_ref[0]) <= 1e-6 and rel(after[1], after_ref[1]) <= 1e-6)
    mb = total_bytes / 1e6
    med = {k: statistics.median(v) for k, v in save.items()}
    medl = {k: statistics.median(v) for k, v in load.items()}
    common = {"same_loss": bool(same), "state_MB": round(mb, 1),
              "loss_before_save": ref, "loss_after_load": loaded, "loss_step_after_load": after,
              "loss_step_reference": after_ref}
    return [
        {"name": "checkpoint save (tp2, 13 M params + AdamW) vs torch.distributed.checkpoint",
         "ours": round(mb / med["ours"], 1), "native": round(mb / med["native"], 1), "unit": "MB/s",
         "ratio": round(med["native"] / med["ours"], 3), "target": None,
         "s_ours": [round(s, 4) for s in save["ours"]], "s_native": [round(s, 4) for s in save["native"]],
         **common},
        {"name": "checkpoint load (tp2, same state) vs torch.distributed.checkpoint",
         "ours": round(mb / medl["ours"], 1), "native": round(mb / medl["native"], 1), "unit": "MB/s",
         "ratio": round(medl["native"] / medl["ours"], 3), "target": None,
         "s_ours": [round(s, 4) for s in load["ours"]], "s_native": [round(s, 4) for s in load["native"]],
         **common},
        {"name": "checkpoint save vs raw sequential write of the same bytes (+fsync)",
         "ours": round(mb / med["ours"], 1), "native": round(mb / med["raw"], 1), "unit": "MB/s",
         "ratio": round(med["raw"] / med["ours"], 3), "target": None, "columns": ["nanotrain", "raw write"],
         "s_raw": [round(s, 4) for s in save["raw"]], **common},
    ]


# name: (world size, function). Run in this order; a job is one launch.
JOBS = {
    "single": (1, job_single),
    "dp2": (2, job_dp2),
    "tp2_ar": (2, job_tp2_ar),
    "tp2_rs": (2, job_tp2_rs),
    "pp2_1f1b": (2, job_pp2_1f1b),
    "pp2_interleaved": (2, job_pp2_interleaved),
    "3d": (8, job_3d),
    "checkpoint": (2, job_checkpoint),
}


def worker(job: str, reps: int, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["NANOTRAIN_BENCH_JOB"] = job
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    dist.init_process_group("gloo", init_method="env://")
    bench = Bench(reps, steps, warmup)
    rows = JOBS[job][1](bench)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ launcher side
def launch(job: str, reps: int, steps: int, warmup: int, timeout_s: float, log_root: Path) -> list[dict]:
    from nanotrain.launch.env import free_port
    from nanotrain.launch.local import _stop_all, rank_env

    world = JOBS[job][0]
    out = log_root / f"{job}.json"
    log_dir = log_root / job
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-u", __file__, "--worker", job, str(reps), str(steps), str(warmup), str(out)]
    port = free_port()
    procs = []
    for rank in range(world):
        with open(log_dir / f"rank-{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(command, env=rank_env(rank, world, port, 1), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                raise RuntimeError(f"job {job}: rank {bad[0][0]} exited with {bad[0][1]}; log:\n"
                                   + (log_dir / f"rank-{bad[0][0]}.log").read_text()[-3000:])
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job}: timed out after {timeout_s:.0f} s; logs in {log_dir}")
            time.sleep(0.1)
    finally:
        _stop_all(procs)
    return json.loads(out.read_text())


def fmt_value(v, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "bytes":
        return f"{v / 1e6:,.2f} MB"
    return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"


def met(row: dict) -> str:
    if row.get("target") is None or row.get("ratio") is None:
        return "—"
    ok = row["ratio"] <= row["target"] if row.get("lower_is_better") else row["ratio"] >= row["target"]
    return "yes" if ok else "**no**"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Command: `{meta['command']}` — wall time {meta['wall_s']:.0f} s — {meta['date']}",
        "",
        f"Machine: {meta['machine']}; torch {meta['torch']}, gloo, 1 thread per rank. "
        f"Model: Llama {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, ffn {MODEL['intermediate_size']}, "
        f"{MODEL['num_attention_heads']} heads / {MODEL['num_key_value_heads']} kv, vocab {MODEL['vocab_size']}; "
        f"{GLOBAL_SEQS} x {SEQ} = {GLOBAL_SEQS * SEQ} tokens per step; AdamW + clip 1.0. "
        f"A B A B ...: {meta['reps']} alternations of {meta['steps']} step(s) per side after {meta['warmup']} "
        f"warm-up steps each; median of the per-alternation medians. "
        f"Load average (1/5/15 min) at start {meta['loadavg_start']}, at end {meta['loadavg_end']}.",
        "",
        "| row | nanotrain | native | unit | ratio | paired | target | met | same loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = "—" if r.get("target") is None else (("≤ " if r.get("lower_is_better") else "≥ ") + f"{r['target']}")
        name = r["name"] + (f" ({r['columns'][0]} / {r['columns'][1]})" if r.get("columns") else "")
        same = "—" if r.get("same_loss") is None else ("yes" if r["same_loss"] else "**NO**")
        lines.append(f"| {name} | {fmt_value(r['ours'], r['unit'])} | {fmt_value(r['native'], r['unit'])} | "
                     f"{r['unit']} | {r['ratio']} | {r.get('ratio_paired', '—')} | {target} | {met(r)} | {same} |")
    lines += ["", "ratio = nanotrain / native of the median tokens/s (checkpoint rows: MB/s); paired = median over "
              "the alternations of native step time / nanotrain step time, each pair run back to back (robust to "
              "load from other processes); memory rows: first column / second column, lower is better. same "
              "loss: first-step losses within 1e-4 relative (checkpoint rows: the loaded states give the saved "
              "loss and the same next training step on both sides)."]
    return "\n".join(lines) + "\n"


def tp_memory_row(rows: list[dict]) -> dict | None:
    ar = next((r for r in rows if r["name"].startswith("tp2 ALL_REDUCE")), None)
    rs = next((r for r in rows if r["name"].startswith("tp2 REDUCE_SCATTER")), None)
    if not ar or not rs:
        return None
    ours = rs["activation_bytes_ours"] / ar["activation_bytes_ours"]
    native = rs["activation_bytes_native"] / ar["activation_bytes_native"]
    return {"name": "memory: activation bytes per micro-batch, REDUCE_SCATTER vs ALL_REDUCE (tp2)",
            "ours": rs["activation_bytes_ours"], "native": ar["activation_bytes_ours"], "unit": "bytes",
            "ratio": round(ours, 3), "target": 1.0, "lower_is_better": True, "same_loss": None,
            "columns": ["nanotrain REDUCE_SCATTER", "nanotrain ALL_REDUCE"],
            "native_sp_over_tp": round(native, 3),
            "native_bytes": [rs["activation_bytes_native"], ar["activation_bytes_native"]],
            "note": "saved-for-backward bytes of one 8-sequence micro-batch's forward, max over tp ranks"}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        job, reps, steps, warmup, out = sys.argv[2:]
        worker(job, int(reps), int(steps), int(warmup), out)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="every row briefly (< 4 min)")
    parser.add_argument("--only", nargs="+", choices=list(JOBS), help="run these jobs only")
    parser.add_argument("--reps", type=int, help="alternations (default 30; quick 3)")
    parser.add_argument("--steps", type=int, help="steps per side per alternation (default 2; quick 1)")
    parser.add_argument("--warmup", type=int, help="untimed steps of each side first (default 3; quick 2)")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="after timing, torch.profiler tables of 3 steps per side and rank into DIR")
    parser.add_argument("--out", type=Path, default=HERE / "results",
                        help="directory for latest.json / latest.md (default benchmarks/results)")
    opts = parser.parse_args()
    # Short blocks, many of them: A and B alternate every `steps` steps, so both sides sample the
    # same stretches of machine load.
    reps, steps, warmup = (3, 1, 2) if opts.quick else (30, 2, 3)
    reps, steps, warmup = opts.reps or reps, opts.steps or steps, opts.warmup or warmup
    jobs = opts.only or list(JOBS)
    if opts.profile:
        os.environ["NANOTRAIN_BENCH_PROFILE"] = str(opts.profile.resolve())
    t0 = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows: list[dict] = []
    failures = []
    with tempfile.TemporaryDirectory(prefix="nanotrain-bench-") as tmp:
        for job in jobs:
            tj = time.perf_counter()
            try:
                got = launch(job, reps, steps, warmup, timeout_s=600, log_root=Path(tmp))
            except RuntimeError as err:
                print(f"[bench] {err}", file=sys.stderr, flush=True)
                failures.append(job)
                continue
            rows += got
            for r in got:
                print(f"[bench] {job} ({time.perf_counter() - tj:.0f} s): {r['name']}: ours {r['ours']} "
                      f"native {r['native']} {r['unit']} ratio {r['ratio']} same_loss {r['same_loss']}", flush=True)
    mem = tp_memory_row(rows)
    if mem:
        rows.append(mem)
    import torch

    meta = {
        "command": "make bench" + (" QUICK=1" if opts.quick else "") + (f" (--only {' '.join(jobs)})" if opts.only else ""),
        "wall_s": time.perf_counter() - t0, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores ({platform.processor() or cpu_model()})",
        "torch": torch.__version__, "reps": reps, "steps": steps, "warmup": warmup,
        "loadavg_start": load_start, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "latest.json").write_text(json.dumps(rows, indent=1) + "\n")
    (opts.out / "latest.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    md = markdown(rows, meta)
    (opts.out / "latest.md").write_text(md)
    readme = HERE / "README.md"
    if not opts.quick and not opts.only and opts.out.resolve() == (HERE / "results").resolve() and readme.exists():
        text = readme.read_text()  # a full run also refreshes the table in benchmarks/README.md
        begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            readme.write_text(head + begin + "\n" + md + end + rest.split(end, 1)[1])
    print()
    print(md)
    if failures:
        print(f"[bench] failed jobs: {failures}", file=sys.stderr)
        return 1
    return 0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
