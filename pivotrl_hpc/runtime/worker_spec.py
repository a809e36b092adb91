"""What a device worker is built from (`WorkerSpec`), what it needs of GPS
(`ParameterStore`) and the error of a command its role cannot take: shared by the worker and
its inference engines (`worker_engines`), below both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from pivotrl_hpc.protocol.engine import EngineOptions
from pivotrl_hpc.gps.layout import ParallelPlace


class ParameterStore(Protocol):
    """What the worker needs of GPS: Read(M, G, P) and Write(M, G, P)."""

    def read(self, model: str, place: ParallelPlace, version: int | None = None,
             *, layout: str = "hf") -> Mapping[str, Any]:
        """`layout="hf"`: HF-named slices (inference); "megatron": a TP rank's shard."""

    def write(self, model: str, shard: Mapping[str, Any], place: ParallelPlace, *,
              follow: int | None = None) -> Any:
        """Write this rank's Megatron shard; returns a handle whose wait() gives the version
        (a DP rank > 0 writes nothing and, with `follow`, waits for that version)."""


@dataclass
class WorkerSpec:
    model_dirs: dict[str, str]                      # "policy"/"genrm" -> HF folder
    engine_options: dict[str, EngineOptions] = field(default_factory=dict)
    trainer_config: Any = None                      # engines.megatron.trainer.TrainerConfig
    inference_place: ParallelPlace = field(default_factory=ParallelPlace)
    training_place: ParallelPlace = field(default_factory=ParallelPlace)
    # True: inference engines run in engine hosts (child processes with their own torch
    # world, runtime.engine_host) that Read GPS themselves; needed when this process is in
    # a training world of several ranks. False: in this process (one-worker runs, tests).
    engine_process: bool = False
    engine_worlds: dict[str, Any] = field(default_factory=dict)  # model -> TPWorld (TP > 1)
    gps_job: str | None = None      # GPS of the hosts' Reads; None: the store's job / node
    gps_node: str | None = None
    device: int = 0                 # global device index (names the hosts in errors)
    resume: str = ""                # checkpoint folder the trainer's optimizer state comes from
    checkpoints: str = ""           # the run's checkpoints folder: a SaveCheckpoint writes
    group_shared: bool = False      # only inside it (trace.group_shared: its files' modes)


class RoleError(RuntimeError):
    """A command that the worker's current role cannot take."""
