#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the pure-Python wheels the lent GPU machine lacks into
# .whl/ of the repository root; benchmarks/gpu_check.sh installs them there (no index, no
# dependencies, into /tmp/site) before its stages. Carry the folder with the working tree (it is
# ignored by git: this script adds it to .git/info/exclude), e.g. `carry: [".whl"]`.
#
#   benchmarks/gpu_wheels.sh [DIR]       # default DIR: .whl
#   GPU_WHEELS="submitit==1.5.4 cloudpickle==3.1.3" benchmarks/gpu_wheels.sh
#
# The GPU machine has Python 3.12 with torch, numpy, PyYAML, safetensors, tensorboard, pytest and
# transformers (so typing-extensions), but not:
# * submitit: `nanotrain.runtime.task` and the CLI import it. cloudpickle, its other dependency,
#   comes along too (20 kB): the check then never depends on whether the image happens to hold it.
# * datasets: not carried. Its wheels with pyarrow, pandas, dill, multiprocess and xxhash are 66 MB,
#   past what a run carries (64 MiB), and the trainer needs it only to tokenise a corpus that has no
#   cache yet: gpu_check.sh writes the stdlib corpus's byte-tokenised cache itself.
# Pure-Python wheels are py3-none-any; the platform flags matter only for a compiled one.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYTHON=${PYTHON:-python3}
read -r -a PACKAGES <<< "${GPU_WHEELS:-submitit==1.5.4 cloudpickle==3.1.3}"
mkdir -p "$DEST"
for pkg in "${PACKAGES[@]}"; do
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "$pkg"
done
if [ "$DEST" = .whl ] && exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"
fi
echo "gpu_wheels: $(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l) wheel(s), $(du -sh "$DEST" | cut -f1), in $DEST:"
ls -1 "$DEST"
