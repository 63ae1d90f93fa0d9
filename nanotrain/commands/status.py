"""`submit.py --status logs/<run>`: where a run stands, from its run directory alone.

The scheduler is asked in order of freshness: `squeue` knows pending and running jobs, `sacct`
knows finished ones (when accounting is on), `scontrol` knows both for a few minutes after the end
(MinJobAge) and is the only one that counts requeues directly (`Restarts=`); `sacct -D` counts
them as one record per incarnation. Whichever answers first gives the state, so the command
works on clusters without accounting and right after a job ends, before sacct has caught up;
but a job squeue still lists as COMPLETING has ended, and the state it ended in (FAILED, ...)
comes from the source that knows it.
Training progress comes from `<run_dir>/progress.json`, written atomically by the logging rank.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

from nanotrain.commands.prepare import prepared_line
from nanotrain.config import ConfigError
from nanotrain.config.cli_args import one_line
from nanotrain.logging.metrics import PROGRESS_FILE, format_eta
from nanotrain.runtime import eval_record, exclusions, rundir, slurm_commands
from nanotrain.runtime.hang_status import hang_lines
from nanotrain.runtime.rundir import Launcher

# What a finished job's exit code means (the codes of `runtime/task.py`).
EXIT_MEANINGS = {
    0: "completed",
    2: "a user error found inside a rank: see the job log's `error:` line",
    3: "training diverged: nothing saved after the last finite step",
    4: "the job hung (see the hang lines below)",
    75: "stopped and saved, but not requeued (a user's scancel, or slurm.max_requeues spent)",
}
RUN_DIR_MARKERS = (rundir.CONFIG_FILE, rundir.LAUNCH_FILE, PROGRESS_FILE)


@dataclass
class JobInfo:
    """What the scheduler said about one job; `None` fields were not answered by anyone."""

    job_id: str
    state: Optional[str] = None
    source: Optional[str] = None  # squeue | sacct | scontrol
    restarts: Optional[int] = None
    nodes: Optional[str] = None
    reason: Optional[str] = None
    exit_code: Optional[int] = None  # the batch script's, once the job has ended
    asked: list[str] = field(default_factory=list)


def _query(argv: list[str]) -> Optional[str]:
    """stdout of a scheduler command, or None when it is missing, fails, or hangs."""
    return slurm_commands.answer(argv)


def _nodes(value: str) -> Optional[str]:
    value = value.strip()
    return None if value in ("", "(null)", "None assigned") else value


def query_squeue(job_id: str) -> Optional[dict]:
    out = _query(["squeue", "-h", "-j", job_id, "-o", "%T|%N|%r"])
    if not out or not out.strip():
        return None  # not queued any more (or unknown): ask the others
    state, nodes, reason = (out.strip().splitlines()[0].split("|") + ["", ""])[:3]
    return {"state": state, "nodes": _nodes(nodes), "reason": reason if reason not in ("", "None") else None}


def query_sacct(job_id: str) -> Optional[dict]:
    out = _query(["sacct", "-j", job_id, "-X", "-n", "-P", "-D", "-o", "JobID,State,NodeList,ExitCode"])
    rows = [line.split("|") for line in (out or "").splitlines() if line.strip()]
    # A job array's task is asked for by "<array>_<index>" and answers with that id.
    rows = [r + [""] for r in rows if len(r) >= 3 and job_id in (r[0], r[0].split("_")[0])]
    if not rows:
        return None
    _, state, nodes, code = rows[-1][:4]  # one record per incarnation; the last is the current one
    return {"state": state.split()[0], "nodes": _nodes(nodes), "restarts": len(rows) - 1, "exit_code": _exit_code(code)}


def query_scontrol(job_id: str) -> Optional[dict]:
    out = _query(["scontrol", "show", "job", job_id])
    fields = dict(re.findall(r"(?<![\w/])(\w+)=(\S*)", out or ""))
    if "JobState" not in fields:
        return None
    restarts = fields.get("Restarts")
    reason = fields.get("Reason")
    return {
        "state": fields["JobState"],
        "nodes": _nodes(fields.get("NodeList", "")),
        "restarts": int(restarts) if restarts and restarts.isdigit() else None,
        "reason": reason if reason not in (None, "", "None") else None,
        "exit_code": _exit_code(fields.get("ExitCode", "")),
    }


def _exit_code(text: str) -> Optional[int]:
    """The exit status of SLURM's ``ExitCode`` (``"75:0"``: status 75, no signal)."""
    code = text.split(":")[0]
    return int(code) if code.isdigit() else None


