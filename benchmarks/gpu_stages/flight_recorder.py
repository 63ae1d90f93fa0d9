"""Stage 5, flight-recorder: the hang report's flight recorder on the installed torch, exercised
by a script run in a process of its own (its NCCL or gloo group must not live in the driver)."""

from __future__ import annotations

from .check import Check, last_json
from .limits import CAPS_S, PY

FLIGHT_RECORDER = r"""
import json, os, pickle, sys, time
from pathlib import Path

run, smoke = Path(sys.argv[1]), sys.argv[2] == "1"
from nanotrain.runtime.hang import FR_BUFFER_VARS, FR_FILE_VARS, fr_buffer_var, nccl_debug_env

nccl_debug_env(run)  # as every rank does, before its process groups exist
stem = str(run / "hang" / "pipe_")
PIPE_VARS = ("TORCH_FR_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
if not smoke:  # NCCL's heartbeat monitor dumps when a byte arrives on <stem><rank>.pipe
    for var in PIPE_VARS:
        os.environ.setdefault(var, stem)
import torch
import torch.distributed as dist

from nanotrain.parallel import collectives
from nanotrain.runtime.hang import HangWatchdog

device = torch.device("cpu") if smoke else torch.device("cuda", 0)
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group("gloo" if smoke else "nccl", rank=0, world_size=1)
t = torch.ones(1 << 20, device=device)
for _ in range(3):
    collectives.all_reduce(t, what="all_reduce of the gpu check")
if device.type == "cuda":
    torch.cuda.synchronize(device)
names = FR_BUFFER_VARS + FR_FILE_VARS + ("TORCH_NCCL_DUMP_ON_TIMEOUT",) + PIPE_VARS
out = {"torch": torch.__version__, "backend": dist.get_backend(), "buffer_var": fr_buffer_var(),
       "env": {k: os.environ.get(k) for k in names}}
prefix = os.environ.get(FR_FILE_VARS[0]) or os.environ.get(FR_FILE_VARS[1])
dump = Path(prefix + "0")
if not smoke:  # torch's own dump, written where its variables say (as on an NCCL timeout)
    pipe = Path(stem + "0.pipe")
    seen = {"pipe": None, "file": None, "bytes": 0, "entries": None}
    deadline = time.time() + 5
    while not pipe.exists() and time.time() < deadline:
        time.sleep(0.2)
    if pipe.exists():
        seen["pipe"] = str(pipe)
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"1")
        os.close(fd)
        deadline = time.time() + 8
        while time.time() < deadline and not (dump.exists() and dump.stat().st_size > 0):
            time.sleep(0.2)
        time.sleep(1.0)  # torch writes from a thread of its own: let it finish
        if dump.exists() and dump.stat().st_size > 0:
            seen.update(file=str(dump), bytes=dump.stat().st_size)
            try:
                seen["entries"] = len(pickle.loads(dump.read_bytes())["entries"])
            except Exception as exc:
                seen["entries"] = f"unreadable: {exc!r}"
            dump.rename(dump.with_name(dump.name + ".torch"))
    out["torch_dump"] = seen
path = HangWatchdog(run, 0, 1, 60).report("gpu check: the flight recorder's exercise")
report = json.loads(Path(path).read_text())
fr = report.get("flight_recorder") if isinstance(report.get("flight_recorder"), dict) else {}
entries = fr.get("entries") or []
mine = {"path": str(path), "node": report.get("node"), "host": report.get("host"),
        "collective": report.get("collective"), "entries": len(entries), "entries_total": fr.get("entries_total"),
        "profiling_names": sorted({str(e.get("profiling_name")) for e in entries}), "error": fr.get("error"),
        "file": report.get("flight_recorder_file"), "file_entries": None}
if mine["file"]:
    mine["file_entries"] = len(pickle.loads(Path(mine["file"]).read_bytes())["entries"])
out["report"] = mine
dist.destroy_process_group()
print(json.dumps(out))
"""


def stage_flight_recorder(check: Check, deadline: float) -> dict:
    """The hang report's flight recorder on this machine's torch: nanotrain's variables (the
    installed torch's names) point into the run's hang directory, collectives through
    ``parallel/collectives.py`` are recorded, the watchdog's report embeds them (with rank, node,
    host, group and last collective) and writes torch's own dump file beside it. On a GPU, NCCL's
    own dump is also triggered through its debug pipe and looked for in the hang directory
    (reported; torch's pipe variable differs between versions)."""
    ws = check.ws
    run = ws.tmp / "fr-run"
    script = ws.tmp / "flight_recorder.py"
    script.write_text(FLIGHT_RECORDER)
    r = check.run(
        [PY, str(script), str(run), "1" if check.smoke else "0"],
        "flight_recorder",
        deadline,
        cap=CAPS_S["flight-recorder"],
        env=ws.single_rank_env(),
        fork=True,
    )
    info = last_json(check.log_text("flight_recorder")) or {}
    if r["rc"] == 124:
        return {"status": "timeout", "note": f"no answer in time (see {r['log']})", **r}
    hang = str(run / "hang")
    report = info.get("report") or {}
    expected = f"{'gloo' if check.smoke else 'nccl'}:all_reduce"
    problems = [] if r["rc"] == 0 and info else [f"rc {r['rc']} (see {r['log']})"]
    env = info.get("env") or {}
    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        if info and not (env.get(var) or "").startswith(hang):
            problems.append(f"{var} is {env.get(var)!r}, not in {hang}")
    if info and env.get(info.get("buffer_var", "")) != "2000":
        problems.append(f"{info.get('buffer_var')} is {env.get(info.get('buffer_var', ''))!r}, not 2000")
    if info and expected not in report.get("profiling_names", []):
        problems.append(f"the report's flight recorder has no {expected}: {report.get('profiling_names')}")
    if info and (report.get("collective") or {}).get("name") != "all_reduce of the gpu check":
        problems.append(f"the report's last collective is {report.get('collective')}")
    if info and (not (report.get("file") or "").startswith(hang) or not report.get("file_entries")):
        problems.append(f"no flight-recorder file in {hang}: {report.get('file')}")
    torch_dump = info.get("torch_dump")
    seen = (
        ""
        if torch_dump is None
        else (
            f"; torch's own dump via its debug pipe: {torch_dump['bytes']} bytes, {torch_dump['entries']} entries"
            if torch_dump.get("file")
            else f"; torch's own dump via its debug pipe: not seen (pipe {torch_dump.get('pipe')})"
        )
    )
    note = (
        f"{report.get('entries')} of {report.get('entries_total')} entries in the report ({expected}), "
        f"{report.get('file_entries')} in {report.get('file')}{seen}"
    )
    out = {k: info.get(k) for k in ("torch", "backend", "buffer_var", "env", "report", "torch_dump")}
    if problems:
        return {"status": "failed", "note": "; ".join(problems), **r, **out}
    return {"status": "passed", "note": note, **r, **out}
