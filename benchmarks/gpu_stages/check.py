"""``Check``: one check's budget, its subprocesses and its summary. Every stage runs its
commands through ``Check.run`` (a session of their own, a log per command, a deadline after
which the whole process tree is killed), so that no stage can outlive the budget or leave a
rank holding a GPU; ``gpu_check.json`` is rewritten after every stage."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .limits import CAPS_S, MIN_STAGE_S, PASSING, ROOT

if TYPE_CHECKING:
    from .workspace import Workspace


class Stopped(Exception):
    """SIGTERM or SIGINT reached the check (the caller's timeout): the summary so far is kept."""


# ---------------------------------------------------------------------------- processes
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return kids


def _descendants(pid: int) -> set[int]:
    kids, found, todo = _children(), set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` (started with its own session), its group and every process it started:
    a local run's ranks (and the fork server) run in sessions of their own, which a group kill
    misses. The group is stopped first, so that nothing starts between the listing and the kill."""
    pids = _descendants(proc.pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        pids |= _descendants(proc.pid)
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


class Check:
    """The budget, the subprocesses and the summary of one check."""

    def __init__(self, out: Path, start: float, budget: float, smoke: bool, stage_count: int):
        self.out, self.start, self.budget, self.smoke = out, start, budget, smoke
        self.stage_count = stage_count  # the entry point's stage list: "complete" when all ran
        self.logs = out / "gpu_check"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.summary: dict = {
            "mode": "cpu-smoke" if smoke else "gpu",
            "budget_s": budget,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start)),
            "stages": [],
        }
        self.facts: dict = {}  # what a later stage needs from an earlier one (GPU count, the reference memory)
        self.ws: Workspace | None = None

    def left(self) -> float:
        return self.budget - (time.time() - self.start)

    def stage(self, name: str, fn) -> dict:
        limit = min(CAPS_S[name], self.left())
        entry: dict = {"name": name, "cap_s": CAPS_S[name], "limit_s": round(max(0.0, limit))}
        print(f"== {name} (up to {max(0.0, limit):.0f} s)", flush=True)
        t0 = time.monotonic()
        stopped = None
        if limit < MIN_STAGE_S:
            entry.update(
                status="timeout",
                rc=124,
                note=f"not started: {max(0.0, self.left()):.0f} s left of the {self.budget:.0f} s budget",
            )
        else:
            try:
                entry.update(fn(self, time.monotonic() + limit))
            except Stopped as exc:
                entry.update(status="timeout", rc=124, note="the check was stopped during this stage")
                stopped = exc
            except Exception as exc:  # noqa: BLE001 - one stage's bug must not lose the others' results
                entry.update(status="failed", note=f"{type(exc).__name__}: {exc}"[:500])
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        self.summary["stages"].append(entry)
        self.write()
        print(f"   {entry['status']}: {entry.get('note', '')}", flush=True)
        if stopped is not None:
            raise stopped
        return entry

    def write(self) -> None:
        self.summary["elapsed_s"] = round(time.time() - self.start, 1)
        self.summary["ok"] = all(s["status"] in PASSING for s in self.summary["stages"])
        self.summary["complete"] = len(self.summary["stages"]) == self.stage_count
        path = self.out / "gpu_check.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.summary, indent=1) + "\n")
        os.replace(tmp, path)

    def run(
        self,
        cmd: list[str],
        name: str,
        deadline: float,
        cap: float = math.inf,
        env: dict | None = None,
        fork: bool = False,
    ) -> dict:
        """``cmd`` in a session of its own, output to ``logs/NAME.log``, killed with everything it
        started at min(deadline, now + cap): rc 124. ``fork`` (with ``env``, --cpu-smoke only):
        forked from the workspace's fork server instead of started afresh."""
        timeout = max(1.0, min(cap, deadline - time.monotonic()))
        log = self.logs / f"{name}.log"
        t0 = time.monotonic()
        with open(log, "w") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            if fork and self.smoke:
                proc = self.ws.fork(cmd, env, fh.fileno())
            else:
                proc = subprocess.Popen(
                    cmd,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                rc = 124
                fh.write(f"\n[gpu check] killed after {timeout:.0f} s (rc 124)\n")
            except Stopped:
                kill_tree(proc)
                raise
        return {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "log": str(log.relative_to(self.out))}

    def log_text(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self, signum, _frame) -> None:
        raise Stopped(signal.Signals(signum).name)


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None