def slurm_job_info(job_id: str) -> JobInfo:
    info = JobInfo(job_id=str(job_id))
    answers = {}
    for name, query in (("squeue", query_squeue), ("sacct", query_sacct), ("scontrol", query_scontrol)):
        info.asked.append(name)
        answers[name] = query(info.job_id)
    # COMPLETING: the job has ended and SLURM is cleaning up (epilog, tasks being killed); how it
    # ended is already in sacct (or scontrol), so a source that says so wins over squeue's word.
    answered = [name for name in ("squeue", "sacct", "scontrol") if answers[name]]
    ended = [name for name in answered if answers[name]["state"] != "COMPLETING"]
    if answered:
        info.source = (ended or answered)[0]
        info.state = answers[info.source]["state"]
    if info.state is not None:
        info.reason = answers[info.source].get("reason") or (answers["scontrol"] or {}).get("reason")
        # A pending job has no nodes; scontrol still names those of a requeued job's last run.
        if info.state != "PENDING":
            info.nodes = next(
                (
                    answers[name]["nodes"]
                    for name in (info.source, "squeue", "scontrol", "sacct")
                    if answers[name] and answers[name].get("nodes")
                ),
                None,
            )
    if info.state not in (None, "PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED"):
        info.exit_code = next(
            (
                answers[name]["exit_code"]
                for name in (info.source, "sacct", "scontrol")
                if answers[name] and answers[name].get("exit_code") is not None
            ),
            None,
        )
    for name in ("scontrol", "sacct"):  # scontrol counts requeues itself; sacct by records
        if answers[name] and answers[name].get("restarts") is not None:
            info.restarts = answers[name]["restarts"]
            break
    return info


def _job_id_from_logs(run_dir: Path) -> Optional[str]:
    """A run started from an `--emit`ted script has no launch.json; its job logs (`%j_...`) in
    `job/` still name the job. The highest id is the latest submission."""
    ids = [int(m.group(1)) for p in (run_dir / "job").glob("*") if (m := re.match(r"(\d+)[_.]", p.name))]
    return str(max(ids)) if ids else None


def _check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise ConfigError(f"--status: {run_dir} is not a directory (expected a run directory such as logs/<run>)")
    if not any((run_dir / name).is_file() for name in RUN_DIR_MARKERS):
        raise ConfigError(
            f"--status: {run_dir} is not a run directory (none of {', '.join(RUN_DIR_MARKERS)} in it) "
            "nor a sweep directory (no sweep.json)"
        )


# progress.json field -> what --status does with it. The file is ours (written atomically), but
# it lives in a user-writable directory: a damaged one is named, never a traceback.
_WHOLE = ("step", "total_steps")  # integers >= 0
_NUMBERS = ("loss", "val_loss", "tokens_per_sec", "mfu", "eta_s", "time")  # numbers (loss may be nan)


def _read_progress(run_dir: Path) -> Optional[dict]:
    """progress.json, checked field by field; None when there is none yet."""
    path = run_dir / PROGRESS_FILE
    if not path.is_file():
        return None
    fix = "it is rewritten at the next log step; delete it to show no progress until then"
    try:
        progress = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError:  # not UTF-8, not JSON
        raise ConfigError(f"{path}: not a JSON progress record; {fix}") from None
    if not isinstance(progress, dict):
        raise ConfigError(f"{path}: expected a JSON object, found a {type(progress).__name__}; {fix}")
    for key in _WHOLE + _NUMBERS:
        value = progress.get(key)
        if value is None:
            continue
        whole = key in _WHOLE
        ok = isinstance(value, int if whole else (int, float)) and not isinstance(value, bool)
        if not ok or (whole and value < 0):
            expected = "a whole number >= 0" if whole else "a number"
            raise ConfigError(f"{path}: '{key}' is {str(value)[:40]!r}, not {expected}; {fix}")
    for key in ("eta_s", "time"):  # used in arithmetic: a non-finite one is simply unknown
        if progress.get(key) is not None and not math.isfinite(progress[key]):
            progress[key] = None
    return progress


