"""Measured, not guessed: the memory estimate of ``--dry-run`` against what a step really holds.

    .venv/bin/python benchmarks/memory.py            # every layout x recompute mode, then timing
    .venv/bin/python benchmarks/memory.py --quick    # fewer layouts, fewer timed steps
    .venv/bin/python benchmarks/memory.py --timing-only
    .venv/bin/python benchmarks/memory.py --loss          # the chunked loss: the head's peak

For each layout (tp, tp_mode, pp and engine, cp, micro-batch, dtype) and each
``training.recompute`` mode, the product's own path (``load_config`` of configs/tiny_cpu.yaml
with overrides -> ``build_model`` / ``build_engine`` -> ``train_step``) runs one full optimizer
step on gloo ranks, and every rank measures:
* the peak bytes that autograd saves for backward over the step (``saved_tensors_hooks``: each
  storage counted once while any saved tensor holds it, parameters left out); under pp the
  engine's own meter (``PipelineEngine.last_stats.peak_activation_bytes``: the same hooks on
  each micro-batch's forward, summed over the micro-batches in flight), since the engine's
  hooks are the innermost and would hide its forwards from ours;
* its parameter, gradient and optimizer-state bytes.
The busiest rank's numbers (max over ranks) are printed beside ``estimate_memory(config)``'s,
with the ratio estimate / measured (target: within 15%). Then the time per step of each mode on
one process (CPU seconds, median of timed steps, modes interleaved), as a ratio to ``none``
(targets: full <= 1.40, selective <= 1.15).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_launch import entry, run_workers  # noqa: E402

from nanotrain.config import load_config  # noqa: E402
from nanotrain.estimate.memory import GB, estimate_memory  # noqa: E402
from nanotrain.optim import build_lr_scheduler, build_optimizer, optimizer_groups  # noqa: E402
from nanotrain.parallel.data_parallel import build_grad_sync  # noqa: E402
from nanotrain.parallel.parallel_context import destroy_process_groups  # noqa: E402
from nanotrain.training.builder import build_engine, build_model, build_parallel_context  # noqa: E402
from nanotrain.training.step import train_step  # noqa: E402

TINY = ROOT / "configs" / "tiny_cpu.yaml"
MODES = ("none", "selective", "full")
# A model whose layers, not its head, hold most of the activations (as in real models).
BASE = [
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "model.num_layers=4",
    "model.vocab_size=256",
    "training.sequence_length=128",
    "model.max_position_embeddings=128",
    "parallelism.dp=1",
    "training.micro_batch_size=2",
    "training.batch_accumulation_per_replica=4",
]
LAYOUTS = {
    "1 proc": ["parallelism.tp=1", "parallelism.pp=1"],
    "1 proc mb4 bf16": ["parallelism.tp=1", "parallelism.pp=1", "training.micro_batch_size=4", "model.dtype=bfloat16"],
    "tp2": ["parallelism.tp=2", "parallelism.pp=1"],
    "tp2 seq-par": ["parallelism.tp=2", "parallelism.pp=1", "parallelism.tp_mode=REDUCE_SCATTER"],
    "pp2 1f1b": ["parallelism.tp=1", "parallelism.pp=2"],
    "pp2 afab": ["parallelism.tp=1", "parallelism.pp=2", "parallelism.pp_engine=afab"],
    "pp2 interleaved v2": [
        "parallelism.tp=1",
        "parallelism.pp=2",
        "parallelism.pp_engine=interleaved_1f1b",
        "parallelism.pp_virtual_stages=2",
    ],
    "cp2": ["parallelism.tp=1", "parallelism.pp=1", "parallelism.cp=2"],
    "cp2 tp2 seq-par zero1": [
        "parallelism.tp=2",
        "parallelism.pp=1",
        "parallelism.cp=2",
        "parallelism.tp_mode=REDUCE_SCATTER",
        "optimizer.zero_stage=1",
    ],
    "tp2 pp2 bf16": ["parallelism.tp=2", "parallelism.pp=2", "model.dtype=bfloat16"],
}
QUICK = ("1 proc", "tp2 seq-par", "pp2 1f1b", "cp2")


class SavedTracker:
    """Peak bytes held by autograd's saved tensors: each saved tensor is packed into a holder
    whose lifetime is the saved tensor's; a storage counts while any holder of it lives."""

    def __init__(self, excluded: set[int]):
        self.excluded, self.refs, self.sizes = excluded, {}, {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        alias = t.detach()  # never the tensor itself: a node saving its own output would form a cycle
        if ptr in self.excluded or nbytes == 0:
            return alias
        return _Held(self, ptr, nbytes, alias)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def acquire(self, ptr: int, nbytes: int) -> None:
        if self.refs.get(ptr, 0) == 0:
            self.sizes[ptr] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1

    def release(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.live -= self.sizes.pop(ptr)


class _Held:
    __slots__ = ("tracker", "ptr", "tensor")

    def __init__(self, tracker: SavedTracker, ptr: int, nbytes: int, tensor: torch.Tensor):
        self.tracker, self.ptr, self.tensor = tracker, ptr, tensor
        tracker.acquire(ptr, nbytes)

    def __del__(self):
        self.tracker.release(self.ptr)


def peak_saved_bytes(model, step) -> int:
    """Peak bytes of autograd's saved tensors while ``step()`` runs (forward and backward)."""
    tracker = SavedTracker({p.untyped_storage().data_ptr() for p in model.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        step()
    return tracker.peak


class AllocatedTracker(TorchDispatchMode):
    """Peak bytes of the storages ops allocate while it is on (each once, until it is freed):
    everything a step makes, saved for backward or not; storages that existed before it (the
    parameters, the inputs) are never counted, even when an op returns a view of one. Under a
    dispatch mode autograd sums the gradients that meet at a node out of place (its in-place
    path is off for tensor subclasses and modes): measure code that does its own sums."""

    def __init__(self, existing=()):
        super().__init__()
        self.existing = {t.untyped_storage()._cdata for t in existing}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)):
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.existing or key in self.sizes:
                continue
            self.sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)


def peak_allocated_bytes(step, existing=()) -> int:
    """Peak bytes allocated while ``step()`` runs, beyond the storages of ``existing``."""
    with AllocatedTracker(existing) as tracker:
        step()
    return tracker.peak


# The chunked loss's own measurement: a head whose logits dwarf everything else (a 32k vocabulary,
# hidden 32), 2 x 1024 tokens.
LOSS_MODEL = dict(
    vocab_size=32768,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_attention_heads=4,
    max_position_embeddings=1024,
)
LOSS_BATCH, LOSS_SEQ = 2, 1024


def head_peak(dtype: str, chunk_tokens: int, tied: bool = False) -> tuple[int, float]:
    """(measured, estimated) peak bytes of one micro-batch's head (final norm, LM head, loss:
    forward and backward, one process, ``LOSS_MODEL``) with ``training.loss_chunk_tokens`` =
    ``chunk_tokens`` (0: in one piece), beyond the parameters and the hidden state it starts from;
    the estimate is ``head_saved_bytes + head_backward_bytes``, as ``--dry-run`` adds them."""
    from nanotrain.config import ModelArgs
    from nanotrain.models import llama_parallelize_costs as costs
    from nanotrain.models.llama_parallelize import build_llama

    args = ModelArgs(**LOSS_MODEL, dtype=dtype, tie_word_embeddings=tied)
    part = build_llama(args, None, seed=0, loss_chunk_tokens=chunk_tokens, compute_dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    residual = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    hidden = torch.randn(LOSS_SEQ, LOSS_BATCH, args.hidden_size, generator=gen).to(residual).requires_grad_()
    targets = torch.randint(0, args.vocab_size, (LOSS_BATCH, LOSS_SEQ), generator=gen)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = part.inner.head(hidden, targets)
        loss.backward()

    measured = peak_allocated_bytes(step, [*part.parameters(), hidden, targets])
    rows = costs.loss_chunk_rows(chunk_tokens, LOSS_SEQ * LOSS_BATCH)
    estimate = costs.head_saved_bytes(args, LOSS_SEQ, LOSS_BATCH, chunk_rows=rows) + costs.head_backward_bytes(
        args, LOSS_SEQ, LOSS_BATCH, chunk_rows=rows
    )
    return measured, estimate


def state_bytes(model, optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of this rank, each storage once."""

    def unique(tensors) -> int:
        seen = {}
        for t in tensors:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    return unique(params), unique(p.grad for p in params if p.grad is not None), unique(states)


def micro_batches(config) -> list[tuple]:
    """One step's (ids, targets) micro-batches of the config's shape, the same in every run."""
    t = config.training
    shape = (t.micro_batch_size * t.batch_accumulation_per_replica, t.sequence_length + 1)
    tokens = torch.randint(0, config.model.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    return [(mb[:, :-1], mb[:, 1:]) for mb in tokens.split(t.micro_batch_size)]


def measure(config, steps: int) -> dict:
    """One rank's numbers for one config: peak saved bytes of a step, state bytes, step time."""
    pc = build_parallel_context(config)
    try:
        return _measure(config, pc, steps)  # its model, optimizer and sync are freed on return
    finally:
        pc.destroy()


def _measure(config, pc, steps: int) -> dict:
    t = config.training
    model = build_model(config, pc)
    engine = build_engine(config, pc)
    shard_size = config.optimizer.zero_shard_size
    grad_sync = build_grad_sync(list(model.parameters()), pc, shard_size=shard_size)
    optimizer = build_optimizer(model.named_parameters(), config.optimizer, **optimizer_groups(pc, shard_size))
    scheduler = build_lr_scheduler(optimizer, config.optimizer, steps + 2)
    micro = micro_batches(config)

    def step():
        return train_step(
            model,
            micro,
            grad_sync,
            optimizer,
            scheduler,
            pc,
            config.optimizer.clip_grad,
            engine,
            model.pipeline_message(t.micro_batch_size, t.sequence_length),
        )

    step()  # warm-up: optimizer states exist, caches are built
    if engine is None:
        saved = peak_saved_bytes(model, step)
    else:  # the engine meters its micro-batches in flight with saved-tensor hooks of its own
        step()
        saved = engine.last_stats.peak_activation_bytes
    params, grads, states = state_bytes(model, optimizer)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step().loss
        times.append(time.perf_counter() - t0)
    numbers = torch.tensor([saved, params, grads, states, statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX)  # the busiest rank, the slowest rank
    return dict(zip(("saved", "params", "grads", "optimizer", "step_s"), numbers.tolist()))


def config_for(layout: str, mode: str, extra=()):
    return load_config(TINY, [*BASE, *LAYOUTS.get(layout, []), *extra, f"training.recompute={mode}"])


def worker(payload: dict) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {
        mode: measure(config_for(payload["layout"], mode, payload.get("extra", ())), payload["steps"]) for mode in MODES
    }
    destroy_process_groups()
    return results


TIMING = [
    "model.hidden_size=256",
    "model.intermediate_size=1024",
    "training.sequence_length=256",
    "model.max_position_embeddings=256",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
]


def time_modes(extra: list[str], steps: int) -> dict:
    """CPU seconds per optimizer step of each mode in this process (one thread), the modes
    interleaved step by step so that a neighbour's load hits all of them alike; and the peak
    saved bytes of one step."""
    torch.set_num_threads(1)
    runs = {}
    for mode in MODES:
        config = config_for("1 proc", mode, extra)
        model = build_model(config, None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        micro = micro_batches(config)

        def step(model=model, optimizer=optimizer, micro=micro):
            for ids, targets in micro:
                (model(ids, targets) / len(micro)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        step()  # warm-up
        runs[mode] = {"step": step, "saved": peak_saved_bytes(model, step), "times": []}
    for _ in range(steps):
        for mode in MODES:
            t0 = time.process_time()
            runs[mode]["step"]()
            runs[mode]["times"].append(time.process_time() - t0)
    return {mode: {"step_s": statistics.median(r["times"]), "saved": r["saved"]} for mode, r in runs.items()}


def estimate_row(config) -> dict:
    est = estimate_memory(config)
    return {
        "saved": est.saved_activations * GB,
        "params": est.weights * GB,
        "grads": est.grads * GB,
        "optimizer": est.optimizer * GB,
    }


def run_layout(layout: str, steps: int, extra=()) -> dict:
    world = config_for(layout, "none", extra).parallelism.world_size
    return run_workers(__file__, world, {"layout": layout, "steps": steps, "extra": list(extra)}, 1800)


def loss_table() -> int:
    """The head's peak (``head_peak``) in one piece and in 4 and 8 chunks, fp32 and bf16 autocast,
    measured and estimated; 0 when every estimate is within 2% and each chunked peak at most the
    one-piece peak over the chunk count plus what does not scale with the chunk (the fp32 sum of
    the LM head weight's gradients, a chunk's weight copy under autocast, two hidden states)."""
    torch.set_num_threads(1)
    tokens, hidden, vocab = LOSS_SEQ * LOSS_BATCH, LOSS_MODEL["hidden_size"], LOSS_MODEL["vocab_size"]
    print(f"The head at vocabulary {vocab}, hidden {hidden}, {LOSS_BATCH} x {LOSS_SEQ} tokens, one process (CPU):\n")
    print("| dtype | training.loss_chunk_tokens | chunks | peak MiB measured | estimate | ratio | vs one piece |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for dtype in ("float32", "bfloat16"):
        value = 2 if dtype == "bfloat16" else 4
        fixed = vocab * hidden * (4 + (value if value < 4 else 0)) + 2 * tokens * hidden * value
        whole = None
        for chunks in (1, 4, 8):
            measured, estimate = head_peak(dtype, 0 if chunks == 1 else tokens // chunks)
            whole = measured if whole is None else whole
            ok &= abs(estimate / measured - 1) <= 0.02 and measured <= whole / chunks + fixed
            setting = 0 if chunks == 1 else tokens // chunks
            print(
                f"| {dtype} | {setting} | {chunks} | {measured / 2**20:.1f} | {estimate / 2**20:.1f} | "
                f"{estimate / measured:.3f} | {measured / whole:.3f} |"
            )
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}; 2 timed steps")
    parser.add_argument("--timing-only", action="store_true", help="skip the memory table")
    parser.add_argument("--loss", action="store_true", help="only the chunked loss's table (head_peak)")
    opts = parser.parse_args()
    if opts.loss:
        return loss_table()
    layouts = () if opts.timing_only else QUICK if opts.quick else tuple(LAYOUTS)
    t0 = time.perf_counter()
    worst = 0.0
    print(
        "| layout | recompute | saved MB measured | estimate | ratio | params+grads+optimizer MB measured | "
        "estimate | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for layout in layouts:
        measured = run_layout(layout, 1)
        for mode in MODES:
            m, e = measured[mode], estimate_row(config_for(layout, mode))
            state_m = m["params"] + m["grads"] + m["optimizer"]
            state_e = e["params"] + e["grads"] + e["optimizer"]
            worst = max(worst, abs(e["saved"] / m["saved"] - 1), abs(state_e / state_m - 1))
            print(
                f"| {layout} | {mode} | {m['saved'] / 2**20:.2f} | {e['saved'] / 2**20:.2f} | "
                f"{e['saved'] / m['saved']:.3f} | {state_m / 2**20:.2f} | {state_e / 2**20:.2f} | "
                f"{state_e / state_m:.3f} |"
            )
    # Time per step on one process, a model whose matmuls dominate (hidden 256, seq 256).
    steps = 3 if opts.quick else 8
    timing = time_modes(TIMING, steps)
    print(
        f"\nTime per step, one process, hidden 256, 4 layers, seq 256, 4 micro-batches of 2: CPU seconds of "
        f"this process (not wall: the machine is shared), median of {steps}, the modes interleaved step by step:\n"
    )
    print("| recompute | CPU s/step | vs none | saved MB | vs none | target |")
    print("|---|---|---|---|---|---|")
    targets = {"none": 1.0, "selective": 1.15, "full": 1.40}
    met = worst <= 0.15
    for mode in MODES:
        r, base = timing[mode], timing["none"]
        ratio = r["step_s"] / base["step_s"]
        met &= ratio <= targets[mode]
        print(
            f"| {mode} | {r['step_s']:.3f} | {ratio:.2f} | {r['saved'] / 2**20:.1f} | "
            f"{r['saved'] / base['saved']:.2f} | <= {targets[mode]:.2f} |"
        )
    print(
        f"\nworst estimate error {100 * worst:.1f}% (target 15%); {os.cpu_count()} CPU cores, gloo, 1 thread per "
        f"rank; {time.perf_counter() - t0:.0f} s"
    )
    return 0 if met else 1


if __name__ == "__main__":
    entry(main, worker)
