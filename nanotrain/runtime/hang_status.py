"""Read the hang reports of a run (``<run>/hang/rank-R.json``, ``runtime/hang.py``) and name the culprit.

The rank that causes a hang is the one that writes least: a stopped process (SIGSTOP, a frozen
node) writes nothing at all, and its peers all wait in a collective it never entered. So the
culprit is, in order: a rank with no report (its peers' collective is the one it did not reach);
else a rank that was itself frozen (its watchdog saw the whole process not run: a SIGSTOPped
task that SLURM continues with SIGCONT before killing it writes its report late); else a rank
that is not waiting in communication (stuck in its own code, e.g. asleep inside a pipeline
step); else the rank at the earliest step. Only the reports of the latest incarnation
count (a requeued job's earlier hang is history, counted separately).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

HANG_DIR = "hang"  # <run>/hang/: the reports; standard library only here (`--status` loads no torch)
SMOKE_DIR = "smoke"  # <run>/smoke/rank-R.json: every task's start-up report (runtime/smoke.py)


def read_reports(run_dir: Path) -> list[dict]:
    """The latest incarnation's reports (same job id and restart as the newest one), by rank."""
    reports = []
    for path in sorted((Path(run_dir) / HANG_DIR).glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a report cut short by the kill: the others still tell the story
        if isinstance(data, dict) and isinstance(data.get("rank"), int):
            reports.append(data)
    if not reports:
        return []
    newest = max(reports, key=lambda r: r.get("time") or 0)
    key = (newest.get("job_id"), newest.get("restart"))
    return sorted((r for r in reports if (r.get("job_id"), r.get("restart")) == key), key=lambda r: r["rank"])


def requeue_marker(run_dir: Path, job_id, restart) -> Path:
    """The marker file of one hang-requeued incarnation (job id, restart count): created once by
    the first hung rank that asks for the requeue, counted by `requeues_after_hang`."""
    return Path(run_dir) / HANG_DIR / f"requeue-{job_id}-{restart}"


def requeues_after_hang(run_dir: Path) -> int:
    """How many times a hang requeued the job (one marker file per requeued incarnation)."""
    return len(list((Path(run_dir) / HANG_DIR).glob("requeue-*")))


def _group_text(collective: Optional[dict]) -> tuple[str, str]:
    if not collective:
        return "a collective", "its group"
    group = collective.get("group") or {}
    ranks = ", ".join(str(r) for r in group.get("ranks", []))
    return collective.get("name", "a collective"), f"{group.get('name', 'group')} (ranks {ranks})"


def culprit(reports: list[dict], run_dir: Optional[Path] = None) -> Optional[str]:
    """ "hung at step S in PHASE; rank R (node N, host H) did not reach COLLECTIVE on GROUP (ranks
    ...)", or None. ``run_dir``: where a silent rank's node and host are looked up (its smoke
    report of the same incarnation)."""
    found = find_culprit(reports, run_dir)
    return found["text"] if found else None


def find_culprit(reports: list[dict], run_dir: Optional[Path] = None) -> Optional[dict]:
    """The culprit of the latest incarnation's reports: ``{"rank", "node", "host", "text"}``
    (node and host None when unknown), or None without reports."""
    if not reports:
        return None
    world = max(int(r.get("world_size") or 0) for r in reports)
    present = {r["rank"] for r in reports}
    missing = sorted(set(range(world)) - present)
    if missing:
        # A silent rank that a reporting rank waits for (its last collective's group holds it).
        waited = [
            m
            for m in missing
            if any(r.get("collective") and m in r["collective"]["group"].get("ranks", []) for r in reports)
        ]
        rank = (waited or missing)[0]
        waiters = [r for r in reports if r.get("collective") and rank in r["collective"]["group"].get("ranks", [])]
        witness = min(waiters or reports, key=lambda r: (r.get("step", 0), r["rank"]))
        name, group = _group_text(witness.get("collective"))
        others = f" (also silent: {', '.join(map(str, missing[1:]))})" if len(missing) > 1 else ""
        node, host = _where(rank, reports, run_dir)
        return {
            "rank": rank,
            "node": node,
            "host": host,
            "text": (
                f"hung at step {witness.get('step')} in {witness.get('phase')}; rank {rank}{_at(node, host)} did not "
                f"reach {name} on {group}{others}; rank {rank} wrote no report (stopped or dead)"
            ),
        }
    frozen = [r for r in reports if (r.get("frozen_s") or 0) > 0]
    stuck = [r for r in reports if not r.get("waiting_in_communication")]
    if frozen:
        target = max(frozen, key=lambda r: (r["frozen_s"], -r["rank"]))
    else:
        target = min(stuck or reports, key=lambda r: (r.get("step", 0), r["rank"]))
    rank = target["rank"]
    waiters = [
        r
        for r in reports
        if r is not target and r.get("collective") and rank in r["collective"]["group"].get("ranks", [])
    ]
    name, group = _group_text((waiters[0] if waiters else target).get("collective"))
    why = f"; rank {rank} was frozen for {target['frozen_s']:.0f} s (stopped)" if frozen else ""
    own = target.get("collective")
    last = f"; its last collective: {_group_text(own)[0]} on {_group_text(own)[1]}" if own and waiters else ""
    node, host = _where(rank, reports, run_dir)
    return {
        "rank": rank,
        "node": node,
        "host": host,
        "text": (
            f"hung at step {target.get('step')} in {target.get('phase')}; rank {rank}{_at(node, host)} did not "
            f"reach {name} on {group}{why}{last}"
        ),
    }


def _at(node: Optional[str], host: Optional[str]) -> str:
    """ " (node n2, host vm)": SLURM's node name and the host name (hosts may share one)."""
    parts = [f"node {node}"] if node and node != host else []  # off SLURM the node is the host
    parts += [f"host {host}"] if host else []
    return f" ({', '.join(parts)})" if parts else ""


def _where(rank: int, reports: list[dict], run_dir: Optional[Path]) -> tuple[Optional[str], Optional[str]]:
    """(node, host) of ``rank``: from its own report, else from its smoke report of the same
    incarnation (``<run>/smoke/rank-R.json``, written at start-up by every task)."""
    own = next((r for r in reports if r["rank"] == rank), None)
    if own is not None and (own.get("node") or own.get("host")):
        return own.get("node"), own.get("host")
    if run_dir is None:
        return None, None
    try:
        smoke = json.loads((Path(run_dir) / SMOKE_DIR / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(smoke, dict):
        return None, None
    newest = max(reports, key=lambda r: r.get("time") or 0)
    same_job = str(smoke.get("job_id")) == str(newest.get("job_id")) or newest.get("job_id") is None
    same_run = smoke.get("restart", newest.get("restart")) == newest.get("restart")
    if not (same_job and same_run):
        return None, None  # a smoke report of another incarnation: the rank may have moved
    return smoke.get("node"), smoke.get("host")


def hang_lines(run_dir: Path) -> list[str]:
    """The lines `--status` adds for a run that hung (none for one that never did)."""
    reports = read_reports(run_dir)
    lines = []
    found = culprit(reports, run_dir)
    if found:
        files = ", ".join(f"rank-{r['rank']}.json" for r in reports)
        lines.append(f"hang: {found} (reports: {Path(run_dir) / HANG_DIR}/ {files})")
    requeued = requeues_after_hang(run_dir)
    if requeued:
        lines.append(f"hangs requeued: {requeued}")
    return lines
