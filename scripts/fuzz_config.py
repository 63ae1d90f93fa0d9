#!/usr/bin/env python3
"""Fuzz `submit.py` and the scripts with hostile input: configs, paths, YAML 1.1 scalars, Unicode.

    python scripts/fuzz_config.py                    # everything, in-process, + a subprocess sample
    python scripts/fuzz_config.py --limit 60 --subprocess 3 --seed 1
    python scripts/fuzz_config.py --category paths --category scripts --limit 20

First, always, the fixed corpus (scripts/fuzzing/corpus.yaml): every known example of a wrong
input, each with the answer it must get (refused with a line naming what; or accepted meaning
what the user meant: `slurm.time=1:30:00` is 90 minutes, `dp=010` never 8). Then the categories:
"scripts" (each script's `main(argv)` with arguments missing, extra, unknown, bad values, hostile
paths, SRC = DST), "paths" (every path field and path argument given a FIFO, a symlink loop, a
256-byte component, /proc and /sys paths, a broken link, a folder for a file, an unreadable file),
"yaml11" (scalars YAML 1.1 reads otherwise than a user means, in every field), "unicode" (one
character of each category that can hide in a line, in values, keys and --set paths) and "config":

Each mutation replaces one field of `configs/*.yaml` (every field of the schema, present in the
file or not, and the entries of list/mapping fields) by a wrong type, null, a non-finite, huge,
negative, zero or empty value, unicode, shell metacharacters, an alias (a bomb, a recursive one,
an undefined one, a fair one), or duplicates the field or its section; each is tried both in the
file and as `--set section.field=VALUE`. The contract checked for every one:

    exit 0, or exit 2 with exactly one stderr line starting `error:`; never a traceback (any
    exception escaping `main`), never a file written, and an answer in under 2 s.

Why in-process for the bulk: a fresh interpreter costs ~0.3 s, so 10,000 subprocesses would take
an hour on a busy box; `main()` is the same code `submit.py` runs. A seeded sample still runs as
real `python submit.py ... --dry-run` processes, to prove the process-level contract (exit
status, no traceback on stderr). "Under 2 s" is judged in CPU seconds, as tests/test_memory_estimate.py
judges the planner: wall time on a loaded machine measures the machine. Answers that took 2 s of
wall time without the CPU are listed apart (I/O, such as a data path that is a huge tree, shows
there). Exit status of this script: 0 when no mutation broke the contract, else 1 (2, with one
`error:` line, for a wrong argument of its own).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from fuzzing.config_mutations import _BOMB, VALUES, Mutation, mutations, render  # noqa: E402,F401
from fuzzing.harness import HANG_S, LIMIT_S, Outcome, run_main, run_process, verdict  # noqa: E402,F401
from fuzzing.suite import CATEGORIES, run_suite  # noqa: E402

from nanotrain.commands.cli import main as cli_main  # noqa: E402
from nanotrain.config.cli_args import ArgParser, answer, non_negative_int  # noqa: E402
from nanotrain.config.loader import sections  # noqa: E402,F401


def run_in_process(argv: list[str], cwd: Path) -> Outcome:
    """`submit.py ARGV` as `main(argv)` in this process (nothing may appear in `cwd`)."""
    return run_main(cli_main, argv, [cwd], HANG_S)


def run_subprocess(argv: list[str], cwd: Path) -> Outcome:
    """`python submit.py ARGV` as a real process in `cwd`."""
    return run_process(
        [sys.executable, str(ROOT / "submit.py"), *argv], cwd, [cwd], HANG_S, dict(os.environ, PYTHONPATH=str(ROOT))
    )


ALL_CATEGORIES = ("config", *CATEGORIES)


def fuzz(
    limit: int = 0,
    subprocess_sample: int = 20,
    seed: int = 0,
    verbose: bool = False,
    stream=sys.stdout,
    progress: int = 0,
    categories=ALL_CATEGORIES,
    corpus: bool = True,
) -> dict:
    """The fixed corpus first (fuzzing/corpus.yaml, in full; `corpus=False` only for tests of the
    rest), then each of `categories`: "config" (the config mutations) and those of
    fuzzing.suite.CATEGORIES. `limit`: a seeded sample of that many of each category (0 = all);
    `subprocess_sample`: that many of each also run as real processes. Returns the counts and
    the failures (the suite's under "suite", and all of them in "failures")."""
    suite = run_suite(
        [c for c in categories if c != "config"], limit, subprocess_sample, seed, corpus, progress, verbose, stream
    )
    report = (
        _mutate(limit, subprocess_sample, seed, verbose, stream, progress)
        if "config" in categories
        else {
            "mutations": 0,
            "subprocess_runs": 0,
            "counts": {},
            "failures": [],
            "by_kind": {},
            "wall_slow": [],
            "worst_cpu_s": {"in-process": 0.0, "subprocess": 0.0, "subprocess-wall": 0.0},
            "slowest": {"in-process": "", "subprocess": ""},
        }
    )
    report["suite"] = suite
    report["failures"] = suite["failures"] + report["failures"]
    return report


def _mutate(limit: int, subprocess_sample: int, seed: int, verbose: bool, stream, progress: int) -> dict:
    """Run the config mutations (all, or a seeded sample of `limit`); returns the counts."""
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    raws = {p.stem: yaml.safe_load(p.read_text()) for p in configs}
    todo = mutations(configs)
    rng = random.Random(seed)
    if limit and limit < len(todo):
        todo = rng.sample(todo, limit)
    sampled = set(rng.sample(range(len(todo)), min(subprocess_sample, len(todo))))
    counts: Counter = Counter()
    kinds: Counter = Counter()
    failures: list[str] = []
    worst = {"in-process": 0.0, "subprocess": 0.0, "subprocess-wall": 0.0}
    slowest = {"in-process": "", "subprocess": ""}
    wall_slow: list[str] = []  # >= 2 s of wall time but not of CPU: the machine's load, or I/O
    with tempfile.TemporaryDirectory(prefix="fuzz_config_") as tmp:
        work = Path(tmp) / "cwd"
        work.mkdir()
        for i, m in enumerate(todo):
            path = Path(tmp) / f"{m.config}.yaml"
            argv = [str(path), "--dry-run"]
            if m.via == "set":
                path.write_text(render(raws[m.config], Mutation(m.config, "", "", "none", "", "file")))
                argv += ["--set", f"{m.section}.{m.field}={m.text}"]
            else:
                path.write_text(render(raws[m.config], m))
            runs = [("in-process", run_in_process(argv, work))]
            if i in sampled:
                runs.append(("subprocess", run_subprocess(argv, work)))
            for how, o in runs:
                v = verdict(o)
                counts[f"{how} {v}"] += 1
                kinds[(m.kind, v)] += 1
                if o.wall_s >= LIMIT_S and v.startswith("ok"):
                    wall_slow.append(f"{how}: {o.wall_s:.1f} s wall, {o.cpu_s:.2f} s CPU: {m.label()}")
                if o.cpu_s > worst[how]:
                    worst[how], slowest[how] = o.cpu_s, m.label()
                if how == "subprocess":
                    worst["subprocess-wall"] = max(worst["subprocess-wall"], o.wall_s)
                if not v.startswith("ok"):
                    failures.append(
                        f"{v} ({how}, {o.cpu_s:.2f} s CPU): {m.label()}\n    "
                        + (o.crash or o.stderr or str(o.wrote)).strip().replace("\n", "\n    ")[:800]
                    )
                elif verbose:
                    print(f"{v}: {m.label()}: {o.stderr.strip()[:160]}", file=stream)
            if progress and (i + 1) % progress == 0:
                print(
                    f"... {i + 1}/{len(todo)} mutations, {len(failures)} broke the contract",
                    file=sys.stderr,
                    flush=True,
                )
            for leftover in work.iterdir():  # never expected; counted above, removed for the next
                subprocess.run(["rm", "-rf", str(leftover)], check=False)
    report = {
        "mutations": len(todo),
        "subprocess_runs": len(sampled),
        "counts": dict(counts),
        "failures": failures,
        "worst_cpu_s": worst,
        "slowest": slowest,
        "wall_slow": wall_slow,
        "by_kind": {f"{k} {v}": n for (k, v), n in sorted(kinds.items())},
    }
    return report


def print_report(report: dict, stream=sys.stdout) -> None:
    suite = report.get("suite")
    if suite and suite["cases"]:
        print(
            f"corpus and categories: {suite['cases']} cases in {suite['seconds']:.1f} s (each in-process; "
            f"{suite['subprocess_runs']} also as a process)",
            file=stream,
        )
        for key, n in sorted(suite["counts"].items()):
            print(f"  {key}: {n}", file=stream)
        for how, (cpu, label) in suite["worst_cpu_s"].items():
            print(f"  slowest {how}: {cpu:.3f} s CPU: {ascii(label)[1:-1]}", file=stream)
    print(
        f"mutations: {report['mutations']} (each in-process; {report['subprocess_runs']} also as a "
        "`python submit.py --dry-run` process)",
        file=stream,
    )
    for key, n in sorted(report["counts"].items()):
        print(f"  {key}: {n}", file=stream)
    print("by kind:", file=stream)
    for key, n in report["by_kind"].items():
        print(f"  {key}: {n}", file=stream)
    w = report["worst_cpu_s"]
    print(
        f"slowest answer: {w['in-process']:.3f} s CPU in-process, {w['subprocess']:.3f} s CPU "
        f"({w['subprocess-wall']:.3f} s wall) as a process; limit {LIMIT_S} s",
        file=stream,
    )
    for how, label in report["slowest"].items():
        if label:
            print(f"  slowest {how}: {label}", file=stream)
    print(
        f"answers over {LIMIT_S} s of wall time but not of CPU (load or I/O; look at repeated "
        f"labels): {len(report['wall_slow'])}",
        file=stream,
    )
    for line in report["wall_slow"][:15]:
        print("  " + line, file=stream)
    bad = report["failures"]
    tracebacks = sum(n for k, n in report["counts"].items() if k.endswith(("traceback", "hang")))
    slow = sum(n for k, n in report["counts"].items() if k.endswith("slow"))
    print(f"tracebacks: {tracebacks}, slow: {slow}, contract broken: {len(bad)}", file=stream)
    for line in bad[:30]:
        print("  " + line, file=stream)


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when no case broke the contract, 1 when one did, 2 (one `error:` line) for a
    wrong argument of this script."""
    return answer(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = ArgParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--limit",
        type=non_negative_int,
        default=0,
        help="a seeded sample of this many cases of each category (0 = all); the corpus runs in full",
    )
    parser.add_argument("--subprocess", type=non_negative_int, default=20, help="how many also run as real processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="print every answer")
    parser.add_argument(
        "--category",
        action="append",
        choices=ALL_CATEGORIES,
        help="run only this category (repeatable; default all); the corpus always runs first",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the whole report (every failure) to PATH")
    args = parser.parse_args(argv)
    report = fuzz(
        args.limit,
        args.subprocess,
        args.seed,
        args.verbose,
        progress=1000,
        categories=tuple(args.category or ALL_CATEGORIES),
    )
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0 if not report["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
