"""Stage 4, multi-gpu: tp2 x pp2 (or pp2) 1f1b through ``submit.py --local``, an uninterrupted
run against a save and ``--resume``: the same loss check as the single-rank stage."""

from __future__ import annotations

import shutil

from .check import Check
from .limits import PY, RUN_CAP_S
from .runs import compare, leg_summary, read_run, resume_verdict


def stage_multi_gpu(check: Check, deadline: float) -> dict:
    ws, S, gpus = check.ws, check.ws.steps, check.facts.get("gpus", 0)
    four = gpus >= 4 or check.smoke
    layout = {
        "parallelism.dp": 1,
        "parallelism.tp": 2 if four else 1,
        "parallelism.pp": 2,
        "parallelism.pp_engine": "1f1b",
    }
    name = "tp2 x pp2 1f1b" if four else "pp2 1f1b"
    if check.smoke:
        from nanotrain.config import load_config, validate

        validate(load_config(str(ws.config("multi-gpu", layout))))
        return {
            "status": "skipped",
            "layout": name,
            "note": f"cpu-smoke: {name} config validated, not run (4 ranks cost ~20 s on 2 cores)",
        }
    if gpus < 2:
        return {"status": "skipped", "note": f"{gpus} GPU: NCCL refuses two ranks on one device"}
    ws.token_cache()
    legs = [
        (
            "mg-uninterrupted",
            [
                str(
                    ws.config(
                        "mg-uninterrupted",
                        {"logging.run_name": "mg-uninterrupted", "training.train_steps": 2 * S, **layout},
                    )
                ),
                "--local",
            ],
        ),
        (
            "mg-first",
            [
                str(
                    ws.config(
                        "mg-first",
                        {
                            "logging.run_name": "mg-resume",
                            "training.train_steps": S,
                            "checkpoints.interval": S,
                            **layout,
                        },
                    )
                ),
                "--local",
            ],
        ),
        ("mg-resumed", ["--resume", str(ws.logs / "mg-resume"), "--local", "--set", f"training.train_steps={2 * S}"]),
    ]
    runs, problems = {}, []
    for leg, args in legs:
        if runs and not all(r["ok"] for r in runs.values()):
            problems.append(f"{leg}: not run")
            continue
        r = runs[leg] = {"name": leg, **check.run([PY, "submit.py", *args], leg, deadline, RUN_CAP_S, ws.env)}
        run_dir = ws.logs / ("mg-uninterrupted" if leg == "mg-uninterrupted" else "mg-resume")
        r.update(read_run(run_dir, check.log_text(leg)))
        want = 2 * S if leg != "mg-first" else S
        r["ok"] = r["rc"] == 0 and r.get("step") == want
        if not r["ok"]:
            problems.append(f"{leg}: rc {r['rc']}, step {r.get('step')} of {want} (log {r['log']})")
    out: dict = {"layout": name}
    if not problems:
        ref = runs["mg-uninterrupted"]["all_losses"]
        noise = compare(ref, runs["mg-first"]["all_losses"], range(1, S + 1))["max_abs_diff"]
        cmp = compare(ref, runs["mg-resumed"]["all_losses"], range(S + 1, 2 * S + 1))
        ok, cmp["verdict"] = resume_verdict(cmp, noise, runs["mg-resumed"]["resumed_from_step"], S)
        out["resume"] = cmp
        if not ok:
            problems.append(f"resume: {cmp['verdict']}")
    spans = {
        "mg-uninterrupted": range(1, 2 * S + 1),
        "mg-first": range(1, S + 1),
        "mg-resumed": range(S + 1, 2 * S + 1),
    }
    out["runs"] = [leg_summary(r, spans[leg]) for leg, r in runs.items()]
    shutil.rmtree(ws.logs / "mg-uninterrupted", ignore_errors=True)
    shutil.rmtree(ws.logs / "mg-resume", ignore_errors=True)
    if problems:
        timed_out = any(r["rc"] == 124 for r in runs.values())
        return {"status": "timeout" if timed_out else "failed", "note": f"{name}: " + "; ".join(problems), **out}
    return {"status": "passed", "note": f"{name}: resume {out['resume']['verdict']}", **out}
