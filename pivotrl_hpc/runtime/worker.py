"""The device worker: one role at a time, moved by shift down / shift up (paper §5.2).

A worker owns one device (a GPU, or here a CPU worker process). It keeps one vLLM engine per
model it has served, asleep when not in use (sleep mode level 2: vLLM's on GPU, `cpu_sleep`
on CPU; in-process engines, without hosts, one per process), and at most one Megatron
trainer, whose process groups are preserved across shifts. Parameters always come from the
parameter store (GPS Read) on shift up, so a device can take any role even when no other
device holds that model.
"""
from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

from pivotrl_hpc.engines.host import peak_rss_bytes
from pivotrl_hpc.protocol.context import ContextKind, phase
from pivotrl_hpc.protocol.messages import (ROLE_MODEL, Abort, AddSequences, Command, QueryState,
                                           Reload, Reply, RoleKind, Prepare, SaveCheckpoint,
                                           ShiftDown, ShiftUp, Shutdown, Step, TrainBatch,
                                           TrainStep, WaitWrite)
from pivotrl_hpc.runtime import checkpoint
from pivotrl_hpc.runtime.worker_engines import WorkerEngines, engine_phases
# What a worker is made of sits below both the worker and its engines; re-exported.
from pivotrl_hpc.runtime.worker_spec import ParameterStore, RoleError, WorkerSpec

log = logging.getLogger(__name__)