def _total_steps_from_config(run_dir: Path) -> Optional[int]:
    try:
        return rundir.load_run_config(run_dir).training.train_steps
    except Exception:  # a missing or unreadable config only costs the "of N" in the output
        return None


def progress_line(progress: Optional[dict], run_dir: Path, now: Optional[float] = None) -> str:
    if not progress:
        total = _total_steps_from_config(run_dir)
        return "progress: no progress yet" + (f" (0/{total} steps)" if total else "")
    now = time.time() if now is None else now
    step, total = progress.get("step"), progress.get("total_steps")
    parts = [f"step {step}/{total}" + (f" ({100 * step / total:.1f}%)" if step is not None and total else "")]
    if progress.get("loss") is not None:
        parts.append(f"loss {progress['loss']:.4f}")
    if progress.get("tokens_per_sec") is not None:
        parts.append(f"tokens/s {progress['tokens_per_sec']:,.0f}")
    if progress.get("mfu") is not None:
        parts.append(f"mfu {100 * progress['mfu']:.1f}%")
    age = now - progress["time"] if progress.get("time") else None
    if step is not None and total and step >= total:
        parts.append("done")
    elif progress.get("eta_s") is not None:
        # The ETA was written at the last log step; count down the time since.
        parts.append(f"ETA {format_eta(max(0.0, progress['eta_s'] - (age or 0.0)))}")
    line = "progress: " + " | ".join(parts)
    if age is not None:
        line += f" (updated {format_eta(max(0.0, age))} ago)"
    return line


def show_status(run_dir: str | Path, out: TextIO | None = None) -> int:
    """Print the run's state; ConfigError (-> one `error:` line, exit 2) if it is not a run dir."""
    out = out or sys.stdout
    run_dir = Path(run_dir).expanduser()
    _check_run_dir(run_dir)
    launch = rundir.read_launch_record(run_dir) if (run_dir / rundir.LAUNCH_FILE).is_file() else {}
    launcher = rundir.recorded_launcher(launch)
    job_id = launch.get("job_id")
    if job_id is None and launcher in (None, Launcher.SLURM):
        job_id = _job_id_from_logs(run_dir)
        if job_id is not None and launcher is None:
            launcher = Launcher.SLURM
    print(f"run: {run_dir.resolve()}", file=out)
    launched = f", launched {launch['time']}" if launch.get("time") else ""
    print(f"mode: {launcher.value if launcher else 'unknown (no launch.json)'}{launched}", file=out)
    if launcher is Launcher.SLURM and job_id is not None:
        info = slurm_job_info(str(job_id))
        if info.state is None:
            state = f"unknown ({'/'.join(info.asked)} did not answer)"
        else:
            state = f"{info.state} (from {info.source})"
            if info.reason and info.state == "PENDING":
                state += f", reason {info.reason}"
        print(f"job: {job_id}", file=out)
        print(f"state: {state}", file=out)
        print(f"requeues: {info.restarts if info.restarts is not None else 'unknown'}", file=out)
        print(f"nodes: {info.nodes or '-'}", file=out)
        waiting = info.state == "PENDING" and (info.reason or "").startswith(("BadConstraints", "ReqNodeNotAvail"))
        excluded = [e["node"] for e in exclusions.read_record(run_dir)["nodes"]]
        if waiting and excluded:
            print(
                f"note: the job waits for nodes outside the excluded {', '.join(excluded)}; continue on fewer "
                f"nodes: scancel {job_id}, then python submit.py --resume {run_dir} --set ... (the exclusions "
                "stay), or on them: --set slurm.max_excluded_nodes=0",
                file=out,
            )
        if info.exit_code is not None:
            meaning = EXIT_MEANINGS.get(info.exit_code, "killed or failed outside training: see the job log")
            print(f"exit code: {info.exit_code}, {meaning}", file=out)
            if info.exit_code == 75:
                print(f"resume with: python submit.py --resume {run_dir}", file=out)
    elif launcher is Launcher.SLURM:
        print("state: unknown (no job id in launch.json or job/ logs)", file=out)
    elif launcher is Launcher.LOCAL:
        print("state: local processes (no scheduler to ask)", file=out)
    prepared = prepared_line(run_dir)
    print(prepared if prepared is not None else progress_line(_read_progress(run_dir), run_dir), file=out)
    for line in hang_lines(run_dir):  # a run that hung: the culprit, from the ranks' reports
        print(line, file=out)
    for line in exclusions.status_lines(run_dir):  # start-up health, excluded nodes, stragglers
        print(line, file=out)
    skipped = skipped_line(run_dir)
    if skipped is not None:
        print(skipped, file=out)
    for line in eval_lines(run_dir):
        print(line, file=out)
    return 0


