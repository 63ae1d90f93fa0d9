"""Run cases (generated or corpus) in a Workspace and judge each by the contract (harness.verdict,
strict: the error line printable too) and by the case's own expectations:

    accepted          refused expected, exit 0 came
    refused           exit 0 expected, an error line came
    unnamed           the error line does not name what the case says it must
    wrong-meaning     stdout lacks what it must show, or a loaded field holds a reading the user
                      cannot mean (010 read as 8), or an accepted config fails a check the ranks run
    unsafe-output     an accepted answer prints a control, format, surrogate or separator character

Submissions never reach a real cluster: `sbatch`, `srun` and `scancel` on PATH are fakes that fail
at once (a case may bring its own fake, such as an sbatch that never answers).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import stat
import sys
from pathlib import Path

from fuzzing import harness
from fuzzing.values import get_value, reading_problem, scalar_fields
from fuzzing.workspace import ROOT

DENY = '#!/bin/sh\necho "fuzz_config: $0 is a fake, nothing is submitted" >&2\nexit 1\n'


def _fake_dir(where: Path, bodies: dict) -> Path:
    where.mkdir(exist_ok=True)
    for name, body in bodies.items():
        path = where / name
        path.write_text(body if body.startswith("#!") else f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return where


def _fuzz_config_main(argv):
    """fuzz_config's own arguments, with its work (a fuzz run inside the fuzz run) stubbed."""
    import fuzz_config

    real = fuzz_config.fuzz, fuzz_config.print_report
    fuzz_config.fuzz = lambda *a, **k: {"failures": []}
    fuzz_config.print_report = lambda *a, **k: None
    try:
        return fuzz_config.main(argv)
    finally:
        fuzz_config.fuzz, fuzz_config.print_report = real


def target_main(target: str):
    if target == "submit":
        from nanotrain.commands.cli import main

        return main
    if target == "fuzz_config":
        return _fuzz_config_main
    return importlib.import_module(target).main


def target_command(target: str) -> list[str]:
    script = ROOT / "submit.py" if target == "submit" else ROOT / "scripts" / f"{target}.py"
    return [sys.executable, str(script)]


def _lr_schedule(config) -> str:
    """What the ranks' optimizer and scheduler do with the config over the whole run."""
    import torch

    from nanotrain.optim import build_lr_scheduler, build_optimizer

    param = torch.nn.Parameter(torch.ones(4, 4))
    opt = build_optimizer([("w", param)], config.optimizer, zero_stage=0)
    sched = build_lr_scheduler(opt, config.optimizer, config.training.train_steps)
    for step in range(min(config.training.train_steps, 100_000)):
        param.grad = torch.zeros_like(param)
        opt.step()
        sched.step()
        lr = opt.param_groups[0]["lr"]
        if not math.isfinite(lr) or not torch.isfinite(param).all():
            return f"step {step}: lr {lr}, weights finite: {bool(torch.isfinite(param).all())}"
    return ""


def _timedelta(config) -> str:
    import datetime

    try:
        datetime.timedelta(seconds=config.training.collective_timeout_s)
    except OverflowError as e:
        return f"collective_timeout_s {config.training.collective_timeout_s}: {e}"
    return ""


AFTER = {"lr_schedule": _lr_schedule, "collective_timeout": _timedelta}


