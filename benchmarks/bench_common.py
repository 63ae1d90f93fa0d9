"""The measuring harness shared by every row of ``vs_native.py``: the one model / optimizer / batch
setting both sides train with, the timing loop that alternates them (``Bench``), and the meters
(saved-for-backward bytes, max over ranks).

Kept apart from the two sides (``bench_sides.py``) and the jobs (``vs_native.py``) so that what is
measured and how it is measured can be read, and changed, in one place for all rows.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # nanotrain
sys.path.insert(0, str(HERE))  # native_llama, the other bench_* modules

# The research setting (benchmarks/README.md): ~1 M parameters, 16 sequences of
# 64 tokens = 1,024 tokens per optimizer step (strong scaling: dp splits the batch).
MODEL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=512,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    dtype="float32",
)
# Checkpoint rows: a bigger model, so that the bytes (not fixed costs) dominate: ~13 M parameters,
# ~155 MB of weights + AdamW states.
CKPT_MODEL = dict(
    vocab_size=4096,
    hidden_size=384,
    intermediate_size=1024,
    num_layers=6,
    num_attention_heads=6,
    num_key_value_heads=6,
    max_position_embeddings=64,
    dtype="float32",
)
OPTIM = dict(
    lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, clip_grad=1.0, warmup_steps=0, lr_decay_style="constant"
)
SEQ, GLOBAL_SEQS, MICRO_SEQS, PP_M, SEED = 64, 16, 8, 8, 1
SAME_LOSS_RTOL = 1e-4


# ============================================================================ worker-side helpers
def drop_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation, redistribution and mesh-topology caches.

    Why: their entries hold DTensor specs, the specs hold the DeviceMesh, and the mesh holds its
    process groups, so a job's groups would outlive ``destroy_process_group()`` and be torn down
    during interpreter shutdown (see ``nanotrain.parallel.parallel_context.destroy_process_groups``)."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def preimport() -> None:
    """Import, before a worker creates any process group, every module its jobs import lazily.

    Why: importing torch._dynamo (which the model, DTensor, pipelining and FSDP pull in) while a
    default process group exists takes references to that group which live until interpreter
    exit, so the group (and its gloo threads, and rank 0's TCPStore server) would outlive
    ``destroy_process_group()`` and be torn down during interpreter shutdown."""
    import importlib

    for name in (
        "nanotrain.models.llama",
        "nanotrain.training.step",
        "nanotrain.optim",
        "nanotrain.checkpoint",
        "nanotrain.parallel.parallel_context",
        "nanotrain.parallel.data_parallel",
        "nanotrain.parallel.pipeline_parallel",
        "native_llama",
        "torch.distributed.device_mesh",
        "torch.distributed.tensor",
        "torch.distributed.tensor.parallel",
        "torch.distributed.pipelining",
        "torch.distributed.fsdp",
        "torch.distributed._composable.replicate_with_fsdp",
        "torch.distributed.checkpoint.state_dict",
        "torch.profiler",
    ):
        importlib.import_module(name)


class Bench:
    """What a job's functions share: settings, the batches, the timing loop."""

    def __init__(self, reps: int, steps: int, warmup: int):
        import torch

        self.reps, self.steps, self.warmup = reps, steps, warmup
        self.total_steps = 2 * (warmup + reps * steps) + 8
        gen = torch.Generator().manual_seed(0)
        self.batches = [torch.randint(0, MODEL["vocab_size"], (GLOBAL_SEQS, SEQ + 1), generator=gen) for _ in range(8)]

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
        path.write_text(
            f"{side}: {steps} steps under the profiler: {1e3 * wall:.1f} ms wall, "
            f"{1e3 * cpu:.1f} ms process CPU per step\n\n{table}\n"
        )

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
            "name": name,
            "ours": round(tokens / s_ours, 1),
            "native": round(tokens / s_nat, 1),
            "unit": "tokens/s",
            "ratio": round(s_nat / s_ours, 3),
            "target": target,
            "same_loss": bool(rel[0] <= SAME_LOSS_RTOL),
            "loss_ours": lo[0],
            "loss_native": ln[0],
            "loss_rel_first": rel[0],
            "loss_rel_max": max(rel[:n_warm]),
            "ratio_paired": round(paired, 3),
            "ms_ours": round(1e3 * s_ours, 2),
            "ms_native": round(1e3 * s_nat, 2),
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
    mine = batch[dp_rank * per : (dp_rank + 1) * per]
    return [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(micro)]


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
        # A detached alias, never ``t`` itself: a node saving its own output would hold it with
        # its grad_fn, a cycle through C++ that no collector frees; this forward is never run
        # backward, so the graph (and the process groups its collectives' contexts hold) would
        # live until interpreter shutdown.
        self._count(t)
        return t.detach()

    def __enter__(self):
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def saved_bytes(model, ids, targets) -> int:
    """Bytes autograd saves in one forward of ``model`` on ``ids``/``targets`` (``SavedBytes``);
    the graph is dropped without a backward."""
    with SavedBytes([model]) as meter:
        loss = model(ids, targets)
    del loss
    return meter.bytes


def max_over_ranks(value: float, group=None) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()
