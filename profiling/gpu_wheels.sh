#!/bin/bash
# Fetch the wheels the GPU check needs on the lent H200 (Python 3.12, torch + CUDA 13, no
# Megatron-Core, no NIXL there) into .whl/ (ignored by git; the device tool carries it).
# Usage: profiling/gpu_wheels.sh [--no-nixl]
#   megatron-core 0.16.1 (2.6 MB; needs torch, numpy, packaging: all there)
#   nixl-cu13 1.5.1      (59 MB; with the 1.4 MB tree it just fits the 64 MiB carry limit)
set -euo pipefail
cd "$(dirname "$0")/.."
wanted=(megatron-core==0.16.1)
[[ "${1:-}" == "--no-nixl" ]] || wanted+=(nixl-cu13==1.5.1)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl "${wanted[@]}"
du -ch .whl/*.whl | tail -1
