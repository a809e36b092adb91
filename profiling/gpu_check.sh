#!/bin/bash
# The GPU path in one command, for a lent GPU machine (device tool: `run`, carry [".whl"]):
#   profiling/gpu_wheels.sh            # here, once: the wheels into .whl/
#   profiling/gpu_check.sh [ARGS]      # there: installs .whl/*.whl, prints one JSON object
# ARGS go to `python -m pivotrl_hpc.cli.bench_gpu` (e.g. --sizes-mb 1024 --train none).
# The JSON and the log land in $OUT (the device tool's folder) or in the current folder.
# The same entry runs on CPU as `pivotrl bench gpu --device cpu` (tests/test_gpu_check.py).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD}
site=/tmp/pivotrl-gpu-site
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl
  export PYTHONPATH="$site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 UCX_MODULES='^ib,rdmacm'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
df -h /dev/shm | tail -1
start=$(date +%s)
python3 -m pivotrl_hpc.cli.bench_gpu --device cuda "$@" > "$out/gpu_check.json" \
  2> >(tee "$out/gpu_check.log" >&2)
echo "gpu check: $(( $(date +%s) - start )) s" >&2
cat "$out/gpu_check.json"
