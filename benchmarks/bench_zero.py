"""The ZeRO rows of ``vs_native.py``: nanotrain ZeRO-2 at dp2 against PyTorch's FSDP2
(``fully_shard`` per decoder layer and the root, ``reshard_after_forward=False``), and the
per-rank bytes of parameters + gradients + optimizer states at ZeRO-0, 1 and 2.

Why FSDP2 with ``reshard_after_forward=False``: it keeps the unsharded parameters from the
forward to the backward and reduce-scatters the gradients into sharded ones after every
backward, with sharded AdamW states: ZeRO-2's communication (one reduce-scatter of the gradients
per micro-batch, one all-gather of the parameters per step). It differs in one thing: after the
backward it frees the unsharded parameters (they are all-gathered again before the next forward),
so between steps it holds 1/n of the parameters where ZeRO-2 holds them all.

Kept out of ``vs_native.py`` so that no file outgrows one reading; the jobs here are registered in
its ``JOBS`` like the others.
"""

from __future__ import annotations

import statistics

from bench_common import GLOBAL_SEQS, MICRO_SEQS, OPTIM, SEED, SEQ, Bench, max_over_ranks, micro_batches, model_args
from bench_sides import Ours, native_clip_, native_optimizer

ROTATIONS = 3  # runs of the A B A B timing, the side that goes first alternating between runs


