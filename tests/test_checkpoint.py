"""Sharded checkpoints: exact round trips, resharding across (dp, tp, pp, ZeRO), continued
training, atomic commit under SIGKILL, checksum fallback, keep_last, no pickle.

Few process launches, each doing many checks (a launch costs seconds of torch imports on 2 cores):
  * dp2 x tp2, ZeRO-0 and ZeRO-1: N steps, save, M more steps (the uninterrupted reference), a
    newer checkpoint with one file altered / truncated that only some ranks read; a fresh model
    loads: every rank falls back to step N together, the warning names the file; params,
    optimizer states, scheduler, lr and RNG are restored bit-exactly and the M steps give `==`
    losses. Loads run with pickle.load(s)/Unpickler/torch.load patched to raise;
  * dp2 x tp2, ZeRO-2: the same round trip (ZeRO-1's partition and files; no gradient state);
  * dp2 x pp2 (1f1b engine), tied embeddings, ZeRO-1: the same round trip;
  * tp4 (ZeRO-1 at dp1), dp4 (ZeRO-0), one process: load the dp2 x tp2 ZeRO-1 checkpoint; full
    params and optimizer states equal the saved ones exactly, M steps continue within rel 1e-5;
    tp4 also loads the copy written by scripts/reshard_checkpoint.py (no resharding needed);
    dp4 also loads the ZeRO-1 checkpoint at ZeRO-2 and the ZeRO-2 one at ZeRO-1, one process the
    ZeRO-2 one at ZeRO-0 (continued losses within 1e-6);
    one process also loads the dp2 x pp2 tied checkpoint;
  * 2 ranks, one SIGKILLed while writing; single-process kills at every stage of the commit.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from nanotrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from nanotrain.checkpoint.reshard import read_full_state
from nanotrain.config import Config, ParallelismArgs
from nanotrain.parallel.sharding import gather_full, get_shard_info

from helpers.checkpoints import damage, tiny, tiny_step
from helpers.dist import run_distributed
from helpers.models import GLOBAL_BATCH, MICRO_BATCH, MODEL, OPTIM, global_batch

N, M = 3, 3  # steps before the checkpoint, steps after it
TOTAL = N + M
REPO = Path(__file__).resolve().parents[1]


def config_for(dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, model=MODEL) -> Config:
    return Config(
        parallelism=ParallelismArgs(dp=dp, tp=tp, pp=pp), model=model, optimizer=replace(OPTIM, zero_stage=zero)
    )


# ----------------------------------------------------------------------------- helpers in ranks
# vocab 1024: the embedding is larger than half a stage, so the ZeRO-1 boundary cuts it at a
# different element on each stage and the replica's optimizer ranges differ from the original's.
TIED = replace(MODEL, tie_word_embeddings=True, vocab_size=1024)


@dataclass
class Run:
    model: torch.nn.Module
    grad_sync: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    engine: object
    args: object
    dp_group: object  # the ranks the optimizer states are sharded over (a block under hybrid sharding)


def setup(pc, zero: int, seed: int = 5, args=MODEL, shard: int | None = None) -> Run:
    """``shard``: hybrid sharding in blocks of that many dp ranks (``optimizer.zero_shard_size``)."""
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer
    from nanotrain.parallel.data_parallel import build_grad_sync
    from nanotrain.parallel.data_parallel.hybrid import shard_groups
    from nanotrain.parallel.pipeline_parallel import PipelineEngine

    model = build_llama(args, pc.tp_pg, pp_rank=pc.pp_rank, pp_size=pc.pp_size, seed=seed)
    grad_sync = build_grad_sync(list(model.parameters()), pc, bucket_cap_mb=0.05, shard_size=shard)
    group = shard_groups(pc, "dp_cp_ep", shard).shard if shard else pc.dp_cp_pg
    optimizer = build_optimizer(model.named_parameters(), OPTIM, group, zero_stage=zero)
    scheduler = build_lr_scheduler(optimizer, OPTIM, TOTAL)
    engine = PipelineEngine("1f1b", pc.pp_pg) if pc.pp_size > 1 else None
    return Run(model, grad_sync, optimizer, scheduler, engine, args, group)


def steps(run: Run, pc, start: int, stop: int) -> list[float]:
    from nanotrain.training.step import train_step

    per = GLOBAL_BATCH // pc.dp_size
    losses = []
    for step in range(start, stop):
        mine = global_batch(step)[pc.dp_rank * per : (pc.dp_rank + 1) * per]
        micro = [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO_BATCH)]
        losses.append(
            train_step(
                run.model, micro, run.grad_sync, run.optimizer, run.scheduler, pc, OPTIM.clip_grad, engine=run.engine
            ).loss
        )
    return losses


def save(root, step, run: Run, pc, zero, **kw):
    extra = {"consumed_samples": step * GLOBAL_BATCH, "consumed_tokens": step * GLOBAL_BATCH * 16}
    return save_checkpoint(
        root,
        step,
        run.model,
        run.optimizer,
        run.scheduler,
        pc,
        extra=extra,
        config=config_for(pc.dp_size, pc.tp_size, pc.pp_size, zero, run.args),
        **kw,
    )


def load(root, run: Run, pc, zero, **kw):
    return load_checkpoint(
        root,
        run.model,
        run.optimizer,
        run.scheduler,
        pc,
        config=config_for(pc.dp_size, pc.tp_size, pc.pp_size, zero, run.args),
        **kw,
    )


def snapshot(run: Run) -> dict:
    """This rank's exact state: local params, optimizer entries, scheduler, lr."""
    from nanotrain.optim import optimizer_state_by_name
    from nanotrain.parallel.data_parallel.shard_params import full_parameters

    with full_parameters(run.model.parameters()):  # ZeRO-3: gathered (below: as they are)
        params = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    return {
        "params": params,
        "optim": {
            n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for n, s in optimizer_state_by_name(run.optimizer).items()
        },
        "sched": run.scheduler.state_dict(),
        "lr": [g["lr"] for g in run.optimizer.param_groups],
    }


