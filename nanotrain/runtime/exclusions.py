"""Nodes a run keeps off: named by the start-up health check, a hang or repeated stragglers, kept
in ``<run>/excluded_nodes.json`` and applied to the job when it is requeued (and to ``--resume``).

Why on requeue, and held: SLURM takes ``ExcNodeList`` only from a job that is not running
("Job is no longer pending execution" for a running one, Slurm 22.05 on the local cluster), and a
requeued job could start again before a later update reached it. So the requeue is
``scontrol requeuehold`` (pending, held: it cannot start), ``scontrol update JobId=J
ExcNodeList=...`` (accepted for the held job), ``scontrol release``. A job that SLURM requeued
itself (preemption) is already pending: ``scontrol hold``, update, release. The caller is rank 0
(or the one hung rank that requeues): SLURM sends every process of the job step SIGTERM at the
requeue — the task's stop handler turns it into a flag, the scontrol commands that follow ignore
it (``slurm_commands.run(survive_term=True)``: an update killed by it failed without a word on
the local cluster) — and SIGKILL only KillWait seconds later (5 s on the local cluster, 30 s by
default), far more than the three commands take. A job's ``ExcNodeList`` stays with it across
requeues, and the user's own (``sbatch_extra: {exclude: ...}``) is kept.

The exclusion does not ask whether the partition keeps enough nodes for the job: a job whose
nodes are all excluded waits (``Reason=BadConstraints``) — the log and ``--status`` say so, and
``submit.py --resume RUN --set ...`` on fewer nodes (which keeps the exclusions) or
``--set slurm.max_excluded_nodes=0`` (which drops them) continues it.

Standard library only (with ``slurm_commands``): ``preemption.py`` requeues through it before
torch is imported, and ``--status`` reads the record without torch.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Optional, Sequence

from nanotrain.config.atomic_files import atomic_write_json
from nanotrain.runtime import slurm_commands

EXCLUDED_FILE = "excluded_nodes.json"
HEALTH_DIR = "health"  # <run>/health/: start-up checks (startup.jsonl) and stragglers (stragglers.jsonl)
STRAGGLERS_FILE = "stragglers.jsonl"
STARTUP_FILE = "startup.jsonl"  # one line per start-up health check (runtime/health.py)
# sinfo's node states in which a node can run jobs (a trailing '*': not responding)
_USABLE = {"idle", "mixed", "allocated", "completing", "planned", "reserved"}
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # one SLURM node name: nothing a command could misread


def record_path(run_dir: Path) -> Path:
    return Path(run_dir) / EXCLUDED_FILE


def read_record(run_dir: Path) -> dict:
    """``{"nodes": [{node, source, why, job_id, restart, time}], "applied": [...]}``; empty lists
    when the run has none (or the file is unreadable: a record is advice, never a failure)."""
    try:
        data = json.loads(record_path(run_dir).read_text())
    except (OSError, ValueError):
        return {"nodes": [], "applied": []}
    if not isinstance(data, dict):
        return {"nodes": [], "applied": []}
    nodes = [e for e in data.get("nodes", []) if isinstance(e, dict) and _NODE.match(str(e.get("node", "")))]
    applied = [e for e in data.get("applied", []) if isinstance(e, dict)]
    return {"nodes": nodes, "applied": applied}


def excluded(run_dir: Path, limit: int) -> list[str]:
    """The run's excluded nodes, oldest first, at most ``limit`` (slurm.max_excluded_nodes)."""
    return [e["node"] for e in read_record(run_dir)["nodes"]][: max(0, int(limit))]


def add(
    run_dir: Path,
    node: str,
    source: str,
    why: str,
    limit: int,
    job_id: Optional[str] = None,
    restart: Optional[int] = None,
) -> tuple[bool, str]:
    """Record ``node`` as excluded (``source``: health | hang | stragglers); returns (added, a
    phrase for the log: "excluded" or why not). One writer at a time: rank 0, or the hung rank
    that requeues."""
    record = read_record(run_dir)
    names = [e["node"] for e in record["nodes"]]
    if not _NODE.match(node):
        return False, f"not excluded: {node!r} is not a SLURM node name"
    if node in names[: max(0, limit)]:
        return False, "already excluded"
    if len(names) >= limit:
        return False, (
            f"not excluded: slurm.max_excluded_nodes is {limit}"
            + (f" and the run excludes {', '.join(names[:limit])} already" if limit else "")
        )
    record["nodes"].append(
        {"node": node, "source": source, "why": why, "job_id": job_id, "restart": restart, "time": time.time()}
    )
    atomic_write_json(record_path(run_dir), record)
    return True, "excluded"


