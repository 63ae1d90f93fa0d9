"""Stages 6-8, the measurements beside the trainer's correctness: the memory rehearsal against
the real peak, masked attention (FlexAttention) against its reference, and the training
benchmark's tokens/s and MFU. Each runs an existing tool and reports its JSON."""

from __future__ import annotations

import json
import os
import time

from .check import Check, last_json
from .limits import MASKED_MIN_S, PY


def stage_rehearsal(check: Check, deadline: float) -> dict:
    ws, steps = check.ws, 3 * check.ws.steps
    if check.smoke and os.environ.get("GPU_CHECK_SMOKE_REHEARSE") != "1":
        return {
            "status": "skipped",
            "note": "cpu-smoke: a fresh interpreter per rehearsed rank costs 6-20 s on 2 "
            "cores (GPU_CHECK_SMOKE_REHEARSE=1 runs it)",
        }
    ws.token_cache()  # submit.py checks the data before anything else
    cfg = ws.config("rehearsal", {"logging.run_name": "rehearsal", "training.train_steps": steps})
    r = check.run(
        [PY, "submit.py", str(cfg), "--rehearse", "--rank", "0", "--steps", str(steps), "--json"],
        "rehearsal",
        deadline,
        env=ws.env,
        fork=True,
    )
    text = check.log_text("rehearsal")
    if r["rc"] == 2 and "unrecognized arguments" in text and "--rehearse" in text:
        return {"status": "unavailable", "note": "submit.py has no --rehearse yet", **r}
    if r["rc"] == 124:
        return {"status": "timeout", "note": f"no answer in time (see {r['log']})", **r}
    result = last_json(text)
    if r["rc"] != 0 or result is None or not result.get("ranks"):
        return {"status": "failed", "note": f"rc {r['rc']}, no JSON with ranks (see {r['log']})", **r}
    rank = result["ranks"][0]
    peak = rank.get("peak_bytes") or rank.get("peak") or {}  # "peak": what --rehearse prints today
    real = check.facts.get("reference_memory", {}).get("max_memory_allocated")
    ratio = round(peak["total"] / real, 3) if real and peak.get("total") else None
    out = {
        "rehearsed_peak_bytes": peak,
        "real_max_memory_allocated": real,
        "rehearsed_over_real": ratio,
        "defects": result.get("defects", []),
        "ok_reported": result.get("ok"),
    }
    note = f"rehearsed peak {peak.get('total', 0) / 2**30:.2f} GiB" + (
        f" = {ratio} x the real max_memory_allocated" if ratio else " (no real CUDA peak to compare)"
    )
    if not result.get("ok"):
        return {"status": "failed", "note": f"rehearsal reports defects: {result.get('defects')}", **r, **out}
    return {"status": "passed", "note": note, **r, **out}


def stage_bench(check: Check, deadline: float) -> dict:
    if not check.smoke and os.environ.get("GPU_CHECK_BENCH") != "1":
        return {"status": "skipped", "note": "opt-in: GPU_CHECK_BENCH=1 (the ~1.1 B model's tokens/s and MFU)"}
    out, notes = {}, []
    variants = [("gpu_bench", [])]
    if not check.smoke and os.environ.get("GPU_CHECK_COMPILE") == "1":
        variants.append(("gpu_bench_compile", ["--compile", "--warmup", "3"]))
    for name, extra in variants:
        if deadline - time.monotonic() < 30:
            notes.append(f"{name}: no time left")
            continue
        result_path = check.logs / f"{name}.json"
        args = (
            ["--cpu-smoke", "--seq", "128", "--micro-batch", "2", "--steps", "2", "--warmup", "1"]
            if check.smoke
            else ["--steps", "8", "--warmup", "2"]
        )
        r = check.run(
            [PY, "benchmarks/gpu_train_bench.py", *args, *extra, "--out", str(result_path)],
            name,
            deadline,
            env=check.ws.env,
            fork=True,
        )
        res = json.loads(result_path.read_text()) if r["rc"] == 0 and result_path.is_file() else None
        out[name] = {**r, "result": res}
        if res is None:
            return {"status": "timeout" if r["rc"] == 124 else "failed", "note": f"{name}: rc {r['rc']}", **out}
        mfu = f"{100 * res['mfu']:.1f}%" if res.get("mfu") is not None else "n/a"
        notes.append(f"{name}: {res['tokens_per_s']:,} tokens/s, MFU {mfu}, micro-batch {res['micro_batch']}")
    return {"status": "passed", "note": "; ".join(notes), **out}


def stage_masked_attention(check: Check, deadline: float) -> dict:
    if deadline - time.monotonic() < MASKED_MIN_S:
        left = deadline - time.monotonic()
        return {"status": "skipped", "note": f"{left:.0f} s left: raise GPU_CHECK_BUDGET (380 leaves it room)"}
    result_path = check.logs / "masked_attention.json"
    mode = "--eager-flex" if check.smoke else "--gpu-check"
    r = check.run([PY, "benchmarks/masked_attention.py", mode, "--out", str(result_path)], "masked-attention", deadline)
    res = json.loads(result_path.read_text()) if result_path.is_file() else None
    if res is None:
        return {"status": "timeout" if r["rc"] == 124 else "failed", "note": f"rc {r['rc']} (see {r['log']})", **r}
    note = f"flex vs the CPU reference: max relative error {res['max_relative_error']:.1e}"
    timings = res.get("s8192_bf16_16x128")
    if timings:
        speeds = ", ".join(f"{k} {v['tokens_per_s']:,}" for k, v in timings.items())
        note += f"; S 8192 bf16 fwd+bwd tokens/s: {speeds}; flex peak {res['flex_peak_over_causal']} x causal's"
    return {"status": "passed" if res["ok"] else "failed", "note": note, **r, "result": res}
