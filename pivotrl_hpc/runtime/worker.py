"""The device worker: one role at a time, moved by shift down / shift up (paper §5.2).

A worker owns one device (a GPU, or here a CPU worker process). It keeps one vLLM engine per
model it has served (asleep when not in use: on CPU an empty shell that warm-restarts, on GPU
sleep mode level 2) and at most one Megatron trainer, whose process groups are preserved
across shifts. Parameters always come from the parameter store (GPS Read) on shift up, so a
device can take any role even when no other device holds that model.
"""
from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from pivotrl_hpc.engines.vllm.types import EngineOptions
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.runtime.context import ContextKind, phase
from pivotrl_hpc.runtime.messages import (
    ROLE_MODEL, Abort, AddSequences, Command, QueryState, Reply, RoleKind, ShiftDown, ShiftUp,
    Shutdown, Step, TrainStep, WaitWrite)

log = logging.getLogger(__name__)


class ParameterStore(Protocol):
    """What the worker needs of GPS: Read(M, G, P) and Write(M, G, P)."""

    def read(self, model: str, place: ParallelPlace,
             version: int | None = None) -> Mapping[str, Any]: ...

    def write(self, model: str, shard: Mapping[str, Any], place: ParallelPlace) -> Any:
        """Write this rank's Megatron shard; returns a handle whose wait() gives the version."""


@dataclass
class WorkerSpec:
    model_dirs: dict[str, str]                      # "policy"/"genrm" -> HF folder
    engine_options: dict[str, EngineOptions] = field(default_factory=dict)
    trainer_config: Any = None                      # engines.megatron.trainer.TrainerConfig
    inference_place: ParallelPlace = field(default_factory=ParallelPlace)
    training_place: ParallelPlace = field(default_factory=ParallelPlace)


class RoleError(RuntimeError):
    """A command that the worker's current role cannot take."""