def eval_lines(run_dir: Path, shown: int = 10) -> list[str]:
    """The evaluation jobs of ``checkpoints.eval_job`` (``<run>/eval/step_N.json``): a count by
    state, then one line per checkpoint (the last ``shown``). A job whose record still says it is
    queued or running is asked of the scheduler, which knows when it died without a word (a
    time limit, a node failure, a cancellation)."""
    records = eval_record.read_records(run_dir)
    if not records:
        return []
    rows = []
    for r in records[-shown:]:
        try:
            rows.append("  " + one_line(_eval_row(r)))
        except (TypeError, ValueError, KeyError, AttributeError):  # a record edited by hand: named, not a traceback
            rows.append(f"  step {r['step']}: {eval_record.record_path(run_dir, r['step'])} is unreadable")
    counts = {}
    for r in records:
        state = str(r.get("state", "unknown"))
        counts[state] = counts.get(state, 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    return [one_line(f"eval jobs: {len(records)} ({summary})"), *rows]


def _eval_row(r: dict) -> str:
    """One evaluation record as a line of ``--status``."""
    state, job = r.get("state", "unknown"), r.get("job_id")
    where = f"job {job}" if job else ("local pid " + str(r.get("pid")) if r.get("launcher") == "local" else "-")
    if state not in eval_record.FINISHED and job and r.get("launcher") != "local":
        info = slurm_job_info(str(job))
        if info.state is not None and info.state not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
            state = f"{state}, but the job is {info.state}" + (
                f" (exit code {info.exit_code})" if info.exit_code is not None else ""
            )
    losses = ", ".join(
        f"{name} loss {v['loss']:.4f} ppl {v['perplexity']:.2f}" for name, v in r.get("results", {}).items()
    )
    detail = "; ".join(x for x in (losses, r.get("error")) if x)
    log = f" (log {r['log']})" if r.get("log") and r.get("state") == "failed" else ""
    return f"step {r['step']}: {where} {state}" + (f": {detail}" if detail else "") + log


def skipped_line(run_dir: Path, shown: int = 10) -> Optional[str]:
    """The steps `training.spike` left without an update and its rewinds (``<run>/spikes.jsonl``,
    written by training/spike.py; read here without importing it, which would import torch)."""
    path = run_dir / "spikes.jsonl"
    if not path.is_file():
        return None
    try:
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        steps = [int(e["step"]) for e in entries if "step" in e]
        rewinds = [f"{int(e['at_step'])}->{int(e['to_step'])}" for e in entries if "rewind" in e]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"skipped steps: {path} is unreadable"
    if not entries:
        return "skipped steps: none"
    listed = ", ".join(map(str, steps[-shown:])) + "; " if steps else ""
    line = f"skipped steps: {len(steps)} ({'..., ' if len(steps) > shown else ''}{listed}details in {path})"
    return line + (f"; rewinds: {len(rewinds)} (step->checkpoint: {', '.join(rewinds[-shown:])})" if rewinds else "")
