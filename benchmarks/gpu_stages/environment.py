"""Stages 1 and 2: what the machine has (Python, torch, CUDA, NCCL, the GPUs, the packages;
in a subprocess so the driver never holds a CUDA context) and ``pytest -m gpu`` on it."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET

from .check import Check, last_json
from .limits import OPTIONAL, PY, REQUIRED

VERSIONS = r"""
import importlib, importlib.metadata, importlib.util, json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable, "packages": {}}
for name in sys.argv[1].split(","):
    found = importlib.util.find_spec(name) is not None
    if found and name == "datasets":  # what the trainer would get (--cpu-smoke makes it unimportable)
        try:
            importlib.import_module(name)
        except ImportError:
            found = False
    try:
        out["packages"][name] = importlib.metadata.version({"yaml": "PyYAML"}.get(name, name)) if found else None
    except importlib.metadata.PackageNotFoundError:
        out["packages"][name] = "?"
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(), gpus=[])
    if torch.cuda.is_available():
        out.update(cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                "sm": f"{p.major}{p.minor}", "sms": p.multi_processor_count})
except Exception as exc:
    out["error"] = f"torch: {exc!r}"
print(json.dumps(out))
"""


def stage_versions(check: Check, deadline: float) -> dict:
    script = check.ws.tmp / "versions.py"
    script.write_text(VERSIONS)
    r = check.run([PY, str(script), ",".join(REQUIRED + OPTIONAL)], "versions", deadline, env=check.ws.env, fork=True)
    info = last_json(check.log_text("versions")) or {}
    smi = "nvidia-smi not found"
    if shutil.which("nvidia-smi"):
        s = check.run(["nvidia-smi", "-L"], "nvidia-smi", deadline, cap=15)
        smi = check.log_text("nvidia-smi").splitlines()[1:] if s["rc"] == 0 else f"nvidia-smi -L: rc {s['rc']}"
    gpus = info.get("gpus") or []
    check.facts["gpus"] = len(gpus)
    missing = [name for name in REQUIRED if not (info.get("packages") or {}).get(name)]
    problems = [f"rc {r['rc']}"] if r["rc"] else []
    problems += [info["error"]] if info.get("error") else []
    problems += [f"missing {', '.join(missing)} (benchmarks/gpu_wheels.sh, then carry .whl/)"] if missing else []
    if not check.smoke and not gpus:
        problems.append("torch sees no CUDA device")
    what = (
        f"python {info.get('python')}, torch {info.get('torch')}, CUDA {info.get('cuda')}, "
        f"NCCL {info.get('nccl')}, {len(gpus)} x {gpus[0]['name'] if gpus else 'no GPU'}"
    )
    if not (info.get("packages") or {}).get("datasets"):
        what += "; no datasets (the check writes the token cache)"
    return {
        "status": "failed" if problems else "passed",
        "rc": r["rc"],
        "note": "; ".join(problems) or what,
        "nvidia_smi": smi,
        **info,
    }


def stage_gpu_tests(check: Check, deadline: float) -> dict:
    if check.smoke:
        return {"status": "skipped", "note": "cpu-smoke: every test in tests/test_gpu.py needs CUDA"}
    xml = check.logs / "gpu_tests.xml"
    r = check.run(
        [PY, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider", f"--junitxml={xml}"],
        "gpu_tests",
        deadline,
        env=check.ws.env,
    )
    counts = {}
    if xml.is_file():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    ran = counts.get("tests", 0) - counts.get("skipped", 0)
    ok = r["rc"] == 0 and ran > 0
    status = "passed" if ok else ("timeout" if r["rc"] == 124 else "failed")
    note = f"{ran} passed, {counts.get('skipped', 0)} skipped" if ok else f"rc {r['rc']}: {counts} (see {r['log']})"
    return {"status": status, "note": note, **r, **counts}