def assert_same_snapshot(a: dict, b: dict, label: str) -> None:
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), f"{label}: param {n}"
    assert a["optim"].keys() == b["optim"].keys()
    for n in a["optim"]:
        for k, v in a["optim"][n].items():
            w = b["optim"][n][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, f"{label}: optimizer {n}.{k}"
    assert a["sched"] == b["sched"], label
    assert a["lr"] == b["lr"], label


def rng_draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def full_state(run: Run, pc, zero: int) -> dict:
    """Full (unsharded) params and AdamW states of this pp stage, put together here with
    collectives, without the checkpoint code: the reference the checkpoints are compared to."""
    from nanotrain.optim import optimizer_state_by_name
    from nanotrain.parallel.data_parallel.shard_params import full_parameters

    states = optimizer_state_by_name(run.optimizer)
    params, optim = {}, {}
    with full_parameters(run.model.parameters()):  # ZeRO-3: gathered (below: as they are)
        whole = {name: p.detach().clone() for name, p in run.model.named_parameters()}
    for name, p in run.model.named_parameters():
        info = get_shard_info(p)
        params[name] = gather_full(whole[name], info, pc.tp_pg)
        s = states.get(name)
        entry = {}
        for k in ("exp_avg", "exp_avg_sq"):
            flat = torch.zeros(p.numel(), dtype=p.dtype)
            if s is not None:
                flat[s["start"] : s["stop"]] = s[k].reshape(-1)
            if zero >= 1 and pc.dp_size > 1:
                dist.all_reduce(flat, group=run.dp_group)
            entry[k] = gather_full(flat.view(p.shape), info, pc.tp_pg)
        step = torch.tensor([float(s["step"]) if s is not None else 0.0])
        if pc.dp_size > 1:
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=pc.dp_cp_pg)
        entry["step"] = step.reshape(())
        optim[name] = entry
    return {"params": params, "optim": optim}


def assert_full_equal(got: dict, ref: dict, label: str) -> None:
    assert got["params"].keys() == ref["params"].keys(), label
    for n, t in ref["params"].items():
        assert torch.equal(got["params"][n], t), f"{label}: param {n}"
    assert got["optim"].keys() == ref["optim"].keys(), label
    for n, st in ref["optim"].items():
        for k, t in st.items():
            assert torch.equal(got["optim"][n][k].reshape(t.shape), t), f"{label}: optimizer {n}.{k}"


@contextmanager
def forbid_pickle():
    """Any unpickling (or torch.load) inside the block raises."""
    import pickle

    import torch.distributed.distributed_c10d as c10d

    def refuse(*a, **k):
        raise AssertionError("pickle/torch.load used while loading a checkpoint")

    class Refuse:
        def __init__(self, *a, **k):
            refuse()

    saved = [
        (pickle, "load", pickle.load),
        (pickle, "loads", pickle.loads),
        (pickle, "Unpickler", pickle.Unpickler),
        (torch, "load", torch.load),
    ]
    if hasattr(c10d, "_unpickler"):
        saved.append((c10d, "_unpickler", c10d._unpickler))
    for mod, name, _ in saved:
        setattr(mod, name, Refuse if name in ("Unpickler", "_unpickler") else refuse)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


@contextmanager
def captured_warnings():
    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    logger = logging.getLogger("nanotrain.checkpoint")
    handler = Handler()
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


# ----------------------------------------------------------------------------- launch bodies
def same_topology_round_trip(pc, root: str, zero: int, damaged_file: str, how: str, args=MODEL) -> dict:
    """Train N, save (clean root and fallback root); train M more (reference), save a newer
    checkpoint and damage one of its files; a fresh model loads: falls back to N, exact."""
    clean, fallback = Path(root) / f"z{zero}", Path(root) / f"z{zero}_fallback"
    run = setup(pc, zero, args=args)
    first = steps(run, pc, 0, N)
    save(clean, N, run, pc, zero)
    save(fallback, N, run, pc, zero)
    saved = snapshot(run)
    draws = rng_draws()  # what the RNGs give right after the save
    ref = full_state(run, pc, zero)
    rest = steps(run, pc, N, TOTAL)
    save(fallback, TOTAL, run, pc, zero)
    if pc.world_rank == 0:
        damage(fallback / f"step_{TOTAL:06d}" / damaged_file, how)
    dist.barrier()

    fresh = setup(pc, zero, seed=99, args=args)
    rng_draws()  # move the RNGs on
    with forbid_pickle(), captured_warnings() as warned:
        res = load(fallback, fresh, pc, zero)
    assert res.step == N and res.path.name == f"step_{N:06d}", res
    assert not res.resharded and res.rng_restored
    assert res.extra == {"consumed_samples": N * GLOBAL_BATCH, "consumed_tokens": N * GLOBAL_BATCH * 16}
    assert len(res.skipped) == 1 and damaged_file in res.skipped[0], res.skipped
    if pc.world_rank == 0:
        assert any(damaged_file in w and "falling back" in w for w in warned), warned
    assert rng_draws() == draws, "RNG states not restored exactly"
    assert_same_snapshot(snapshot(fresh), saved, f"zero{zero} round trip")
    again = steps(fresh, pc, N, TOTAL)
    assert again == rest, f"zero{zero}: resumed losses {again} != uninterrupted {rest}"
    return {"losses": first + rest, "ref": ref if pc.dp_rank == 0 else None}