def note_applied(run_dir: Path, job_id: str, restart: int, nodes: Sequence[str], how: str) -> None:
    record = read_record(run_dir)
    record["applied"].append(
        {"job_id": str(job_id), "restart": restart, "nodes": list(nodes), "how": how, "time": time.time()}
    )
    atomic_write_json(record_path(run_dir), record)


# ------------------------------------------------------------------- stragglers, from the logger
def straggler_nodes(run_dir: Path) -> list[dict]:
    """The nodes the straggler watch named (``<run>/health/stragglers.jsonl``, written by the
    logging rank: ``logging/stragglers.py``), oldest first."""
    path = Path(run_dir) / HEALTH_DIR / STRAGGLERS_FILE
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and _NODE.match(str(entry.get("node", ""))):
            out.append(entry)
    return out


def merge_stragglers(run_dir: Path, limit: int, job_id=None, restart=None) -> None:
    """Add the nodes the straggler watch named to the excluded ones (at a requeue: a straggler
    alone does not requeue the job)."""
    for entry in straggler_nodes(run_dir):
        why = entry.get("why") or "repeated straggler"
        added, note = add(run_dir, entry["node"], "stragglers", why, limit, entry.get("job_id"), entry.get("restart"))
        if added:
            print(f"stragglers: node {entry['node']} excluded from the next run of the job ({why})", flush=True)


# ------------------------------------------------------------------------------- SLURM's side
def _scontrol(*args: str) -> tuple[bool, str]:
    """(ok, what scontrol said) for one bounded ``scontrol`` command, immune to the SIGTERM that
    the requeue sends every process of the job step (``slurm_commands._IGNORE_TERM``)."""
    try:
        done = slurm_commands.run(["scontrol", *args], survive_term=True)
    except slurm_commands.SlurmCommandError as exc:
        return False, str(exc)
    said = " ".join((done.stderr or done.stdout or "").split())
    if done.returncode != 0 and not said:
        said = f"exit status {done.returncode}"
    return done.returncode == 0, said


def job_excluded(job_id: str) -> list[str]:
    """The job's ``ExcNodeList`` from scontrol, expanded (``n[1-2]`` -> n1, n2); [] if none or
    unknown."""
    shown = slurm_commands.answer(["scontrol", "show", "job", str(job_id)]) or ""
    match = re.search(r"(?<![\w/])ExcNodeList=(\S+)", shown)
    if not match or match.group(1) in ("(null)", ""):
        return []
    names = slurm_commands.answer(["scontrol", "show", "hostnames", match.group(1)])
    return names.split() if names else [match.group(1)]


def requeue_excluding(job_id: str, nodes: Sequence[str], already_requeued: bool = False) -> tuple[bool, str]:
    """Requeue job ``job_id`` (unless SLURM ``already_requeued`` it) so that its next run avoids
    ``nodes`` as well as what it avoided already: hold, update ExcNodeList, release. Returns
    (requeued, one line for the log)."""
    job_id = str(job_id)
    before = job_excluded(job_id)
    wanted = before + [n for n in nodes if n not in before]
    if already_requeued:
        held, said = _scontrol("hold", job_id)
        if not held:
            return True, f"requeued by SLURM; exclusion not applied (scontrol hold: {said})"
    else:
        held, said = _scontrol("requeuehold", job_id)
        if not held:  # a cluster that refuses requeuehold still requeues, without the exclusion
            ok, plain = _scontrol("requeue", job_id)
            return ok, f"requeuehold refused ({said}); requeued without the exclusion" if ok else (
                f"scontrol requeuehold and requeue failed: {said}; {plain}"
            )
    updated, said_update = _scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(wanted)}")
    released, said_release = _scontrol("release", job_id)
    if not released:
        released, said_release = _scontrol("release", job_id)  # once more: a held job never starts
    parts = [f"ExcNodeList={','.join(wanted)}" if updated else f"exclusion refused by scontrol update ({said_update})"]
    if not released:
        parts.append(f"the job is still held: release it with `scontrol release {job_id}` ({said_release})")
    return True, "; ".join(parts)


def to_exclude(run_dir: Path, job_id, restart: int, limit: int) -> list[str]:
    """The run's excluded nodes that job ``job_id`` does not avoid yet (the straggler watch's
    merged in first); [] when a plain requeue will do."""
    if limit <= 0 or job_id is None:
        return []
    merge_stragglers(run_dir, limit, job_id, restart)
    nodes = excluded(run_dir, limit)
    if not nodes:
        return []
    avoided = job_excluded(str(job_id))
    return [n for n in nodes if n not in avoided]