def _sets(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--set"]


def _loaded(cfg: str, argv: list[str]):
    """The config as the loader reads it, or None when it refuses it (any exception)."""
    from nanotrain.config import load_config

    try:
        return load_config(cfg, _sets(argv))
    except Exception:  # noqa: BLE001 - refusing is one of the right answers here
        return None


def expectation(case, o: harness.Outcome, v: str, cfg: str, argv: list[str]) -> tuple[str, str]:
    """(verdict, detail) once the case's own expectations are applied to a contract-keeping answer."""
    if not v.startswith("ok"):
        text = (o.crash or o.stderr or " ".join(o.wrote)).strip()
        if o.crash and "\n" in text:  # the exception itself first: the frames may not fit
            text = text.splitlines()[-1] + "\n" + text
        return v, text[:800]
    line = o.stderr.strip()
    if case.expect == "ok-2" and v == "ok-0":
        return "accepted", (o.stdout.strip().splitlines() or [""])[0][:200]
    if case.expect == "ok-0" and v == "ok-2":
        return "refused", line
    if v == "ok-2" and case.names and not all(n.lower() in line.lower() for n in case.names):
        return "unnamed", f"wants {case.names}: {line}"
    if v == "ok-0":
        if case.stdout_has and case.stdout_has not in o.stdout:
            return "wrong-meaning", f"stdout lacks {case.stdout_has!r}"
        bad = harness.unsafe_chars(o.stdout)
        if bad:
            return "unsafe-output", f"stdout holds {', '.join(bad)}"
    if case.value:
        config = harness_call(lambda: _loaded(cfg, argv))
        if config is not None:
            section, name = case.value["field"].split(".", 1)
            meta = scalar_fields().get((section, name), (None, {}))[1]
            problem = reading_problem(
                case.value["text"], get_value(config, section, name), meta, case.value.get("means")
            )
            if problem:
                return "wrong-meaning", f"{case.value['field']} given {case.value['text']!r}: {problem}"
    if case.after and v == "ok-0":
        config = harness_call(lambda: _loaded(cfg, argv))
        problem = config is not None and harness_call(lambda: AFTER[case.after](config))
        if problem:
            return "wrong-meaning", f"accepted, then in the ranks: {problem}"
    return v, line


def harness_call(fn, hang_s: float = 10.0):
    """fn() under the hang guard; None when it hangs (the oracle must not stall the run)."""
    box = {}
    o = harness.run_main(lambda _argv: box.setdefault("r", fn()) and 0, [], [], hang_s)
    return box.get("r") if not o.crash else None


def run_case(case, ws, hang_s: float, as_process: bool = False) -> tuple[str, str, harness.Outcome]:
    """(verdict, detail, outcome) of one case; the workspace is reset after it."""
    cfg = ws.paths["cfg"]
    if ws.reads_unreadable and "@unreadable@" in " ".join(case.argv) + case.config_text():
        case = dataclasses.replace(case, expect="any")
    Path(cfg).write_bytes(ws.resolve(case.config_text()).encode("utf-8", "surrogatepass"))
    argv = [ws.resolve(a) for a in case.argv]
    fakes = _fake_dir(ws.root / "fakes", {"sbatch": DENY, "srun": DENY, "scancel": DENY})
    path = str(fakes) + os.pathsep + os.environ.get("PATH", "")
    if case.fake:
        path = str(_fake_dir(ws.root / f"fakes_{case.label.split()[0]}", case.fake)) + os.pathsep + path
    if case.process or as_process:  # a fresh interpreter on a loaded machine: the longer guard
        timeout = case.timeout_s or max(hang_s, harness.HANG_S)
        env = dict(os.environ, **case.env, PATH=path, PYTHONPATH=str(ROOT))
        o = harness.run_process(target_command(case.target) + argv, ws.cwd, ws.watched(), timeout, env)
    else:
        timeout = case.timeout_s or hang_s
        old_path, old_cwd = os.environ.get("PATH", ""), os.getcwd()
        os.environ["PATH"] = path
        os.chdir(ws.cwd)
        try:
            o = harness.run_main(target_main(case.target), argv, ws.watched(), timeout)
        finally:
            os.environ["PATH"] = old_path
            os.chdir(old_cwd)
    v = harness.verdict(o, strict=True)
    writes = case.writes or case.target in ("export_hf", "reshard_checkpoint")
    if (
        v == "wrote-files"
        and o.code == 0
        and case.expect != "ok-2"
        and writes
        and not any(w.startswith(str(ws.ckpt)) for w in o.wrote)
    ):
        v = "ok-0"  # a successful export, reshard or --emit writes its output (never into the checkpoint)
    v, detail = expectation(case, o, v, cfg, argv)
    touched_ckpt = any(w.startswith(str(ws.ckpt)) for w in o.wrote)
    ws.reset()
    if touched_ckpt:
        ws.rebuild_checkpoint()
    return v, detail, o
