#!/bin/bash
# Every benchmark of the project, one JSON object per line, into OUT (default
# out/bench-<date>.jsonl). Each line is tagged with the command that made it.
#   profiling/run_benches.sh [OUT] [--quick]      (--quick: small sizes, for a smoke run)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/bench-$(date +%Y%m%d-%H%M%S).jsonl}
QUICK=${2:-}
P=.venv/bin/pivotrl
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
export UCX_MODULES='^ib,rdmacm'

run() { # label, command...
  local label=$1; shift
  echo "[bench] $label" >&2
  "$@" 2>>"$OUT.log" | python3 -c 'import json,sys; d=json.load(sys.stdin); d["bench"]=sys.argv[1]; print(json.dumps(d))' "$label" >> "$OUT"
}

if [ "$QUICK" = --quick ]; then
  GPUS="16 128"; GPS_MB=64; SIZES=tiny
else
  GPUS="16 32 64 128 256 512 1024"; GPS_MB=1024; SIZES=tiny,100m
fi
for n in $GPUS; do run "planner-$n" $P bench planner --gpus "$n" --json; done
run dispatch $P bench dispatch --replicas 128 --sequences 10000 --json
run gps $P bench gps --size-mb "$GPS_MB" --readers 2 --json
run shift $P bench shift --sizes "$SIZES" --json
echo "[bench] wrote $OUT ($(wc -l < "$OUT") results; engine logs in $OUT.log)" >&2