class DeviceWorker:
    def __init__(self, spec: WorkerSpec, store: ParameterStore):
        self.spec, self.store = spec, store
        self.role, self.replica = RoleKind.IDLE, -1
        self.inference = WorkerEngines(spec, store)
        self.engines = self.inference.engines  # model -> engine (preserved shell)
        self.trainer = None                  # MegatronTrainer (process groups preserved)
        self.version: int | None = None      # policy version last Read or written
        self.pending_write = None            # GPS WriteHandle of the last published step
        self._params_in_gps = False          # the trainer's params equal a GPS version:
        self._trainer_version: int | None = None  # ... this one
        self._params_discarded = False       # ... and were dropped on shift down
        self._handlers: dict[type, Callable[[Any], Any]] = {
            ShiftUp: self._shift_up, ShiftDown: self._shift_down, Prepare: self._prepare,
            AddSequences: self._add, Step: self._step, Abort: self._abort,
            TrainStep: self._train_step,
            WaitWrite: self._wait_write, Reload: self._reload, QueryState: self._state,
            SaveCheckpoint: self._checkpoint, Shutdown: self._shutdown}

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
        hosted = self.spec.engine_process and cmd.role != RoleKind.TRAINING
        weights, phases = None, {}
        if not params_on_host and not hosted:  # an unpublished update comes back from host
            # Training Reads exactly its TP rank's Megatron shard; inference the HF slices.
            kw = {"layout": "megatron"} if cmd.role == RoleKind.TRAINING else {}
            if version is None:  # the current one, pinned as it is named (issue 47)
                weights, version = read_current(self.store, model, place, **kw)
            else:
                weights = self.store.read(model, place, version, **kw)
            phases[phase(ContextKind.PARAMETERS, "read")] = time.perf_counter() - t0
        if cmd.role == RoleKind.TRAINING:
            phases.update(self._training_up(weights))
        elif hosted:  # the host Reads GPS itself
            phases.update(self.inference.up_hosted(model, place, version))
            version = self.engines[model].version
        else:  # the engine's own params_read (materialise + check) adds to the GPS Read
            for key, seconds in self.inference.up_in_process(model, weights).items():
                phases[key] = phases.get(key, 0.0) + seconds
        self.role, self.replica = cmd.role, cmd.replica
        if model == "policy" and hosted:
            self.version = self.engines[model].version
        elif model == "policy" and weights is not None:
            self.version = version
            if cmd.role == RoleKind.TRAINING and self._trainer_version is None:
                self._trainer_version = self.version
        phases["total"] = time.perf_counter() - t0
        log.info("shift up -> %s[%d] in %.2f s", cmd.role.value, cmd.replica, phases["total"])
        # read: the GPS version Read (None: the params came back from host, no Read)
        return {"version": self.version if model == "policy" else None,
                "read": version if weights is not None or hosted else None}, phases

    def _prepare(self, cmd: Prepare) -> tuple[Any, dict[str, float]]:
        """Build each engine of `cmd.models` not built yet and put it to sleep."""
        if self.role != RoleKind.IDLE:
            raise RoleError(f"prepare while {self.role.value}: only an idle device builds")
        return self.inference.prepare(cmd.models)

    def prewarm(self) -> list[int]:
        """Start the engine hosts before the device's CPU cap (`WorkerEngines.prewarm`)."""
        return self.inference.prewarm()

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
            self.trainer.load_shard(weights, refresh_main_params=first)
            phases[phase(ContextKind.PARAMETERS, "load")] = time.perf_counter() - t0
            self._params_in_gps = True
            if first and self.spec.resume:
                t0 = time.perf_counter()
                checkpoint.load_training(self.trainer, Path(self.spec.resume),
                                         checkpoint.train_rank(self.spec.training_place))
                phases[phase(ContextKind.OFFLOADABLE, "checkpoint.load")] = \
                    time.perf_counter() - t0
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
            phases.update(engine_phases(engine.shift_down()))
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
        return engine.steps(cmd.iterations), {}

    def _abort(self, cmd: Abort) -> tuple[Any, dict]:
        """Abort the named sequences that still run here. A named one that already finished
        (its last tokens were on their way to the controller when the Abort was sent) is
        skipped: the controller keeps its record and ignores the late output."""
        engine = self._engine()
        if cmd.seq_ids is None:
            return engine.abort(None), {}
        running = {r.seq_id for r in engine.state().running}
        return engine.abort([s for s in cmd.seq_ids if s in running]), {}

    def _state(self, _cmd: QueryState) -> tuple[Any, dict]:
        engine = self._engine(required=False)
        state = engine.state() if engine is not None and engine.awake else None
        return {"role": self.role.value, "replica": self.replica, "version": self.version,
                "engine": state, "peak_rss_mb": self.peak_rss_mb()}, {}

    def peak_rss_mb(self) -> dict[str, float]:
        """Peak RSS (VmHWM) of this worker rank and of each engine host it runs."""
        hosts = self.inference.peak_rss_bytes()
        return {"worker": peak_rss_bytes() / 2**20} | {k: v / 2**20 for k, v in hosts.items()}

    # --- training ------------------------------------------------------------------------
    def _train_step(self, cmd: TrainStep) -> tuple[Any, dict]:
        if self.role != RoleKind.TRAINING:
            raise RoleError(f"train step while {self.role.value}")
        t0 = time.perf_counter()
        batch = _rollout_batch(cmd.batch) if isinstance(cmd.batch, TrainBatch) else cmd.batch
        metrics = dict(self.trainer.train_step(batch))
        phases = {"train_step": time.perf_counter() - t0}
        if cmd.publish:
            t1 = time.perf_counter()
            # Returns at memory speed; replication to the other nodes overlaps with whatever
            # the controller does next (wait on the handle before reading the new version).
            # Only DP rank 0 writes; the others follow its version (versions count the
            # published steps), so that a re-shift-up Reads exactly their params back.
            follow = {} if self.spec.training_place.dp_rank == 0 else {
                "follow": (self._trainer_version or 0) + 1}
            self.pending_write = self.store.write("policy", self.trainer.shard_state(),
                                                  self.spec.training_place, **follow)
            metrics["gps_version"] = self.pending_write.version
            phases["gps_write_submit"] = time.perf_counter() - t1
        self._params_in_gps = cmd.publish  # else a shift down must keep them (host copy)
        return metrics, phases

    def _wait_write(self, cmd: WaitWrite) -> tuple[Any, dict]:
        if self.pending_write is None:
            raise RoleError("no published policy version to wait for")
        t0 = time.perf_counter()
        handle = self.pending_write
        version = handle.wait(cmd.timeout_s)
        self.version, self._trainer_version, self.pending_write = version, version, None
        # the writer (DP rank 0) reports the replication; the ranks that follow it have none
        info = handle.replication() if hasattr(handle, "replication") else {}
        return ({"version": version, "dp_rank": self.spec.training_place.dp_rank, **info},
                {"gps_replicate_wait": time.perf_counter() - t0})

    def _reload(self, cmd: Reload) -> tuple[Any, dict]:
        """Load `cmd.version` or a newer live one: the current version, pinned as it is
        named. A step published between the controller's send and this read has retired
        the named one already (issue 47); newer is always allowed (the staleness bound is
        about the oldest version generating)."""
        if self.role != RoleKind.ROLLOUT:
            raise RoleError(f"reload of policy weights while {self.role.value}")
        t0 = time.perf_counter()
        wait_for_version(self.store, "policy", cmd.version)
        if self.spec.engine_process:  # the host Reads GPS itself: Read + load in one figure
            host = self._engine()
            seconds = host.load_weights(self.inference.gps_read(
                "policy", self.spec.inference_place, None))
            self.version = _at_least(host.version, cmd.version)
            return {"version": self.version}, {phase(ContextKind.PARAMETERS, "load"): seconds}
        weights, version = read_current(self.store, "policy", self.spec.inference_place)
        version = _at_least(version, cmd.version)
        phases = {phase(ContextKind.PARAMETERS, "read"): time.perf_counter() - t0}
        phases[phase(ContextKind.PARAMETERS, "load")] = self._engine().load_weights(weights)
        self.version = version
        return {"version": self.version}, phases

    def _checkpoint(self, cmd: SaveCheckpoint) -> tuple[Any, dict]:
        if self.role != RoleKind.TRAINING:
            raise RoleError(f"checkpoint while {self.role.value}: the trainer must be up")
        self.trainer._require_resident()
        return checkpoint.save(self, cmd.folder, cmd.version)

    def _shutdown(self, _cmd: Shutdown) -> tuple[Any, dict]:
        """Abort and close the engines (their sequences go back to the controller); a training
        worker first waits for its last published Write, so that version is whole in GPS."""
        phases = {}
        if self.pending_write is not None:
            t0 = time.perf_counter()
            self.version = self._trainer_version = self.pending_write.wait()
            self.pending_write = None
            phases["gps_replicate_wait"] = time.perf_counter() - t0
        if self.trainer is not None and not self._params_in_gps:
            log.warning("shutdown drops an unpublished training step (GPS holds v%s)",
                        self._trainer_version)
        requeue = []
        for engine in self.engines.values():
            if engine.awake and engine.num_running:
                requeue += engine.abort()
            engine.close()
        self.engines.clear()
        self.role, self.replica = RoleKind.IDLE, -1
        return requeue, phases


