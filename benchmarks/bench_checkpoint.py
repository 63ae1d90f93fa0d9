"""The checkpoint rows of ``vs_native.py``: save / load of a tp2 model + AdamW states with
nanotrain's ``save_checkpoint`` / ``load_checkpoint`` against ``torch.distributed.checkpoint``,
and against a raw sequential write of the same bytes.

A job of its own module because it is unlike the throughput rows: a bigger model
(``CKPT_MODEL``), file-system timing instead of training steps, and a correctness check that the
loaded states reproduce the saved loss and the next training step on both sides.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import CKPT_MODEL, OPTIM, SAME_LOSS_RTOL, SEED, SEQ, Bench, max_over_ranks, model_args
from bench_sides import Ours, native_clip_, native_optimizer, plain_loss


def job_checkpoint(b: Bench) -> list[dict]:
    """tp2, ~13 M parameters + AdamW states after one training step on each side."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from native_llama import apply_tp, build_native, cross_entropy
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

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
        load_checkpoint(
            dirs["ours"], ours_fresh.model, ours_fresh.optimizer, ours_fresh.scheduler, ours_fresh.pc, load_rng=False
        )

    def native_save():
        msd, osd = get_state_dict(native[0], native[1])
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(dirs["native"] / "ckpt"))

    def native_load():
        msd, osd = get_state_dict(native_fresh[0], native_fresh[1])
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(dirs["native"] / "ckpt"))
        set_state_dict(
            native_fresh[0], native_fresh[1], model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

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

    same = (
        rel(first[0], first[1]) <= SAME_LOSS_RTOL
        and rel(loaded[0], ref[0]) <= 1e-6
        and rel(loaded[1], ref[1]) <= 1e-6
        and rel(loaded[0], loaded[1]) <= SAME_LOSS_RTOL
        and rel(after[0], after_ref[0]) <= 1e-6
        and rel(after[1], after_ref[1]) <= 1e-6
    )
    mb = total_bytes / 1e6
    med = {k: statistics.median(v) for k, v in save.items()}
    medl = {k: statistics.median(v) for k, v in load.items()}
    common = {
        "same_loss": bool(same),
        "state_MB": round(mb, 1),
        "loss_before_save": ref,
        "loss_after_load": loaded,
        "loss_step_after_load": after,
        "loss_step_reference": after_ref,
    }
    return [
        {
            "name": "checkpoint save (tp2, 13 M params + AdamW) vs torch.distributed.checkpoint",
            "ours": round(mb / med["ours"], 1),
            "native": round(mb / med["native"], 1),
            "unit": "MB/s",
            "ratio": round(med["native"] / med["ours"], 3),
            "target": None,
            "s_ours": [round(s, 4) for s in save["ours"]],
            "s_native": [round(s, 4) for s in save["native"]],
            **common,
        },
        {
            "name": "checkpoint load (tp2, same state) vs torch.distributed.checkpoint",
            "ours": round(mb / medl["ours"], 1),
            "native": round(mb / medl["native"], 1),
            "unit": "MB/s",
            "ratio": round(medl["native"] / medl["ours"], 3),
            "target": None,
            "s_ours": [round(s, 4) for s in load["ours"]],
            "s_native": [round(s, 4) for s in load["native"]],
            **common,
        },
        {
            "name": "checkpoint save vs raw sequential write of the same bytes (+fsync)",
            "ours": round(mb / med["ours"], 1),
            "native": round(mb / med["raw"], 1),
            "unit": "MB/s",
            "ratio": round(med["raw"] / med["ours"], 3),
            "target": None,
            "columns": ["nanotrain", "raw write"],
            "s_raw": [round(s, 4) for s in save["raw"]],
            **common,
        },
    ]
