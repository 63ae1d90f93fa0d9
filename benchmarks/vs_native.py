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

One launch per job (local gloo processes, 1 thread each, started by ``nanotrain.launch.ranks``,
the launcher of ``submit.py --local``), jobs listed in ``JOBS``. Results:
``benchmarks/results/latest.json`` (a list of rows: name, ours, native, unit, ratio, target,
same_loss, + details) and ``latest.md`` (the table, the command, the machine, the date).

The shared harness (settings, timing loop, meters) is ``bench_common.py``, the two sides compared
``bench_sides.py``, the checkpoint rows ``bench_checkpoint.py``, the ZeRO-2 vs FSDP2 and ZeRO
memory rows ``bench_zero.py``, the ZeRO-3 ones ``bench_zero3.py``; this file holds the other jobs,
the launcher and the report, and is the entry point.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

# Run as a script (make bench) or imported: the bench_* modules and native_llama live next to this
# file; bench_common puts the repository root (nanotrain) and this directory first on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_checkpoint import job_checkpoint  # noqa: E402
from bench_common import (  # noqa: E402
    GLOBAL_SEQS,
    HERE,
    MICRO_SEQS,
    MODEL,
    PP_M,
    SEQ,
    Bench,
    SavedBytes,
    drop_dtensor_caches,
    max_over_ranks,
    micro_batches,
    preimport,
)
from bench_sides import NativeFlat, NativePipeline, Ours  # noqa: E402
from bench_zero import job_zero2  # noqa: E402
from bench_zero3 import job_zero3  # noqa: E402


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
    from native_llama import cross_entropy
    from torch.distributed.tensor.parallel import loss_parallel

    ((x, y),) = micro_batches(b.batch(0), 0, 1, GLOBAL_SEQS)[:1]
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
    name = (
        "tp2 REDUCE_SCATTER vs Colwise/Rowwise + SequenceParallel"
        if sp
        else "tp2 ALL_REDUCE vs Colwise/Rowwise (DTensor)"
    )
    return [
        b.throughput_row(
            name, r, GLOBAL_SEQS * SEQ, 1.3, activation_bytes_ours=mem_ours, activation_bytes_native=mem_native
        )
    ]


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
            "ours": peak_1f1b,
            "native": peak_afab,
            "unit": "bytes",
            "ratio": round(peak_1f1b / peak_afab, 3),
            "target": round(2 / PP_M, 3),
            "lower_is_better": True,
            "same_loss": None,
            "columns": ["nanotrain 1f1b", "nanotrain afab"],
            "peak_live_microbatches": [live_1f1b, live_afab],
            "note": "engine instrumentation (saved-for-backward bytes of in-flight micro-batches); "
            f"target = pp/m = 2/{PP_M}",
        }
        return [row, mem]
    return [
        b.throughput_row(f"pp2 interleaved_1f1b v=2 m={PP_M} vs ScheduleInterleaved1F1B", r, GLOBAL_SEQS * SEQ, 1.0)
    ]


def job_pp2_1f1b(b: Bench) -> list[dict]:
    return job_pp2(b, "1f1b")


def job_pp2_interleaved(b: Bench) -> list[dict]:
    return job_pp2(b, "interleaved_1f1b")


