"""`submit.py CONFIG --rehearse [--rank R] [--steps N] [--json]`: which ranks, their defects, the report.

By default one rank of every role is rehearsed: the first, a middle and the last pipeline stage,
and on each the first and the last tp, cp and ep position (the last tp rank holds the padded
end of the vocabulary, the last cp rank the other end of the zig-zag split; dp ranks only read
other data). Each runs in a process of its own (``python -m nanotrain.rehearse.rank``: the fake
world and the stubs are per process), two at a time.

A defect is what would break or slow the job on GPUs, named with its call site: a host tensor
given to a device op or a collective (or any collective contract NCCL enforces), a host sync on a
silent step (one that neither logs nor saves), an optimizer state loaded off its parameter's
device. The only host syncs a silent step may hold are the expert dispatch's split sizes
(``EXPECTED_SYNCS``: data-dependent shapes that the all-to-all must know on the host). The
report exits 0 when no rank has a defect, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nanotrain.config import Config, ConfigError, config_to_dict
from nanotrain.parallel.grid import RankGrid

# Call sites whose host syncs MoE needs on every step: how many tokens go to which expert rank.
EXPECTED_SYNCS = {
    "nanotrain/parallel/expert_parallel.py": "the expert all-to-all's split sizes (data-dependent)",
    "nanotrain/models/moe.py": "the tokens per expert (the all-to-all's split sizes, data-dependent)",
}
RANK_TIMEOUT_S = 900
GIB = 2**30


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 4 else f"{n / 2**20:.2f} MiB"


def default_ranks(config: Config) -> list[int]:
    """One global rank per role (see the module doc), in rank order."""
    p, grid = config.parallelism, RankGrid.of(config.parallelism)
    stages = sorted({0, p.pp // 2, p.pp - 1})
    ranks = set()
    for pp in stages:
        ranks.add(grid.rank(pp=pp))
        ranks.add(grid.rank(pp=pp, tp=p.tp - 1, cp=p.cp - 1, ep=p.ep - 1))
    return sorted(ranks)


def check_ranks(config: Config, ranks: list[int] | None, steps: int) -> list[int]:
    world = config.parallelism.world_size
    for r in ranks or []:
        if not 0 <= r < world:
            raise ConfigError(
                f"--rank {r}: the world of this config has ranks 0..{world - 1} "
                f"(dp*tp*pp*cp*ep = {world}); pick one of them"
            )
    if steps < 2:
        raise ConfigError(
            f"--steps {steps}: at least 2 (step 1 .. N-1 are the silent steps checked; step N logs and saves)"
        )
    return sorted(set(ranks)) if ranks else default_ranks(config)


def run_ranks(config: Config, ranks: list[int], steps: int) -> list[dict]:
    """Each rank's report from its own process (an ``error`` entry when it failed)."""
    with tempfile.TemporaryDirectory(prefix="nanotrain-rehearse-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config_to_dict(config)))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

        def one(rank: int) -> dict:
            cmd = [sys.executable, "-m", "nanotrain.rehearse.rank", str(path), str(rank), str(steps)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=RANK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return {"rank": rank, "error": f"did not finish in {RANK_TIMEOUT_S} s"}
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                tail = "\n".join(done.stderr.strip().splitlines()[-12:])
                return {"rank": rank, "error": f"exit {done.returncode}\n{tail}"}
            return json.loads(lines[-1])

        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(one, ranks))


def defects(report: dict) -> list[str]:
    """What this rank's rehearsal found wrong, one line each."""
    if "error" in report:
        return [f"the rehearsal failed: {report['error']}"]
    out = [f"placement: {site}: {what}" for site, what in report["placement"].items()]
    failed = report.get("failed")
    if failed:
        out.append(f"the rank stopped in {failed['window']} at {failed['site']}: {failed['error']}")
    out += [f"collective: {site}: {what}" for site, what in report["collective_defects"].items()]
    for window in report["silent"]:
        for kind, site, n in report["syncs"].get(window, []):
            if not _expected(site):
                out.append(f"host sync on silent {window}: {site}: {kind} (x{n})")
    out += [f"optimizer state after load: {what}" for what in report.get("optimizer_state_off_device", [])]
    if not (failed or report.get("train_only")) and report.get("resumed_at") != len(report["silent"]) + 1:
        out.append(
            f"resume: the fresh trainer started at step {report.get('resumed_at')}, "
            f"not at the saved step {len(report['silent']) + 1}"
        )
    return out


def _expected(site: str) -> str | None:
    return next((why for path, why in EXPECTED_SYNCS.items() if site.startswith(path)), None)


def step_bytes(report: dict, window: str | None = None) -> dict[tuple, tuple[float, int]]:
    """{(group, collective, dtype): (bytes, calls)} of one silent step (the last one by default)."""
    window = window or report["silent"][-1]
    return {(g, c, d): (b, n) for g, c, d, b, n in report["bytes"].get(window, [])}


def render(report: dict) -> list[str]:
    if "error" in report:
        return [f"rank {report['rank']}: FAILED", *("  " + line for line in report["error"].splitlines())]
    coords = ", ".join(f"{k} {v}" for k, v in report.get("coords", {}).items())
    peak = report.get("peak", {"total": 0})
    parts = " + ".join(
        f"{k} {size(peak[k])}" for k in ("weights", "grads", "optimizer", "activations", "comm", "other") if peak.get(k)
    )
    lines = [
        f"rank {report['rank']} ({coords}): {report['seconds']:.1f} s",
        f"  peak device memory {size(peak['total'])} = {parts}",
    ]
    window = report["silent"][-1]
    lines.append(f"  bytes sent per step ({window}, ring algorithms):")
    for (group, coll, dtype), (b, n) in sorted(step_bytes(report).items()):
        lines.append(f"    {group:<18} {coll:<17} {dtype:<9} {size(b):>12}  ({n} calls)")
    synced = [(kind, site, n) for w in report["silent"] for kind, site, n in report["syncs"].get(w, [])]
    expected = sorted({f"{site}: {_expected(site)}" for _, site, _ in synced if _expected(site)})
    lines += [f"  host syncs on silent steps kept by design: {e}" for e in expected]
    if report.get("evaluated") is False:
        lines.append("  evaluation: none configured (no data.validation): not rehearsed")
    found = defects(report)
    lines += [f"  DEFECT {d}" for d in found] or ["  no defect"]
    return lines


def rehearse(config: Config, ranks: list[int] | None, steps: int, as_json: bool) -> int:
    ranks = check_ranks(config, ranks, steps)
    reports = run_ranks(config, ranks, steps)
    found = {r["rank"]: defects(r) for r in reports}
    if as_json:
        print(
            json.dumps(
                {"ok": not any(found.values()), "ranks": reports, "defects": {str(k): v for k, v in found.items()}}
            )
        )
        return 0 if not any(found.values()) else 1
    print(
        f"rehearsal of world {config.parallelism.world_size}: ranks {ranks}, {steps} steps, an evaluation, "
        "a save, a load into a fresh trainer and one more step each, on the meta device and the fake backend"
    )
    for report in reports:
        for line in render(report):
            print(line)
    stubs = next((r["stubs"] for r in reports if "stubs" in r), [])
    print("stubbed (nothing else is):")
    for stub in stubs:
        print(f"  - {stub}")
    total = sum(len(v) for v in found.values())
    print(f"rehearsal: {'no defect' if not total else f'{total} defect(s)'} on {len(reports)} rank(s)")
    return 0 if not total else 1
