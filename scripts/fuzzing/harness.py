"""Run one answer (a `main(argv)` in this process, or a real process) and judge it by the contract:

    exit 0, or exit 2 with exactly one stderr line starting `error: `; never a traceback, never a
    hang, nothing written, under 2 CPU seconds.

In-process runs are guarded by SIGALRM: a blocking `open()` of a FIFO is a system call that the
signal interrupts, and since the handler raises, Python does not retry it (PEP 475 retries only
when the handler returns), so a hang becomes an answer of its own ("hang") instead of a stuck run.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import signal
import subprocess
import time
import traceback
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

LIMIT_S = 2.0  # the contract: every answer in under 2 s (CPU seconds)
HANG_S = 20  # default wall-clock guard so that one hang cannot stall the run


@dataclass
class Outcome:
    code: int | None
    stderr: str
    cpu_s: float
    wall_s: float
    crash: str = ""
    wrote: list[str] = field(default_factory=list)
    stdout: str = ""


class Hang(Exception):
    """Raised by the SIGALRM handler inside whatever the answer was blocked in."""


def _alarm(_signum, _frame):
    raise Hang()


def tree(paths: list[Path]) -> dict[str, tuple]:
    """(size, mtime) of every entry under `paths`, without following links or opening files (a
    FIFO among them must not block the snapshot)."""
    out = {}
    for top in paths:
        if not os.path.lexists(top):
            continue
        for dirpath, dirs, files in os.walk(top):
            for name in dirs + files:
                p = os.path.join(dirpath, name)
                st = os.lstat(p)
                out[p] = (st.st_size, st.st_mtime_ns)
        st = os.lstat(top)
        out[str(top)] = (st.st_size if not os.path.isdir(top) else 0, 0)
    return out


def changed(before: dict, after: dict) -> list[str]:
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


def run_main(main, argv: list[str], watched: list[Path], hang_s: float = HANG_S) -> Outcome:
    """`main(argv)` in this process, its stdout/stderr captured, under a `hang_s` SIGALRM guard;
    `watched`: folders in which any change counts as written."""
    out, err = io.StringIO(), io.StringIO()
    before = tree(watched)
    cpu, wall = time.process_time(), time.perf_counter()
    crash, code = "", None
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, hang_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except Hang:
        crash = f"no answer after {hang_s:g} s"
    except SystemExit as e:  # argparse's own exit: the status is what the user sees
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            err.write(f"{e.code}\n")
    except BaseException:  # noqa: BLE001 - anything escaping main is what we are looking for
        crash = traceback.format_exc(limit=-3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    cpu_s, wall_s = time.process_time() - cpu, time.perf_counter() - wall
    return Outcome(code, err.getvalue(), cpu_s, wall_s, crash, changed(before, tree(watched)), out.getvalue())


def run_process(
    cmd: list[str], cwd: Path, watched: list[Path], timeout_s: float = HANG_S, env: dict | None = None
) -> Outcome:
    """`cmd` as a real process (its own session, killed with its children on timeout)."""
    before_usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = tree(watched)
    wall = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        errors="surrogateescape",
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        code, crash = proc.returncode, ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code, crash = None, f"no answer after {timeout_s:g} s"
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime - before_usage.ru_utime - before_usage.ru_stime
    if "Traceback" in stderr:
        crash = stderr[-600:]
    return Outcome(code, stderr, cpu, time.perf_counter() - wall, crash, changed(before, tree(watched)), stdout)


def printable(line: str) -> bool:
    """One line a terminal shows as it is: no control, format (bidi, zero-width), surrogate,
    private-use, unassigned or separator character other than the space."""
    return all(c == " " or c.isprintable() for c in line)


UNSAFE_CATEGORIES = ("Cc", "Cf", "Cs", "Zl", "Zp")


def unsafe_chars(text: str) -> list[str]:
    """Characters that rewrite what a terminal or a batch script shows (controls other than tab
    and newline, bidi and zero-width format characters, lone surrogates, line/paragraph separators)."""
    return sorted({f"U+{ord(c):04X}" for c in text if c not in "\t\n" and unicodedata.category(c) in UNSAFE_CATEGORIES})


def verdict(o: Outcome, strict: bool = False) -> str:
    """'ok-0', 'ok-2', or what broke the contract. `strict`: the error line must also be
    printable (no C1 control, bidi override or line separator passes as "one line")."""
    if o.crash:
        return "traceback" if "no answer" not in o.crash else "hang"
    if o.wrote:
        return "wrote-files"
    if o.cpu_s >= LIMIT_S:
        return "slow"
    if o.code == 0:
        return "ok-0"
    lines = o.stderr.strip().splitlines()
    if o.code == 2 and len(lines) == 1 and lines[0].startswith("error: "):
        if strict and (not printable(lines[0]) or "\n" in o.stderr.strip()):
            return "unprintable-error"
        return "ok-2"
    return "bad-output"