class NativeFSDP2:
    """FSDP2 ``fully_shard`` over the dp ranks: every decoder layer, then the root;
    ``torch.optim.AdamW`` over the sharded DTensor parameters (sharded states). ``reshard``:
    ``reshard_after_forward`` of every module, False = the ZeRO-2 setting, True = ZeRO-3 (the
    root too, explicitly: left to its default FSDP2 keeps the root's parameters from the forward
    to the backward, where nanotrain's ZeRO-3 releases the embedding and head units).

    ``prefetch``: nanotrain ZeRO-3's gather schedule, which FSDP2 does not take by default on CPU:
    its all-gathers are synchronous there (the overlap it gets on CUDA comes from side streams), so
    each layer would wait for its own gather. With it the gathers are posted asynchronously, the
    next layer's while one runs forward, the previous layer's while one runs backward (FSDP2's
    explicit prefetching), as ``ParamGather`` posts them."""

    def __init__(self, bench: Bench, dp: int, micro=MICRO_SEQS, reshard: bool = False, prefetch: bool = False):
        import torch.distributed as dist
        from native_llama import build_native
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.bench, self.dp, self.micro = bench, dp, micro
        self.dp_rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        self.model = build_native(model_args(), SEQ, SEED)
        for layer in self.model.layers.values():
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=reshard)
        if prefetch:
            layers = list(self.model.layers.values())
            self.model._set_unshard_async_op(True)  # private in torch 2.13; documented for this use
            self.model.set_modules_to_forward_prefetch(layers[:1])
            self.model.set_modules_to_backward_prefetch(layers[-1:])
            for a, b in zip(layers, layers[1:]):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
        self.optimizer, self.scheduler = native_optimizer([self.model], bench)

    def step(self, i: int) -> float:
        import torch.distributed as dist
        from native_llama import cross_entropy

        micro = micro_batches(self.bench.batch(i), self.dp_rank, self.dp, self.micro)
        total = None
        for x, y in micro:  # FSDP2 reduce-scatters after every backward, as ZeRO-2 does
            loss = cross_entropy(self.model(x), y) / len(micro)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        native_clip_(list(self.model.parameters()), OPTIM["clip_grad"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        dist.all_reduce(total)  # the global batch's loss, as nanotrain's train_step returns
        return (total / self.dp).item()


# ------------------------------------------------------------------------------ measured bytes
def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard), each
    counted once: views of one flat buffer count as that buffer."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def state_bytes(model, optimizer, grad_sync=None) -> dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes as they are stored now.

    Gradients: every ``.grad`` plus, with nanotrain's sync, its bucket buffers (ZeRO-0/1: the
    full flat gradient; ZeRO-2: the full buffers alive at this moment) and the ZeRO-2/3 owned
    accumulator; at ZeRO-3 the parameters' full buffers are released between steps (0 bytes) and
    the owned pieces (each domain's ``store.shard``) are what persists; storages shared by several
    of them are counted once."""
    params = list(model.parameters())
    params += [d.store.shard for d in getattr(optimizer, "domains", ()) if getattr(d, "store", None) is not None]
    grads = [p.grad for p in params]
    for sync in getattr(grad_sync, "syncs", [grad_sync] if grad_sync is not None else []):  # a GradSyncSet: each
        grads += [b.buffer for b in sync.buckets]
        if sync.accumulator is not None:
            grads.append(sync.accumulator.flat)
    states = [v for s in optimizer.state.values() for k, v in s.items() if k != "step" and hasattr(v, "shape")]
    out = {"params": storage_bytes(params), "grads": storage_bytes(grads), "optim": storage_bytes(states)}
    out["total"] = sum(out.values())
    return out


def peak_full_buffers(accumulator) -> int:
    """ZeRO-2: the most bytes of full-size bucket buffers alive at once in the last step (from the
    accumulator's alloc/free log), the transient on top of the owned accumulator."""
    live = peak = 0
    for kind, _, nbytes in accumulator.buffer_log:
        live += nbytes if kind == "alloc" else -nbytes
        peak = max(peak, live)
    return peak


def max_bytes(d: dict[str, int]) -> dict[str, int]:
    return {k: int(max_over_ranks(v)) for k, v in d.items()}


# ------------------------------------------------------------------------------------ the job
def rotated_throughput(b: Bench, ours: Ours, native: NativeFSDP2, name: str) -> dict:
    """``ROTATIONS`` runs of the alternating timing, ours first in even runs and native first in
    odd ones; the row is the run with the median ratio, every run's ratio and losses kept."""
    rows = []
    for k in range(ROTATIONS):
        order = [("ours", ours.step), ("native", native.step)]
        r = b.alternate(dict(order if k % 2 == 0 else order[::-1]))
        rows.append(b.throughput_row("", r, GLOBAL_SEQS * SEQ, 1.0))
    ratios = [r["ratio"] for r in rows]
    row = dict(sorted(rows, key=lambda r: r["ratio"])[len(rows) // 2])
    first = rows[0]  # identical initial weights: the first step of the first run decides same_loss
    row.update(
        name=name,
        ratio=round(statistics.median(ratios), 3),
        ratio_paired=round(statistics.median(r["ratio_paired"] for r in rows), 3),
        same_loss=first["same_loss"],
        loss_ours=first["loss_ours"],
        loss_native=first["loss_native"],
        loss_rel_first=first["loss_rel_first"],
        loss_rel_max=max(r["loss_rel_max"] for r in rows),
        loss_rel_first_per_run=[r["loss_rel_first"] for r in rows],
        rotation_ratios=ratios,
        rotation_order=["ours first" if k % 2 == 0 else "native first" for k in range(ROTATIONS)],
        note=f"median of {ROTATIONS} runs, the side going first rotated; same_loss: the first step of the first run",
    )
    return row


def _memory_rows(b: Bench, native: NativeFSDP2) -> list[dict]:
    """Per-rank bytes after two training steps (resident between steps), max over the ranks."""
    measured = {}
    for zero in (0, 1, 2):
        side = Ours(b, dp=2, zero=zero)
        for i in range(2):
            side.step(i)
        measured[zero] = max_bytes(state_bytes(side.model, side.optimizer, side.grad_sync))
        if zero == 2:
            transient = int(max_over_ranks(peak_full_buffers(side.grad_sync.accumulator)))
        del side
    fsdp = max_bytes(state_bytes(native.model, native.optimizer))
    rows = []
    for zero, analytic in ((2, 10 / 16), (1, 12 / 16)):
        m, z0 = measured[zero], measured[0]
        row = {
            "name": f"memory: params + grads + AdamW states per rank, ZeRO-{zero} vs ZeRO-0 (dp2, between steps)",
            "ours": m["total"],
            "native": z0["total"],
            "unit": "bytes",
            "ratio": round(m["total"] / z0["total"], 3),
            "target": round(analytic + 0.005, 3),  # fp32: (4 + 4 + 8) / 16 unsharded; + padding
            "lower_is_better": True,
            "same_loss": None,
            "columns": [f"nanotrain ZeRO-{zero}", "nanotrain ZeRO-0"],
            "bytes_by_kind": {f"zero{z}": measured[z] for z in (0, 1, 2)},
            "note": f"storages counted once, max over ranks; analytic {analytic:.3f} (fp32 params 4 B, "
            "grads 4 B, AdamW 8 B per element; sharded parts / 2)",
        }
        if zero == 2:
            row["zero2_peak_full_bucket_bytes"] = transient
            row["fsdp2_bytes_by_kind"] = fsdp
        rows.append(row)
    return rows


def job_zero2(b: Bench) -> list[dict]:
    b.total_steps *= ROTATIONS  # one LR schedule across the rotated runs
    ours, native = Ours(b, dp=2, zero=2), NativeFSDP2(b, dp=2)
    name = "dp2 ZeRO-2 vs FSDP2 fully_shard (per layer + root, reshard_after_forward=False)"
    row = rotated_throughput(b, ours, native, name)
    del ours
    return [row, *_memory_rows(b, native)]