def _rollout_batch(b: TrainBatch, pad_id: int = 0):
    """The trainer's tensors of a batch the controller sent as plain lists."""
    from pivotrl_hpc.engines.megatron.batch import RolloutBatch

    return RolloutBatch.from_sequences(b.prompts, b.responses, b.logprobs, b.rewards,
                                       b.group_ids, pad_id=pad_id)


def read_current(store: ParameterStore, model: str, place, **kw) -> tuple[Any, int | None]:
    """GPS Read of the current version and that version's number. Named and read under one
    pin: naming it first and reading it after fails when a publish retires it in between."""
    pin = getattr(store, "pin", None)
    if pin is None:   # a store without pins (a test's): its current version, unnamed
        return store.read(model, place, None, **kw), None
    with pin(model) as p:
        return store.read(model, place, pin=p, **kw), p.version


def wait_for_version(store: ParameterStore, model: str, version: int | None,
                     timeout_s: float = 60.0) -> None:
    """Until this node's GPS holds `version` or a newer one (a Reload names a version
    every node holds: this returns at once unless a node lags)."""
    wait = getattr(store, "wait_version", None)
    if version is not None and wait is not None:
        wait(model, version, timeout_s)


def _at_least(got: int | None, wanted: int | None) -> int | None:
    if got is not None and wanted is not None and got < wanted:
        raise RoleError(f"policy v{got} loaded, older than v{wanted} that the Reload needs")
    return got
