#!/usr/bin/env bash
# One-GPU check for an NVIDIA machine (H100/H200), in under 8 minutes:
#   1. pick a Python whose torch sees CUDA (.venv, then python3/python, or $PYTHON), report versions;
#   2. the GPU-marked tests (tests/test_gpu.py: NCCL at world size 1, CUDA placement, bf16 path,
#      a train step on GPU vs CPU);
#   3. a single-GPU training benchmark of a ~1B Llama (bf16, sequence 2048): tokens/s and MFU;
#   4. the real trainer (benchmarks/gpu_trainer_check.py): the task entry point at world size 1,
#      its own tokens/s, MFU and peak memory beside the --dry-run estimate; tp2 and pp2 through
#      `submit.py --local` when 2+ GPUs are visible.
#
#   benchmarks/gpu_check.sh                 # results in benchmarks/results/gpu/ (or $OUT when set)
#   GPU_CHECK_COMPILE=1 benchmarks/gpu_check.sh   # also the benchmark with torch.compile'd layers
#
# No torch is installed by default: the GPU machine's own CUDA torch is used. Set
# GPU_CHECK_PIP=1 to `pip install torch` into .venv-gpu when none is importable (needs a network).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RESULTS=${OUT:-$ROOT/benchmarks/results/gpu}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
status=0

has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

PY=""
for cand in ${PYTHON:-} "$ROOT/.venv/bin/python" python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && has_cuda_torch "$cand"; then PY=$(command -v "$cand"); break; fi
done
if [ -z "$PY" ] && [ "${GPU_CHECK_PIP:-0}" = 1 ]; then
    echo "== no CUDA torch importable: pip install torch into .venv-gpu"
    python3 -m venv "$ROOT/.venv-gpu" && "$ROOT/.venv-gpu/bin/python" -m pip install -q torch pyyaml pytest \
        && has_cuda_torch "$ROOT/.venv-gpu/bin/python" && PY="$ROOT/.venv-gpu/bin/python"
fi
if [ -z "$PY" ]; then
    echo "gpu_check: no Python with a CUDA-enabled torch found (tried ${PYTHON:-} .venv/bin/python python3 python)."
    for cand in "$ROOT/.venv/bin/python" python3; do
        command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import torch; print(" ", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1
    done
    nvidia-smi -L 2>&1 || true
    exit 2
fi

echo "== versions"
"$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version(), "| NCCL", ".".join(map(str, torch.cuda.nccl.version())))
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
for mod in ("yaml", "pytest", "safetensors"):
    try:
        __import__(mod)
    except ImportError:
        print("missing python package:", mod)
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || true

echo "== GPU-marked tests (tests/test_gpu.py)"
timeout 120 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --junitxml="$RESULTS/gpu_tests.xml" \
    || { echo "gpu_check: GPU tests FAILED (rc $?)"; status=1; }

echo "== single-GPU training benchmark: ~1B Llama, bf16, sequence 2048"
timeout 150 "$PY" benchmarks/gpu_train_bench.py --steps 8 --warmup 2 --out "$RESULTS/gpu_bench.json" \
    || { echo "gpu_check: benchmark FAILED (rc $?)"; status=1; }
echo "== the real trainer: python -m nanotrain.launch.task (bf16, async TP, 20 steps; recompute none and full: peak CUDA memory vs the estimate); tp2 and pp2 via the CLI with >= 2 GPUs"
timeout 260 "$PY" benchmarks/gpu_trainer_check.py --steps 20 --timeout 90 --out "$RESULTS" \
    || { echo "gpu_check: trainer check FAILED (rc $?)"; status=1; }
if [ "${GPU_CHECK_COMPILE:-0}" = 1 ]; then
    left=$(( 460 - ($(date +%s) - START) ))
    if [ "$left" -gt 60 ]; then
        echo "== the same with torch.compile'd decoder layers (${left} s left)"
        timeout "$left" "$PY" benchmarks/gpu_train_bench.py --compile --steps 8 --warmup 3 \
            --out "$RESULTS/gpu_bench_compile.json" || echo "gpu_check: compiled benchmark did not finish (rc $?)"
    fi
fi

echo "== summary ($(( $(date +%s) - START )) s)"
"$PY" - "$RESULTS" <<'EOF'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("gpu_bench*.json")):
    r = json.loads(path.read_text())
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
    print(f"{path.name}: {r['device']}, {r['params'] / 1e9:.2f} B params, micro-batch {r['micro_batch']} x {r['seq']}"
          f"{' (compiled)' if r['compile'] else ''}: {r['tokens_per_s']:,} tokens/s, "
          f"{r['model_tflops_per_s']} TFLOP/s, MFU {mfu} (target >= 50%), peak {r['peak_memory_gib']} GiB")
EOF
exit $status