def fit_warning(run_dir: Path, limit: int, environ=os.environ, min_nodes: Optional[int] = None) -> Optional[str]:
    """Inside a SLURM job: why the requeued job will not start, when the job's partition has fewer
    usable nodes outside the excluded ones than the job needs: ``min_nodes``, the fewest of a
    node range (``slurm.nodes: min-max``: the requeue gets its range back), else the nodes it has
    (None when it fits, or unknown)."""
    partition = environ.get("SLURM_JOB_PARTITION")
    needed = str(min_nodes) if min_nodes is not None else environ.get("SLURM_JOB_NUM_NODES", "")
    if not partition or not needed.isdigit():
        return None
    out = slurm_commands.answer(["sinfo", "-h", "-N", "-p", partition, "-o", "%N %T"])
    if out is None:
        return None
    usable = {p[0] for p in (line.split() for line in out.splitlines()) if len(p) == 2 and p[1] in _USABLE}
    gone = excluded(run_dir, limit)
    left = sorted(usable - set(gone))
    if len(left) >= int(needed):
        return None
    job = environ.get("SLURM_JOB_ID", "JOB")
    return (
        f"the job needs {needed} node(s) and partition {partition} has {len(left)} usable outside the excluded "
        f"{', '.join(gone)}: the requeued job waits (BadConstraints) until enough nodes come; continue now on "
        f"fewer nodes: scancel {job}, then python submit.py --resume {run_dir} --set ... (the exclusions stay), "
        "or on them: --set slurm.max_excluded_nodes=0"
    )


# ---------------------------------------------------------------------------------- --status
def last_startup(run_dir: Path) -> Optional[dict]:
    """The newest start-up health check (``<run>/health/startup.jsonl``), or None."""
    path = Path(run_dir) / HEALTH_DIR / STARTUP_FILE
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        entry = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


def startup_line(entry: dict) -> str:
    """The latest health check as one --status line."""
    where = f"job {entry.get('job_id')} restart {entry.get('restart')}" if entry.get("job_id") else "local"
    size = f"{entry.get('node_count')} node(s), {entry.get('tasks')} tasks"
    head = f"health ({where}, {entry.get('seconds', 0):.1f} s, {size})"
    slow = entry.get("slow") or []
    if not slow:
        checks = entry.get("checks") or {}
        worst = ", ".join(f"{k} {v['max_ratio']:.2f}x" for k, v in checks.items() if isinstance(v, dict))
        return f"{head}: ok" + (f" (slowest vs the median: {worst})" if worst else "")
    worst: dict = {}  # (node, check) -> the worst finding (a node's tasks each have a matmul)
    for s in (s for s in slow if isinstance(s, dict)):
        key = (s["node"], s["check"])
        if key not in worst or s["ratio"] > worst[key]["ratio"]:
            worst[key] = s
    found = "; ".join(
        f"{node} {check} {s['ratio']:.1f}x the median (limit {s['limit']:g})" for (node, check), s in worst.items()
    )
    return f"{head}: slow: {found}"


def status_lines(run_dir: Path) -> list[str]:
    """The latest start-up health check, ``excluded nodes: ...`` and the stragglers named since
    the last requeue, for --status."""
    record = read_record(run_dir)
    lines = []
    startup = last_startup(run_dir)
    if startup is not None:
        try:
            lines.append(startup_line(startup))
        except (KeyError, TypeError, ValueError):
            lines.append(f"health: {Path(run_dir) / HEALTH_DIR / STARTUP_FILE} is unreadable")
    if record["nodes"]:
        listed = "; ".join(
            f"{e['node']} ({e.get('source', '?')}"
            + (f", job {e['job_id']}" if e.get("job_id") else "")
            + (f" restart {e['restart']}" if isinstance(e.get("restart"), int) else "")
            + f": {e.get('why', '')})"
            for e in record["nodes"]
        )
        lines.append(f"excluded nodes: {listed}")
        if record["applied"]:
            last = record["applied"][-1]
            lines.append(
                f"exclusion applied: job {last['job_id']} ExcNodeList {','.join(last.get('nodes', []))} "
                f"({last.get('how', '')})"
            )
    named = {e["node"] for e in record["nodes"]}
    pending = [e for e in straggler_nodes(run_dir) if e["node"] not in named]
    if pending:
        lines.append(
            "stragglers: "
            + "; ".join(f"{e['node']} ({e.get('why', '')})" for e in pending)
            + " (excluded at the next requeue)"
        )
    return lines
