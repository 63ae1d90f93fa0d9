"""The corpus and the generated categories, run in one Workspace: what fuzz_config.fuzz() runs
before (and beside) its config mutations."""

from __future__ import annotations

import os
import random
import sys
import time
from collections import Counter

from fuzzing.cases import path_cases, script_cases
from fuzzing.categories import unicode_cases, yaml11_cases
from fuzzing.corpus import corpus_cases
from fuzzing.runner import run_case
from fuzzing.workspace import Workspace

CATEGORIES = {"scripts": script_cases, "paths": path_cases, "yaml11": yaml11_cases, "unicode": unicode_cases}
CASE_HANG_S = 8.0  # wall-clock guard of one case: the answer is due in 2 CPU s; a FIFO waits without CPU


def _argv_encodable(arg: str) -> bool:
    """Whether a process can get `arg` (a high surrogate or a NUL cannot be an argv byte string)."""
    try:
        return b"\0" not in os.fsencode(arg)
    except UnicodeEncodeError:
        return False


def select(categories, limit: int = 0, seed: int = 0, corpus: bool = True) -> list:
    """The corpus (in full, first) and each category's cases (a seeded sample of `limit` each; 0 = all)."""
    rng = random.Random(seed)
    todo = corpus_cases() if corpus else []
    for name in categories:
        cases = CATEGORIES[name]()
        todo += rng.sample(cases, limit) if 0 < limit < len(cases) else cases
    return todo


def run_suite(
    categories=tuple(CATEGORIES),
    limit: int = 0,
    subprocess_sample: int = 0,
    seed: int = 0,
    corpus: bool = True,
    progress: int = 0,
    verbose: bool = False,
    stream=sys.stdout,
) -> dict:
    """Run `select(...)`; `subprocess_sample` generated cases (never fuzz_config's, which would
    start a whole fuzz run) also run as real processes. Returns counts per "category verdict",
    the failures (one entry each, with the answer), the slowest answers and the time taken."""
    t0 = time.perf_counter()
    todo = select(categories, limit, seed, corpus)
    rng = random.Random(seed + 1)
    eligible = [
        i
        for i, c in enumerate(todo)
        if c.category != "corpus" and c.target != "fuzz_config" and all(_argv_encodable(a) for a in c.argv)
    ]
    sampled = set(rng.sample(eligible, min(subprocess_sample, len(eligible))))
    counts: Counter = Counter()
    failures: list[str] = []
    worst = {"in-process": (0.0, ""), "subprocess": (0.0, "")}
    if not todo:
        return {"cases": 0, "subprocess_runs": 0, "counts": {}, "failures": [], "worst_cpu_s": worst, "seconds": 0.0}
    ws = Workspace(with_checkpoint=True)
    try:
        for i, case in enumerate(todo):
            runs = [("in-process", False)] + ([("subprocess", True)] if i in sampled else [])
            for how, as_process in runs:
                how = "subprocess" if case.process else how
                v, detail, o = run_case(case, ws, CASE_HANG_S, as_process)
                counts[f"{case.category} {v}"] += 1
                if o.cpu_s > worst[how][0]:
                    worst[how] = (o.cpu_s, f"[{case.category}] {case.label}")
                if not v.startswith("ok"):
                    failures.append(
                        f"{v} ({case.category}, {how}, {o.cpu_s:.2f} s CPU, {o.wall_s:.1f} s): "
                        f"{case.target} {ascii(case.label)[1:-1]}\n    "
                        + ascii(detail)[1:-1].replace("\\n", "\n    ")[:800]
                    )
                elif verbose:
                    print(f"{v}: [{case.category}] {ascii(case.label)}: {ascii(detail[:160])}", file=stream)
            if progress and (i + 1) % progress == 0:
                print(f"... {i + 1}/{len(todo)} cases, {len(failures)} broke the contract", file=sys.stderr, flush=True)
    finally:
        ws.close()
    return {
        "cases": len(todo),
        "subprocess_runs": len(sampled),
        "counts": dict(counts),
        "failures": failures,
        "worst_cpu_s": worst,
        "seconds": time.perf_counter() - t0,
    }
