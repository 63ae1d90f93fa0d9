"""Stage 3, the trainer: single-rank runs of ``nanotrain.runtime.task`` (uninterrupted, saved
and resumed sync and async, compiled) whose losses must match step for step, and the
uninterrupted run's memory beside the dry-run estimate."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

from .check import Check
from .limits import COMPILE_CAP_S, COMPILE_REL_TOL, COMPILE_STEPS, MIN_STAGE_S, PY, RUN_CAP_S, THIS
from .runs import compare, leg_summary, memory_report, read_run, resume_verdict


def train(check: Check, name: str, run_name: str, items: dict, deadline: float, cap: float = RUN_CAP_S) -> dict:
    ws = check.ws
    cfg = ws.config(name, {"logging.run_name": run_name, **items})
    memory = ws.tmp / f"{name}.memory.json"
    log = f"trainer-{name}"
    result = {
        "name": name,
        "train_steps": items["training.train_steps"],
        "config": str(cfg),
        **check.run(
            [PY, THIS, "--task", str(cfg), "--memory-out", str(memory)],
            log,
            deadline,
            cap,
            ws.single_rank_env(),
            fork=True,
        ),
    }
    result.update(read_run(ws.logs / run_name, check.log_text(log), memory))
    result["ok"] = result["rc"] == 0 and result.get("step") == result["train_steps"]
    return result


def stage_trainer(check: Check, deadline: float) -> dict:
    ws = check.ws
    S = ws.steps
    out: dict = {"steps_S": S, "token_cache": ws.token_cache()}
    legs = [
        ("uninterrupted", "uninterrupted", {"training.train_steps": 3 * S}),
        ("first", "resume", {"training.train_steps": S, "checkpoints.interval": S}),
        (
            "resumed",
            "resume",
            {"training.train_steps": 2 * S, "checkpoints.interval": max(1, S // 2), "checkpoints.async_save": True},
        ),
        ("resumed-async", "resume", {"training.train_steps": 3 * S}),
        ("compiled", "compiled", {"training.train_steps": COMPILE_STEPS, "training.compile": True}),
    ]
    runs: dict[str, dict] = {}
    problems, timed_out = [], False
    for name, run_name, items in legs:
        if name == "compiled" and ws.smoke:
            out["compile"] = {
                "status": "skipped",
                "note": "cpu-smoke: inductor takes ~55 s for the tiny model on the CI machine's CPU (> 20 s)",
            }
            continue
        needs = {"resumed": "first", "resumed-async": "resumed"}.get(name)
        if needs and not runs.get(needs, {}).get("ok"):
            problems.append(f"{name}: not run ({needs} did not pass)")
            continue
        if deadline - time.monotonic() < MIN_STAGE_S:
            problems.append(f"{name}: no time left")
            timed_out = True
            continue
        cap = COMPILE_CAP_S if name == "compiled" else RUN_CAP_S
        r = runs[name] = train(check, name, run_name, items, deadline, cap)
        print(f"   {name}: rc {r['rc']}, step {r.get('step')}, loss {r.get('loss')}, {r['wall_s']} s", flush=True)
        if not r["ok"]:
            timed_out |= r["rc"] == 124
            problems.append(f"{name}: rc {r['rc']}, step {r.get('step')} of {r['train_steps']} (log {r['log']})")
        if name in ("uninterrupted", "resumed-async", "compiled"):  # checkpoints: gigabytes
            shutil.rmtree(ws.logs / run_name, ignore_errors=True)

    ref = runs.get("uninterrupted", {}).get("all_losses", {})
    if runs.get("uninterrupted", {}).get("ok"):
        u = runs["uninterrupted"]
        check.facts["reference_memory"] = u.get("memory", {})
        out["memory"] = memory_report(u, Path(u["config"]))
    noise = None
    if ref and runs.get("first", {}).get("ok"):
        fresh = compare(ref, runs["first"]["all_losses"], range(1, S + 1))
        out["fresh_runs"] = fresh  # two runs from scratch: what differs here is nondeterminism
        noise = fresh["max_abs_diff"]
    for key, name, steps, start in (
        ("resume_sync", "resumed", range(S + 1, 2 * S + 1), S),
        ("resume_async", "resumed-async", range(2 * S + 1, 3 * S + 1), 2 * S),
    ):
        if ref and runs.get(name, {}).get("ok"):
            cmp = compare(ref, runs[name]["all_losses"], steps)
            ok, cmp["verdict"] = resume_verdict(cmp, noise, runs[name]["resumed_from_step"], start)
            out[key] = cmp
            if not ok:
                problems.append(f"{key}: {cmp['verdict']}")
    if ref and runs.get("compiled", {}).get("ok"):
        got = runs["compiled"]["all_losses"]
        steps = range(1, COMPILE_STEPS + 1)
        rel = [abs(got[s] - ref[s]) / abs(ref[s]) for s in steps if s in got and s in ref]
        finite = len(rel) == COMPILE_STEPS and all(math.isfinite(got[s]) for s in steps)
        worst = max(rel) if rel and finite else None
        ok = finite and worst <= COMPILE_REL_TOL
        out["compile"] = {
            "status": "passed" if ok else "failed",
            "max_rel_diff_vs_eager": worst,
            "losses": [[s, got.get(s)] for s in steps],
            "eager": [[s, ref.get(s)] for s in steps],
            "wall_s": runs["compiled"]["wall_s"],
            "memory": runs["compiled"].get("memory"),
        }
        if not ok:
            problems.append(f"compile: losses {out['compile']['losses']} vs eager {out['compile']['eager']}")
    spans = {
        "uninterrupted": range(1, 3 * S + 1),
        "first": range(1, S + 1),
        "resumed": range(S + 1, 2 * S + 1),
        "resumed-async": range(2 * S + 1, 3 * S + 1),
        "compiled": range(1, COMPILE_STEPS + 1),
    }
    out["runs"] = [leg_summary(r, spans[name]) for name, r in runs.items()]
    if problems:
        status = "timeout" if timed_out else "failed"
        return {"status": status, "rc": 124 if timed_out else 1, "note": "; ".join(problems), **out}
    notes = [f"resume: sync {out['resume_sync']['verdict']}, async {out['resume_async']['verdict']}"]
    if out.get("compile", {}).get("status") == "passed":
        notes.append(f"compile: max rel diff {out['compile']['max_rel_diff_vs_eager']:.2g}")
    else:
        notes.append("compile: skipped")
    mem = out.get("memory", {})
    if mem.get("max_memory_allocated_gib") is not None:
        notes.append(
            f"peak {mem['max_memory_allocated_gib']} GiB allocated, {mem['max_memory_reserved_gib']} "
            f"reserved, {mem.get('device_used_peak_gib')} on the device "
            f"(estimate {mem['dry_run_estimate_gib']})"
        )
    u = runs["uninterrupted"]
    if u.get("mfu") is not None:
        notes.append(f"{u['tokens_per_sec']:,.0f} tokens/s, MFU {100 * u['mfu']:.1f}%")
    return {"status": "passed", "rc": 0, "note": "; ".join(notes), **out}