def job_3d(b: Bench) -> list[dict]:
    m = 4  # configs/tiny_cpu.yaml: micro-batch 2, 4 micro-batches per replica
    ours = Ours(b, dp=2, tp=2, pp=2, engine="1f1b", micro=GLOBAL_SEQS // 2 // m)
    native = NativePipeline(b, ours.layer_stages(), pp=2, v=1, m=m, dp=2, tp=2, dp_kind="replicate")
    r = b.alternate({"ours": ours.step, "native": native.step})
    return [
        b.throughput_row(
            "dp2·tp2·pp2 (1f1b, m=4) vs DeviceMesh + DTensor TP + pipelining + FSDP2 replicate",
            r,
            GLOBAL_SEQS * SEQ,
            1.2,
        )
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
    "zero2": (2, job_zero2),
    "zero3": (2, job_zero3),
}


def worker(job: str, reps: int, steps: int, warmup: int, out: str) -> None:
    import faulthandler

    faulthandler.enable(all_threads=True)  # a C++ abort (SIGABRT) leaves Python stacks in the rank log
    import torch
    import torch.distributed as dist

    from nanotrain.parallel.parallel_context import destroy_process_groups

    torch.set_num_threads(1)
    os.environ["NANOTRAIN_BENCH_JOB"] = job
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    preimport()
    dist.init_process_group("gloo", init_method="env://")
    bench = Bench(reps, steps, warmup)
    rows = JOBS[job][1](bench)  # the job's models, optimizers and meshes are freed on return
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    drop_dtensor_caches()
    destroy_process_groups()  # barrier, destroy, and check that every group is really gone


# ============================================================================ launcher side
def launch(job: str, reps: int, steps: int, warmup: int, timeout_s: float, log_root: Path) -> list[dict]:
    from nanotrain.launch.ranks import run_ranks

    out = log_root / f"{job}.json"
    command = [sys.executable, "-u", __file__, "--worker", job, str(reps), str(steps), str(warmup), str(out)]
    run_ranks(command, JOBS[job][0], log_root / job, timeout_s)
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
        lines.append(
            f"| {name} | {fmt_value(r['ours'], r['unit'])} | {fmt_value(r['native'], r['unit'])} | "
            f"{r['unit']} | {r['ratio']} | {r.get('ratio_paired', '—')} | {target} | {met(r)} | {same} |"
        )
    lines += [
        "",
        "ratio = nanotrain / native of the median tokens/s (checkpoint rows: MB/s); paired = median over "
        "the alternations of native step time / nanotrain step time, each pair run back to back (robust to "
        "load from other processes); memory rows: first column / second column, lower is better. same "
        "loss: first-step losses within 1e-4 relative (checkpoint rows: the loaded states give the saved "
        "loss and the same next training step on both sides).",
    ]
    return "\n".join(lines) + "\n"


def tp_memory_row(rows: list[dict]) -> dict | None:
    ar = next((r for r in rows if r["name"].startswith("tp2 ALL_REDUCE")), None)
    rs = next((r for r in rows if r["name"].startswith("tp2 REDUCE_SCATTER")), None)
    if not ar or not rs:
        return None
    ours = rs["activation_bytes_ours"] / ar["activation_bytes_ours"]
    native = rs["activation_bytes_native"] / ar["activation_bytes_native"]
    return {
        "name": "memory: activation bytes per micro-batch, REDUCE_SCATTER vs ALL_REDUCE (tp2)",
        "ours": rs["activation_bytes_ours"],
        "native": ar["activation_bytes_ours"],
        "unit": "bytes",
        "ratio": round(ours, 3),
        "target": 1.0,
        "lower_is_better": True,
        "same_loss": None,
        "columns": ["nanotrain REDUCE_SCATTER", "nanotrain ALL_REDUCE"],
        "native_sp_over_tp": round(native, 3),
        "native_bytes": [rs["activation_bytes_native"], ar["activation_bytes_native"]],
        "note": "saved-for-backward bytes of one 8-sequence micro-batch's forward, max over tp ranks",
    }


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
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="after timing, torch.profiler tables of 3 steps per side and rank into DIR",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE / "results",
        help="directory for latest.json / latest.md (default benchmarks/results)",
    )
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
                print(
                    f"[bench] {job} ({time.perf_counter() - tj:.0f} s): {r['name']}: ours {r['ours']} "
                    f"native {r['native']} {r['unit']} ratio {r['ratio']} same_loss {r['same_loss']}",
                    flush=True,
                )
    mem = tp_memory_row(rows)
    if mem:
        rows.append(mem)
    import torch

    meta = {
        "command": "make bench"
        + (" QUICK=1" if opts.quick else "")
        + (f" (--only {' '.join(jobs)})" if opts.only else ""),
        "wall_s": time.perf_counter() - t0,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores ({platform.processor() or cpu_model()})",
        "torch": torch.__version__,
        "reps": reps,
        "steps": steps,
        "warmup": warmup,
        "loadavg_start": load_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
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
