#!/usr/bin/env bash
# The first check on a lent NVIDIA machine (one H100/H200; 2+ GPUs add stage 4), in under 5 minutes
# so that a rerun fits a 15-minute lease. One budget counted from this script's start
# (GPU_CHECK_BUDGET, whole seconds, default 290); each stage gets min(its cap, what is left), every subprocess
# has a timeout (its whole process tree is killed: rc 124), and the summary $OUT/gpu_check.json
# (benchmarks/results/gpu_check.json without $OUT) is rewritten after every stage, so a stage or a
# whole check cut short still leaves the stages done. Exit 0 only when every stage that ran passed.
#   1. versions       (cap  30 s) Python, torch, CUDA, cuDNN, NCCL, the GPUs, `nvidia-smi -L`,
#                     the packages the trainer imports;
#   2. gpu-tests      (cap  75 s) pytest -m gpu tests/test_gpu.py;
#   3. trainer        (cap 150 s, 60 s a run) `python -m nanotrain.runtime.task` at world size 1 on a
#                     ~0.18 B Llama (bf16, ZeRO-1, seq 2048, the stdlib corpus): an uninterrupted run
#                     of 3S steps; S steps with a sync save, resumed (fused AdamW state loaded) to 2S
#                     with async saves, resumed again from the async save to 3S: the resumed losses
#                     against the uninterrupted run's; training.compile: true forward + backward vs
#                     eager; peak memory (allocated, reserved, device-wide) vs the --dry-run estimate;
#   4. multi-gpu      (cap 120 s) tp2 x pp2 1f1b with >= 4 GPUs, pp2 1f1b with 2-3, through
#                     `submit.py --local`, with a checkpoint and `--resume` (same loss check);
#                     skipped on one GPU (NCCL refuses two ranks on one device);
#   5. flight-recorder (cap 30 s) NCCL's flight recorder as a hang report sees it: nanotrain's
#                     settings (the installed torch's variable names) point into the run's hang/
#                     directory, all-reduces are recorded (nccl:all_reduce), the watchdog's report
#                     names the last collective and embeds the record, torch's own dump file lies
#                     beside it (hang/nccl_trace_rank_0); NCCL's own dump through its debug pipe;
#   6. rehearsal      (cap  30 s) `submit.py CONFIG --rehearse --rank 0 --json` on stage 3's
#                     config: its peak beside the real max_memory_allocated ("unavailable" when
#                     submit.py has no --rehearse yet);
#   7. masked-attention (cap 90 s) compiled FlexAttention (model.attention_kernel: flex) forward +
#                     backward against the CPU reference (the materialised document mask, float64),
#                     whole window and a cp2 rank; tokens/s and peak memory of causal, sdpa_mask and
#                     flex at S = 8192 (bf16); skipped with < 45 s left (GPU_CHECK_BUDGET=380);
#   8. bench          (cap 150 s, GPU_CHECK_BENCH=1 only) gpu_train_bench.py, the ~1.1 B model's
#                     tokens/s and MFU (GPU_CHECK_COMPILE=1: the compiled one too, in what is left).
# The stages are benchmarks/gpu_trainer_check.py; this script finds the Python and its packages.
#
#   benchmarks/gpu_check.sh               # on the GPU machine
#   benchmarks/gpu_check.sh --cpu-smoke   # the same stages on CPU, tiny model, gloo (CI)
#
# Python: $PYTHON, .venv/bin/python, python3, python, the first whose torch sees CUDA. Nothing is
# fetched (the GPU machine has no network): nanotrain runs from this checkout (PYTHONPATH), and
# when submitit or datasets does not import and .whl/ (GPU_CHECK_WHEELS) holds wheels, they are
# installed into /tmp/site (GPU_CHECK_SITE) first; benchmarks/gpu_wheels.sh downloads them.
set -uo pipefail
START=$(date +%s)
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
SMOKE=0
case "${1:-}" in
    --cpu-smoke) SMOKE=1 ;;
    "") ;;
    *) echo "usage: $0 [--cpu-smoke]" >&2; exit 2 ;;
esac
RESULTS=${OUT:-$ROOT/benchmarks/results}
mkdir -p "$RESULTS/gpu_check" || exit 2
exec > >(tee "$RESULTS/gpu_check/gpu_check.log") 2>&1
SITE=${GPU_CHECK_SITE:-/tmp/site}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

usable() {  # a Python whose torch sees CUDA (--cpu-smoke: that has torch; stage 1 imports it)
    if [ "$SMOKE" = 1 ]; then
        timeout 60 "$1" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' >/dev/null 2>&1
    else
        timeout 60 "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1
    fi
}
PY=""
for cand in ${PYTHON:-} "$ROOT/.venv/bin/python" python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && usable "$cand"; then PY=$(command -v "$cand"); break; fi
done
if [ -z "$PY" ]; then
    echo "gpu_check: no Python with a CUDA-enabled torch (tried ${PYTHON:-} .venv/bin/python python3 python):"
    for cand in "$ROOT/.venv/bin/python" python3; do
        command -v "$cand" >/dev/null 2>&1 && timeout 60 "$cand" -c 'import torch; print(" ", torch.__version__, "cuda",
            torch.version.cuda, "available", torch.cuda.is_available())' 2>&1
    done
    timeout 15 nvidia-smi -L 2>&1 || true
    exit 2
fi
echo "== python: $PY"

has_all() {  # every module named importable by $PY (found on its path: nothing is imported)
    timeout 60 "$PY" -c 'import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, sys.argv[1:])))' "$@" \
        >/dev/null 2>&1
}
if ! has_all submitit datasets && compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "== installing the wheels of $WHEELS into $SITE (no index, no dependencies)"
    if timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl; then
        export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
    else
        echo "gpu_check: installing the wheels failed; stage 1 lists what is missing"
    fi
fi

SMOKE_ARG=()
[ "$SMOKE" = 1 ] && SMOKE_ARG=(--cpu-smoke)
# The stages keep to the budget themselves; this limit only catches the driver itself hanging
# (SIGTERM: it kills its running stage's processes and writes the summary; exit 124).
BUDGET=${GPU_CHECK_BUDGET:-290}
timeout -k 20 $((BUDGET + 30)) "$PY" benchmarks/gpu_trainer_check.py --out "$RESULTS" --start "$START" \
    --budget "$BUDGET" ${SMOKE_ARG[@]+"${SMOKE_ARG[@]}"}
status=$?
echo "gpu_check: summary $RESULTS/gpu_check.json, logs $RESULTS/gpu_check/ (exit $status)"
exit $status