def launch_dp2_tp2(root: str) -> dict:
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(tensor_parallel_size=2, data_parallel_size=2)
    out = {}
    # ZeRO-1: rank 3 (dp1, tp1) alone reads this optimizer range; ZeRO-0: tp rank 1 reads its model shard.
    out[1] = same_topology_round_trip(pc, root, 1, "optimizer/pp-00_tp-01_dp-01.safetensors", "flip")
    out[0] = same_topology_round_trip(pc, root, 0, "model/pp-00_tp-01.safetensors", "truncate")
    # ZeRO-2: the same partition as ZeRO-1, so the same files; its gradients never reach a file
    out[2] = same_topology_round_trip(pc, root, 2, "optimizer/pp-00_tp-00_dp-01.safetensors", "truncate")
    # ZeRO-3: the same files again (parameters written whole, gathered a layer at a time)
    out[3] = same_topology_round_trip(pc, root, 3, "model/pp-00_tp-01.safetensors", "flip")
    pc.destroy()
    return out


def reshard_load(
    pc, src_root: str, zero: int, out_root: str, offline_root: str | None = None, args=MODEL, shard=None
) -> dict:
    run = setup(pc, zero, seed=99, args=args, shard=shard)
    with forbid_pickle(), captured_warnings() as warned:
        res = load(src_root, run, pc, zero)
    assert res.step == N and res.resharded and not res.rng_restored and res.rank_state is None, res
    assert res.extra["consumed_samples"] == N * GLOBAL_BATCH
    if pc.world_rank == 0:
        assert any("RNG states are not restored" in w for w in warned), warned
    got = full_state(run, pc, zero)
    save(out_root, N, run, pc, zero)
    losses = steps(run, pc, N, TOTAL)
    offline = None
    if offline_root is not None:  # written by scripts/reshard_checkpoint.py for this very topology
        other = setup(pc, zero, seed=98, args=args)
        with forbid_pickle():
            r2 = load(offline_root, other, pc, zero)
        assert r2.step == N and not r2.resharded and not r2.rng_restored
        offline = full_state(other, pc, zero)
    return {"full": got, "losses": losses, "offline": offline} if pc.world_rank == 0 else {}


def launch_reshard(src_root: str, dp: int, tp: int, zero: int, out_root: str, offline_root=None) -> dict:
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(tensor_parallel_size=tp, data_parallel_size=dp)
    out = reshard_load(pc, src_root, zero, out_root, offline_root)
    pc.destroy()
    return out


def launch_dp4(z1_root: str, z2_root: str, out_root: str, z3_root: str) -> dict:
    """dp4: the dp2 x tp2 ZeRO-1 checkpoint loaded at ZeRO-0, 2 and 3, the ZeRO-2 and ZeRO-3
    ones at ZeRO-1 (one launch)."""
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(data_parallel_size=4)
    out = {
        "z1_to_z0": reshard_load(pc, z1_root, 0, out_root),
        "z2_to_z1": reshard_load(pc, z2_root, 1, out_root + "_z2_to_z1"),
        "z1_to_z2": reshard_load(pc, z1_root, 2, out_root + "_z1_to_z2"),
        "z3_to_z1": reshard_load(pc, z3_root, 1, out_root + "_z3_to_z1"),
        "z1_to_z3": reshard_load(pc, z1_root, 3, out_root + "_z1_to_z3"),
        # hybrid sharding, 2 blocks of 2: loaded, saved (each block's ranges once), loaded unsharded
        "z1_to_z3_hybrid": reshard_load(pc, z1_root, 3, out_root + "_z1_to_z3_hybrid", shard=2),
    }
    back = setup(pc, 1, seed=97)
    load(out_root + "_z1_to_z3_hybrid", back, pc, 1)
    full = full_state(back, pc, 1)  # collectives: every rank
    out["z3_hybrid_to_z1"] = {"full": full} if pc.world_rank == 0 else {}
    pc.destroy()
    return out