class DeviceWorker:
    def __init__(self, spec: WorkerSpec, store: ParameterStore):
        self.spec, self.store = spec, store
        self.role, self.replica = RoleKind.IDLE, -1
        self.engines: dict[str, Any] = {}   # model -> VLLMEngine (preserved shell)
        self.trainer = None                  # MegatronTrainer (process groups preserved)
        self.version: int | None = None      # policy version last Read or written
        self.pending_write = None            # GPS WriteHandle of the last published step
        self._params_in_gps = False          # the trainer's params equal a GPS version:
        self._trainer_version: int | None = None  # ... this one
        self._params_discarded = False       # ... and were dropped on shift down
        self._handlers: dict[type, Callable[[Any], Any]] = {
            ShiftUp: self._shift_up, ShiftDown: self._shift_down, AddSequences: self._add,
            Step: self._step, Abort: self._abort, TrainStep: self._train_step,
            WaitWrite: self._wait_write, QueryState: self._state, Shutdown: self._shutdown}

    # --- dispatch ------------------------------------------------------------------------
    def handle(self, cmd: Command) -> Reply:
        """Run one command; a failure becomes a reply naming the sequences held."""
        name = type(cmd).__name__
        try:
            result, phases = self._handlers[type(cmd)](cmd)
            return Reply(name, True, self.role, self.replica, result=result, phases=phases)
        except Exception as e:  # noqa: BLE001 - the controller must hear about any failure
            held = self._held_seq_ids()
            log.error("worker failed on %s as %s: %s (holding %d sequences)",
                      name, self.role.value, e, len(held))
            return Reply(name, False, self.role, self.replica,
                         error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}",
                         seq_ids=held)

    def _held_seq_ids(self) -> tuple[str, ...]:
        engine = self._engine(required=False)
        if engine is None or not engine.awake:
            return ()
        try:
            return tuple(sorted(r.seq_id for r in engine.state().running))
        except Exception:  # noqa: BLE001 - a broken engine still must not hide the failure
            return ()

    def _engine(self, required: bool = True):
        model = ROLE_MODEL.get(self.role) if self.role != RoleKind.TRAINING else None
        engine = self.engines.get(model) if model else None
        if required and engine is None:
            raise RoleError(f"worker is {self.role.value}, not an inference replica")
        return engine

    # --- shift up / down -----------------------------------------------------------------
    def _shift_up(self, cmd: ShiftUp) -> tuple[Any, dict[str, float]]:
        if self.role != RoleKind.IDLE:
            raise RoleError(f"shift up to {cmd.role.value} while {self.role.value}: "
                            "shift down first (one role at a time)")
        if cmd.role == RoleKind.IDLE:
            raise RoleError("shift up needs a role")
        model = ROLE_MODEL[cmd.role]
        place = (self.spec.training_place if cmd.role == RoleKind.TRAINING
                 else self.spec.inference_place)
        t0 = time.perf_counter()
        version = cmd.version
        if version is None and cmd.role == RoleKind.TRAINING and self._params_discarded:
            version = self._trainer_version  # exactly the params the trainer dropped
        params_on_host = (cmd.role == RoleKind.TRAINING and self.trainer is not None
                          and not self._params_discarded)
        weights, phases = None, {}
        if not params_on_host:  # an unpublished update comes back from host: no Read for it
            weights = self.store.read(model, place, version)
            phases[phase(ContextKind.PARAMETERS, "read")] = time.perf_counter() - t0
        if cmd.role == RoleKind.TRAINING:
            phases.update(self._training_up(weights))
        else:
            phases.update(self._inference_up(model, weights))
        self.role, self.replica = cmd.role, cmd.replica
        if model == "policy" and weights is not None:
            self.version = version if version is not None else _current(self.store, model)
            if cmd.role == RoleKind.TRAINING and self._trainer_version is None:
                self._trainer_version = self.version
        phases["total"] = time.perf_counter() - t0
        log.info("shift up -> %s[%d] in %.2f s", cmd.role.value, cmd.replica, phases["total"])
        return None, phases

    def _inference_up(self, model: str, weights: Mapping[str, Any]) -> dict[str, float]:
        engine = self.engines.get(model)
        if engine is None:  # first time this device serves the model: build the engine
            from pivotrl_hpc.engines.vllm.engine import VLLMEngine

            engine = VLLMEngine(self.spec.model_dirs[model],
                                self.spec.engine_options.get(model), weights=weights)
            self.engines[model] = engine
            raw = engine.start_phases
        else:
            raw = engine.shift_up(weights)
        return {_engine_phase(k): v for k, v in raw.items()}

    def _training_up(self, weights: Mapping[str, Any] | None) -> dict[str, float]:
        phases: dict[str, float] = {}
        if self.trainer is None:
            from pivotrl_hpc.engines.megatron.trainer import MegatronTrainer
            from pivotrl_hpc.gps.shapes import ModelShape

            t0 = time.perf_counter()
            shape = ModelShape.from_hf_config(self.spec.model_dirs["policy"])
            self.trainer = MegatronTrainer(shape, self.spec.trainer_config)
            phases[phase(ContextKind.PRESERVED, "build")] = time.perf_counter() - t0
            first = True
        else:
            for k, v in self.trainer.reload().items():
                phases[phase(ContextKind.OFFLOADABLE, f"reload.{k}")] = v
            first = False
        if weights is not None:
            t0 = time.perf_counter()
            # On a re-shift-up the fp32 main params came back from host: keep them as master.
            self.trainer.load_hf(weights, refresh_main_params=first)
            phases[phase(ContextKind.PARAMETERS, "load")] = time.perf_counter() - t0
            self._params_in_gps = True
        self._params_discarded = False
        return phases

    def _shift_down(self, _cmd: ShiftDown) -> tuple[Any, dict[str, float]]:
        if self.role == RoleKind.IDLE:
            raise RoleError("shift down while idle")
        t0 = time.perf_counter()
        requeue: list = []
        if self.role == RoleKind.TRAINING:
            phases = self._training_down()
        else:
            engine = self._engine()
            requeue = engine.abort() if engine.num_running else []
            phases = {phase(ContextKind.TEMPORARY, "abort"): time.perf_counter() - t0}
            raw = engine.shift_down()
            phases.update({_engine_phase(k): v for k, v in raw.items()})
        log.info("shift down %s[%d]: %d sequences back to the queue", self.role.value,
                 self.replica, len(requeue))
        self.role, self.replica = RoleKind.IDLE, -1
        phases["total"] = time.perf_counter() - t0
        return requeue, phases

    def _training_down(self) -> dict[str, float]:
        """Parameters are discarded when GPS holds them (paper §5.2), after the last Write has
        landed; an unpublished update is offloaded to host instead, so nothing is lost."""
        phases = {}
        if self.pending_write is not None:
            t0 = time.perf_counter()
            self.version, self.pending_write = self.pending_write.wait(), None
            self._trainer_version = self.version
            phases["gps_replicate_wait"] = time.perf_counter() - t0
        discard = self._params_in_gps
        raw = self.trainer.offload(include_params=True, discard_params=discard)
        phases.update({phase(ContextKind.OFFLOADABLE, f"offload.{k}"): v for k, v in raw.items()})
        self._params_discarded = discard
        return phases

    # --- inference -----------------------------------------------------------------------
    def _add(self, cmd: AddSequences) -> tuple[Any, dict]:
        engine = self._engine()
        for s in cmd.seqs:
            engine.add(s.seq_id, s.prompt_ids, s.generated_ids, s.max_new_tokens, s.sampling,
                       generated_logprobs=s.generated_logprobs or None)
        return len(cmd.seqs), {}

    def _step(self, cmd: Step) -> tuple[Any, dict]:
        engine = self._engine()
        return [engine.step() for _ in range(cmd.iterations)], {}

    def _abort(self, cmd: Abort) -> tuple[Any, dict]:
        engine = self._engine()
        return engine.abort(None if cmd.seq_ids is None else list(cmd.seq_ids)), {}

    def _state(self, _cmd: QueryState) -> tuple[Any, dict]:
        engine = self._engine(required=False)
        state = engine.state() if engine is not None and engine.awake else None
        return {"role": self.role.value, "replica": self.replica, "version": self.version,
                "engine": state}, {}

    # --- training ------------------------------------------------------------------------
    def _train_step(self, cmd: TrainStep) -> tuple[Any, dict]:
        if self.role != RoleKind.TRAINING:
            raise RoleError(f"train step while {self.role.value}")
        t0 = time.perf_counter()
        metrics = dict(self.trainer.train_step(cmd.batch))
        phases = {"train_step": time.perf_counter() - t0}
        if cmd.publish:
            t1 = time.perf_counter()
            # Returns at memory speed; replication to the other nodes overlaps with whatever
            # the controller does next (wait on the handle before reading the new version).
            self.pending_write = self.store.write("policy", self.trainer.shard_state(),
                                                  self.spec.training_place)
            metrics["gps_version"] = self.pending_write.version
            phases["gps_write_submit"] = time.perf_counter() - t1
        self._params_in_gps = cmd.publish  # else a shift down must keep them (host copy)
        return metrics, phases

    def _wait_write(self, cmd: WaitWrite) -> tuple[Any, dict]:
        if self.pending_write is None:
            raise RoleError("no published policy version to wait for")
        t0 = time.perf_counter()
        version = self.pending_write.wait(cmd.timeout_s)
        self.version, self._trainer_version, self.pending_write = version, version, None
        return version, {"gps_replicate_wait": time.perf_counter() - t0}

    def _shutdown(self, _cmd: Shutdown) -> tuple[Any, dict]:
        requeue = []
        for engine in self.engines.values():
            if engine.awake and engine.num_running:
                requeue += engine.abort()
            engine.close()
        self.engines.clear()
        self.role, self.replica = RoleKind.IDLE, -1
        return requeue, {}


def _current(store: ParameterStore, model: str) -> int | None:
    state = getattr(store, "state", None)
    return state(model).current if state is not None else None


def _engine_phase(name: str) -> str:
    """Name an engine's own phase by the context it handles."""
    if name.startswith("params"):
        return phase(ContextKind.PARAMETERS, name.removeprefix("params_"))
    return phase(ContextKind.TEMPORARY if name in ("kv_alloc",) else ContextKind.PRESERVED, name)