def launch_single(root: str, src_root: str, out_root: str, pp_root: str, z2_root: str, z3_root: str) -> dict:
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext()
    out = {
        "round_trip": same_topology_round_trip(pc, root, 0, "model/pp-00_tp-00.safetensors", "flip"),
        "reshard": reshard_load(pc, src_root, 0, out_root),
        "from_pp": reshard_load(pc, pp_root, 0, out_root + "_from_pp", args=TIED),
        "from_z2": reshard_load(pc, z2_root, 0, out_root + "_from_z2"),
        "from_z3": reshard_load(pc, z3_root, 0, out_root + "_from_z3"),
    }
    pc.destroy()
    return out


def launch_dp2_pp2_tied(root: str) -> dict:
    """Pipeline (1f1b) with the tied embedding replicated on the last stage, ZeRO-1 over dp: the
    replica's optimizer ranges differ from the original's, both are saved; same-topology exact."""
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(pipeline_parallel_size=2, data_parallel_size=2)
    out = same_topology_round_trip(pc, root, 1, "optimizer/pp-01_tp-00_dp-01.safetensors", "flip", args=TIED)
    pc.destroy()
    return out


def launch_killed_while_saving(root: str) -> None:
    """tp2: step 1 saved; rank 1 dies (SIGKILL) right after writing its first shard of step 2."""
    from nanotrain.checkpoint import format as fmt
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(tensor_parallel_size=2)
    run = setup(pc, 0)
    steps(run, pc, 0, 1)
    save(root, 1, run, pc, 0)
    steps(run, pc, 1, 2)
    if pc.tp_rank == 1:
        write = fmt.write_safetensors

        def write_then_die(*a, **k):
            out = write(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
            return out

        fmt.write_safetensors = write_then_die
    save(root, 2, run, pc, 0)
    raise AssertionError("unreachable: rank 1 was killed, rank 0 waits for it")


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One set of launches shared by the tests below (each launch is seconds of imports)."""
    base = tmp_path_factory.mktemp("ckpt")
    out = {"base": base}
    out["dp2tp2"] = run_distributed(launch_dp2_tp2, 4, str(base / "dp2tp2"), timeout=240)
    out["pp"] = run_distributed(launch_dp2_pp2_tied, 4, str(base / "pp"), timeout=240)
    src = base / "dp2tp2" / "z1"  # the clean dp2 x tp2 ZeRO-1 checkpoint at step N
    offline = base / "offline_tp4"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "reshard_checkpoint.py"),
            str(src),
            str(offline),
            "--set",
            "parallelism.dp=1",
            "--set",
            "parallelism.tp=4",
            "--set",
            "optimizer.zero_stage=1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out["offline_stdout"] = proc.stdout
    out["tp4"] = run_distributed(launch_reshard, 4, str(src), 1, 4, 1, str(base / "re_tp4"), str(offline), timeout=240)[
        0
    ]
    z2 = base / "dp2tp2" / "z2"  # the clean dp2 x tp2 ZeRO-2 checkpoint at step N
    z3 = base / "dp2tp2" / "z3"
    out["zero_dp4"] = run_distributed(launch_dp4, 4, str(src), str(z2), str(base / "re_dp4"), str(z3), timeout=240)[0]
    out["dp4"] = out["zero_dp4"]["z1_to_z0"]
    out["single"] = run_distributed(
        launch_single,
        1,
        str(base / "single"),
        str(src),
        str(base / "re_single"),
        str(base / "pp" / "z1"),
        str(z2),
        str(z3),
        timeout=240,
    )[0]
    return out


# ----------------------------------------------------------------------------- tests
@pytest.mark.timeout(900)
def test_round_trip_same_topology_is_exact(runs):
    """The checks run inside the ranks (same_topology_round_trip); here: the runs trained."""
    for zero in (0, 1, 2, 3):
        losses = runs["dp2tp2"][0][zero]["losses"]
        assert len(losses) == TOTAL and losses[-1] < losses[0]
    # dp2 x tp2 and one process train the same run (test_training_dp_tp): rel 1e-5.
    single = runs["single"]["round_trip"]["losses"]
    torch.testing.assert_close(torch.tensor(runs["dp2tp2"][0][1]["losses"]), torch.tensor(single), rtol=1e-5, atol=0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("target", ["tp4", "dp4", "single"])
def test_reshard_is_exact_and_training_continues(runs, target):
    ref = runs["dp2tp2"][0][1]["ref"]  # full state of the dp2 x tp2 ZeRO-1 run at step N
    got = runs[target]["reshard"] if target == "single" else runs[target]
    assert_full_equal(got["full"], ref, f"loaded at {target}")
    # what that topology saves again is the same state, whatever the layout
    _, params, optim = read_full_state(runs["base"] / f"re_{target}")
    assert_full_equal({"params": params, "optim": optim}, ref, f"re-saved at {target}")
    uninterrupted = runs["dp2tp2"][0][1]["losses"][N:]
    torch.testing.assert_close(
        torch.tensor(got["losses"]),
        torch.tensor(uninterrupted),
        rtol=1e-5,
        atol=0,
        msg=lambda m: f"{target}: continued losses: {m}",
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "source,target",
    [
        (2, "zero_dp4/z2_to_z1"),
        (2, "single/from_z2"),
        (1, "zero_dp4/z1_to_z2"),
        (3, "zero_dp4/z3_to_z1"),
        (3, "single/from_z3"),
        (1, "zero_dp4/z1_to_z3"),
        (1, "zero_dp4/z1_to_z3_hybrid"),
    ],
)
def test_zero_checkpoint_reshards_across_stages_and_dp(runs, source, target):
    """Saved at dp2 x tp2 with ZeRO-2 (or 3), loaded at dp4 ZeRO-1 and at one process (ZeRO-0);
    saved with ZeRO-1, loaded at dp4 ZeRO-2 (or 3): params and states exact, training continues
    within 1e-6 relative of the run that saved (one on-disk format for every stage)."""
    ref = runs["dp2tp2"][0][source]["ref"]
    launch, name = target.split("/")
    got = runs[launch][name]
    assert_full_equal(got["full"], ref, f"zero{source} -> {target}")
    uninterrupted = runs["dp2tp2"][0][source]["losses"][N:]
    assert max(abs(a - b) / b for a, b in zip(got["losses"], uninterrupted)) < 1e-6, (got["losses"], uninterrupted)
    # ZeRO-1 and 2 train the same run (same partition, other gradient reduction order)
    z1 = runs["dp2tp2"][0][1]["losses"]
    for z in (2, 3):
        zn = runs["dp2tp2"][0][z]["losses"]
        assert max(abs(a - b) / b for a, b in zip(zn, z1)) < 1e-6, z


@pytest.mark.timeout(900)
def test_hybrid_sharded_checkpoint_loads_unsharded(runs):
    """Saved at dp4 ZeRO-3 in 2 blocks of 2 (each block's optimizer ranges are the same records,
    written once), loaded at dp4 ZeRO-1 over all four: the full state of the source, exactly."""
    ref = runs["dp2tp2"][0][1]["ref"]
    assert_full_equal(runs["zero_dp4"]["z3_hybrid_to_z1"]["full"], ref, "hybrid zero3 -> zero1")


@pytest.mark.timeout(900)
def test_pipeline_tied_zero1_to_one_process(runs):
    """dp2 x pp2 (1f1b), tied embeddings, ZeRO-1: exact at the same topology (checked in the
    ranks); loaded by one process: full params and states exact, training continues."""
    by_rank = runs["pp"]  # ranks 0, 1: stage 0 (dp 0, 1); ranks 2, 3: stage 1
    stage0, stage1 = by_rank[0]["ref"], by_rank[2]["ref"]
    for kind in ("params", "optim"):  # the replica on the last stage is the embedding, exactly
        a, b = stage0[kind]["embed.weight"], stage1[kind]["embed.weight"]
        assert all(torch.equal(a[k], b[k]) for k in a) if kind == "optim" else torch.equal(a, b)
    ref = {kind: {**stage1[kind], **stage0[kind]} for kind in ("params", "optim")}
    assert len(ref["params"]) == len(stage0["params"]) + len(stage1["params"]) - 1
    got = runs["single"]["from_pp"]
    assert_full_equal(got["full"], ref, "dp2 pp2 tied -> 1 process")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(by_rank[0]["losses"][N:]), rtol=1e-5, atol=0)
    meta = json.loads((runs["base"] / "pp" / "z1" / f"step_{N:06d}" / "meta.json").read_text())
    assert [e["file"] for e in meta["index"]["model"]["embed.weight"]] == ["model/pp-00_tp-00.safetensors"]
    stages = sorted({e["stage"] for e in meta["index"]["optimizer"]["embed.weight"]})
    # the tied weight has a gradient bucket of its own on both stages (ZeRO-1 partitions buckets),
    # so the replica's ZeRO ranges equal the embedding's and its states are written once, as its weight
    assert stages == [0]


@pytest.mark.timeout(900)
def test_offline_reshard_script(runs):
    ref = runs["dp2tp2"][0][1]["ref"]
    out_dir = Path(runs["offline_stdout"].strip().splitlines()[-1])
    meta = json.loads((out_dir / "meta.json").read_text())
    assert meta["topology"]["tp"] == 4 and meta["topology"]["dp"] == 1 and meta["topology"]["zero_stage"] == 1
    assert meta["resharded_from"]["topology"]["tp"] == 2
    _, params, optim = read_full_state(out_dir)
    assert_full_equal({"params": params, "optim": optim}, ref, "offline tp4")
    # loaded at tp4 without any resharding (layout identical to an online tp4 run), same values
    assert_full_equal(runs["tp4"]["offline"], ref, "offline tp4 loaded at tp4")


@pytest.mark.timeout(900)
def test_meta_json_and_layout(runs):
    ckpt = runs["base"] / "dp2tp2" / "z1" / f"step_{N:06d}"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["format"] == "nanotrain-checkpoint" and meta["format_version"] == 1
    assert meta["step"] == N and meta["extra"]["consumed_samples"] == N * GLOBAL_BATCH
    assert {k: meta["topology"][k] for k in ("dp", "tp", "pp", "cp", "ep", "zero_stage")} == {
        "dp": 2,
        "tp": 2,
        "pp": 1,
        "cp": 1,
        "ep": 1,
        "zero_stage": 1,
    }
    assert meta["topology"]["pp_engine"] == "1f1b" and meta["world_size"] == 4
    assert len(meta["config_hash"]) == 64 and meta["config"]["model"]["hidden_size"] == MODEL.hidden_size
    assert meta["scheduler"]["last_epoch"] == N
    expected = {
        "model/pp-00_tp-00.safetensors",
        "model/pp-00_tp-01.safetensors",
        *(f"optimizer/pp-00_tp-{t:02d}_dp-{d:02d}.safetensors" for t in (0, 1) for d in (0, 1)),
        *(f"state/rank-{r:05d}.safetensors" for r in range(4)),
    }
    assert set(meta["files"]) == expected
    import hashlib

    from safetensors import safe_open

    for rel, rec in meta["files"].items():  # sha256 of the header and of each tensor's bytes
        data = (ckpt / rel).read_bytes()
        assert len(data) == rec["bytes"], rel
        head_len = 8 + int.from_bytes(data[:8], "little")
        assert hashlib.sha256(data[:head_len]).hexdigest() == rec["header_sha256"], rel
        header = json.loads(data[8:head_len])
        for key, digest in rec["tensors"].items():
            a, b = header[key]["data_offsets"]
            assert hashlib.sha256(data[head_len + a : head_len + b]).hexdigest() == digest, (rel, key)
        assert set(rec["tensors"]) == set(header) - {"__metadata__"}
        assert (
            hashlib.sha256(
                (rec["header_sha256"] + "".join(rec["tensors"][k] for k in header if k != "__metadata__")).encode()
            ).hexdigest()
            == rec["digest"]
        )
        with safe_open(str(ckpt / rel), "pt") as f:  # plain safetensors files
            assert set(f.keys()) == set(rec["tensors"])
    assert (ckpt.parent / "latest").read_text().strip() == ckpt.name
    # norms (replicated over tp) are written once, by tp rank 0; ZeRO-1 ranges once per dp rank
    index = meta["index"]["model"]
    assert [e["file"] for e in index["final_norm.weight"]] == ["model/pp-00_tp-00.safetensors"]
    assert len(index["layers.0.attn.qkv.weight"]) == 2
    with safe_open(str(ckpt / "model/pp-00_tp-01.safetensors"), "pt") as f:
        header = json.loads(f.metadata()["nanotrain"])["tensors"]["layers.0.attn.qkv.weight"]
    hidden = MODEL.hidden_size
    kv = MODEL.num_key_value_heads * hidden // MODEL.num_attention_heads
    assert header["shard"]["global_shape"] == [hidden + 2 * kv, hidden]
    # tp rank 1 holds the second half of each of q, k and v
    assert [g[0] for _, g in header["shard"]["pairs"]] == [
        [hidden // 2, hidden],
        [hidden + kv // 2, hidden + kv],
        [hidden + kv + kv // 2, hidden + 2 * kv],
    ]


# ----------------------------------------------------------------------------- atomicity
def test_rank_killed_while_saving_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    with pytest.raises(AssertionError, match="rank 1"):
        run_distributed(launch_killed_while_saving, 2, str(root), timeout=120)
    assert (root / "latest").read_text().strip() == "step_000001"
    assert (root / "step_000002.tmp").is_dir() and not (root / "step_000002").exists()
    model, opt, sched = tiny()
    with forbid_pickle():
        res = load_checkpoint(root, model, opt, sched)  # one process: reshards the tp2 checkpoint
    assert res.step == 1 and res.resharded
    save_checkpoint(root, 2, model, opt, sched)  # the next save cleans the leftover up
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]


def _save_and_die(root: str, stage: str) -> None:
    """Child process: save step 2, SIGKILL itself at ``stage`` of the commit. Forked from a
    parent whose OpenMP pool may have run (pytest without OMP_NUM_THREADS=1): the child has no
    pool threads, so a parallel region would wait for them forever; one thread uses none."""
    torch.set_num_threads(1)
    from nanotrain.checkpoint import format as fmt

    target = {
        "shards": "write_safetensors",
        "meta": "write_complete",
        "rename": "commit_rename",
        "latest": "update_latest",
    }[stage]
    original = getattr(fmt, target)
    calls = []

    def die(*a, **k):
        calls.append(1)
        if stage == "shards" and len(calls) == 1:
            return original(*a, **k)  # one shard is on disk, the rest is not
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(fmt, target, die)
    objs = tiny(1)
    tiny_step(objs, 0)
    save_checkpoint(root, 2, *objs)


@pytest.mark.parametrize("stage", ["shards", "meta", "rename", "latest"])
def test_kill_during_save_keeps_previous_latest(tmp_path, stage):
    root = tmp_path / "ck"
    objs = tiny()
    tiny_step(objs, 0)
    save_checkpoint(root, 1, *objs)
    expected = {n: p.detach().clone() for n, p in objs[0].named_parameters()}
    child = multiprocessing.get_context("fork").Process(target=_save_and_die, args=(str(root), stage))
    child.start()
    try:
        child.join(60)
        assert child.exitcode == -signal.SIGKILL
    finally:
        if child.is_alive():  # a hang is a failure, and must not block pytest's exit
            child.kill()
            child.join()
    assert (root / "latest").read_text().strip() == "step_000001"
    if stage == "latest":  # renamed and complete, but `latest` was never moved: not used
        assert (root / "step_000002" / "COMPLETE").is_file()
    else:
        assert not (root / "step_000002").exists() and (root / "step_000002.tmp").is_dir()
    fresh = tiny(7)
    res = load_checkpoint(root, *fresh)
    assert res.step == 1 and not res.resharded
    for n, p in fresh[0].named_parameters():
        assert torch.equal(p, expected[n]), n
    tiny_step(fresh, 1)
    save_checkpoint(root, 2, *fresh)  # replaces the stale step_000002 / removes the .tmp
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]
    assert load_checkpoint(root, *tiny(3)).step == 2


def test_incomplete_and_tmp_directories_are_ignored(tmp_path):
    root = tmp_path / "ck"
    objs = tiny()
    save_checkpoint(root, 1, *objs)
    shutil.copytree(root / "step_000001", root / "step_000005.tmp")  # complete-looking, but .tmp
    shutil.copytree(root / "step_000001", root / "step_000004")
    (root / "step_000004" / "COMPLETE").unlink()
    assert load_checkpoint(root, *tiny(2)).step == 1
    (root / "latest").unlink()  # without `latest`: the newest COMPLETE one, still step 1
    assert load_checkpoint(root, *tiny(2)).step == 1
    assert load_checkpoint(tmp_path / "nothing", *tiny(2)) is None


def test_corrupt_newest_falls_back_with_warning_naming_file(tmp_path, caplog):
    root = tmp_path / "ck"
    objs = tiny()
    for step in (1, 2, 3, 4):
        tiny_step(objs, step)
        save_checkpoint(root, step, *objs, extra={"consumed_samples": step})
    damage(root / "step_000004" / "model" / "pp-00_tp-00.safetensors", "header")
    damage(root / "step_000003" / "optimizer" / "pp-00_tp-00_dp-00.safetensors", "flip")
    damage(root / "step_000002" / "model" / "pp-00_tp-00.safetensors", "truncate")
    with caplog.at_level(logging.WARNING, logger="nanotrain.checkpoint"):
        res = load_checkpoint(root, *tiny(5))
    assert res.step == 1 and res.extra == {"consumed_samples": 1} and len(res.skipped) == 3
    text = caplog.text
    assert "step_000004/model/pp-00_tp-00.safetensors: header sha256 mismatch" in text
    assert "step_000003/optimizer/pp-00_tp-00_dp-00.safetensors: tensor" in text and "sha256 mismatch" in text
    assert "step_000002/model/pp-00_tp-00.safetensors: size" in text and "truncated" in text
    (root / "step_000001" / "meta.json").write_text("{}")  # meta.json is checked against COMPLETE
    with pytest.raises(CheckpointError, match="no intact complete checkpoint") as err:
        load_checkpoint(root, *tiny(5))
    assert "step_000001/meta.json: checksum mismatch" in str(err.value)
    # every damaged one was moved aside (issue 17 item 1): kept for inspection, never counted
    assert sorted(p.name for p in root.iterdir()) == ["latest"] + [f"step_00000{s}.damaged" for s in (1, 2, 3, 4)]
    with pytest.raises(CheckpointError, match="sha256 mismatch"):  # an explicit path never falls back
        load_checkpoint(root, *tiny(5), path=root / "step_000003.damaged")
    from nanotrain.checkpoint.format import verify_checkpoint

    assert len(verify_checkpoint(root / "step_000003.damaged")) == 1


def test_keep_last_prunes_older_complete_checkpoints(tmp_path):
    root = tmp_path / "ck"
    objs = tiny()
    for step in range(1, 6):
        save_checkpoint(root, step, *objs, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004", "step_000005"]
    save_checkpoint(root, 5, *objs, keep_last=1)  # latest already names step 5: nothing written
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004", "step_000005"]
    save_checkpoint(root, 6, *objs, config=config_for())  # config.checkpoints.keep_last (2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000005", "step_000006"]
    # a resumed run that went back to step 5 keeps the abandoned step 6 out of its way
    (root / "latest").write_text("step_000005\n")
    assert load_checkpoint(root, *tiny(1)).step == 5
    save_checkpoint(root, 6, *objs, keep_last=1)  # replaces the stale step 6, prunes 5
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000006"]


def test_wrong_model_is_an_error_not_a_fallback(tmp_path):
    from dataclasses import replace

    from nanotrain.models.llama_parallelize import build_llama

    root = tmp_path / "ck"
    save_checkpoint(root, 1, *tiny(), config=config_for())
    wider = build_llama(replace(MODEL, intermediate_size=2 * MODEL.intermediate_size), None)
    with pytest.raises(CheckpointError, match="shape mismatch.*mlp"):
        load_checkpoint(root, wider)
    deeper = build_llama(replace(MODEL, num_layers=MODEL.num_layers + 1), None)
    with pytest.raises(CheckpointError, match="missing.*layers.2"):
        load_checkpoint(root, deeper)
    shallower = build_llama(replace(MODEL, num_layers=1), None)
    with pytest.raises(CheckpointError, match="no rank of this model has"):
        load_checkpoint(root, shallower)
    with pytest.raises(CheckpointError, match="model config differs.*rope_theta"):
        load_checkpoint(root, tiny()[0], config=config_for(model=replace(MODEL, rope_theta=500.0)))


def _offline_round_trip(tmp_path, args, there: list[str], back: list[str]) -> dict:
    """Train ``args`` 2 steps in one process (ZeRO-0), save, reshard offline to ``there``, back
    to ``back``, load into a fresh model: every weight and AdamW state must be bit-identical.
    Returns the meta.json of the ``there`` checkpoint."""
    from nanotrain.checkpoint.reshard import reshard_offline
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer

    def build(seed):
        model = build_llama(args, None, seed=seed)
        opt = build_optimizer(model.named_parameters(), OPTIM, zero_stage=0)
        return model, opt, build_lr_scheduler(opt, OPTIM, 10)

    model, opt, sched = build(1)
    for step in range(2):
        batch = global_batch(step) % args.vocab_size
        model.begin_step(1)
        model(batch[:, :-1], batch[:, 1:]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    save_checkpoint(tmp_path / "a", 2, model, opt, sched, config=config_for(model=args), extra={"consumed_samples": 16})
    wide = reshard_offline(tmp_path / "a", tmp_path / "b", there)
    reshard_offline(tmp_path / "b", tmp_path / "c", back)
    fresh, fresh_opt, fresh_sched = build(9)
    res = load_checkpoint(tmp_path / "c", fresh, fresh_opt, fresh_sched, config=config_for(model=args))
    assert res.step == 2 and res.extra == {"consumed_samples": 16} and not res.rng_restored
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], fresh_opt.state[q][k]), (name, k)
    assert fresh_sched.state_dict() == sched.state_dict()
    return json.loads((wide / "meta.json").read_text())


def test_offline_reshard_through_pp_tp_dp_and_back_is_exact(tmp_path):
    """One process, tied embeddings: (1,1,1) -> tp4 pp2 dp3 ZeRO-1 (vocab padded, tied replica,
    ZeRO ranges cutting tp shards) -> (1,1,1) ZeRO-0 -> loaded: every tensor bit-identical."""
    meta = _offline_round_trip(
        tmp_path,
        replace(TIED, vocab_size=250),  # tp4 pads it to 252
        ["parallelism.tp=4", "parallelism.pp=2", "parallelism.dp=3", "optimizer.zero_stage=1"],
        ["parallelism.tp=1", "parallelism.pp=1", "parallelism.dp=1", "optimizer.zero_stage=0"],
    )
    assert len([f for f in meta["files"] if f.startswith("model/")]) == 8
    assert len([f for f in meta["files"] if f.startswith("optimizer/")]) == 24


def test_offline_reshard_moe_across_ep_and_back_is_exact(tmp_path):
    """One process, an MoE model (dense first layer, shared expert): ep1 ZeRO-0 -> ep4 tp2 dp2
    ZeRO-1 (model files: both tp shards of ep rank 0, and each ep rank's quarter of the experts,
    which are not split over tp, written once by its tp rank 0; ZeRO-1 ranges over dp x ep for
    the dense states and over dp for the experts', every (ep, dp, tp) rank one optimizer file)
    -> ep1 ZeRO-0 -> loaded: every tensor bit-identical."""
    from nanotrain.config import MoEArgs

    args = replace(
        MODEL,
        num_layers=3,
        moe=MoEArgs(num_experts=4, top_k=2, expert_intermediate_size=32, num_shared_experts=1, first_dense_layers=1),
    )
    meta = _offline_round_trip(
        tmp_path,
        args,
        ["parallelism.ep=4", "parallelism.tp=2", "parallelism.dp=2", "optimizer.zero_stage=1"],
        ["parallelism.ep=1", "parallelism.tp=1", "parallelism.dp=1", "optimizer.zero_stage=0"],
    )
    assert meta["topology"]["ep"] == 4 and meta["world_size"] == 16
    assert sorted(f for f in meta["files"] if f.startswith("model/")) == [
        f"model/pp-00_tp-{t:02d}_ep-{e:02d}.safetensors" for t, e in ((0, 0), (0, 1), (0, 2), (0, 3), (1, 0))
    ]
    assert len([f for f in meta["files"] if f.startswith("optimizer/")]) == 16
    experts = meta["index"]["model"]["layers.1.mlp.experts.gate_up.weight"]
    assert sorted(e["shard"]["pairs"][0][1][0][0] for e in experts) == [0, 1, 2, 3]  # one expert per ep rank


def test_per_parameter_files_and_rank_state(tmp_path):
    root = tmp_path / "ck"
    objs = tiny()
    tiny_step(objs, 0)
    save_checkpoint(root, 1, *objs, granularity="param", rank_state={"data_position": [3, 7]})
    names = {p.relative_to(root / "step_000001").as_posix() for p in (root / "step_000001").rglob("*.safetensors")}
    assert "model/layers.0.attn.qkv.weight/pp-00_tp-00.safetensors" in names
    assert "optimizer/layers.0.attn.qkv.weight/pp-00_tp-00_dp-00.safetensors" in names
    fresh = tiny(4)
    res = load_checkpoint(root, *fresh)
    assert res.rank_state == {"data_position": [3, 7]} and not res.resharded
    for (n, p), q in zip(objs[0].named_parameters(), fresh[0].parameters()):
        assert torch.equal(p, q), n
