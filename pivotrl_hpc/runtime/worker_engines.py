"""A device worker's inference engines: one per model it has served, asleep when not in use.

In engine hosts (`spec.engine_process`: child processes with their own torch world that Read
GPS themselves; a worker in a training world of several ranks needs them) each host keeps
its engine across shifts, so a device holds the policy and the GenRM at once. In this
process (one-worker runs, tests) one engine per process: vLLM's parallel state is
process-wide. The worker (`runtime.worker`) owns the roles; this module only builds, wakes
and reports the engines.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Mapping

from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.protocol.context import ContextKind, phase

if TYPE_CHECKING:
    from pivotrl_hpc.runtime.worker_spec import ParameterStore, WorkerSpec

log = logging.getLogger(__name__)


class WorkerEngines:
    def __init__(self, spec: "WorkerSpec", store: "ParameterStore"):
        self.spec, self.store = spec, store
        self.engines: dict[str, Any] = {}   # model -> VLLMEngine or EngineHost

    def up_in_process(self, model: str, weights: Mapping[str, Any]) -> dict[str, float]:
        phases = {}
        for other in [m for m in self.engines if m != model]:
            # vLLM's parallel state is process-wide: an engine of another model asleep in
            # this process would hand the new one its groups (a dense policy's lack the MoE
            # GenRM's expert group). One engine per process; engine hosts keep both.
            t0 = time.perf_counter()
            self.engines.pop(other).close()
            phases[phase(ContextKind.PRESERVED, "engine_close")] = time.perf_counter() - t0
        engine = self.engines.get(model)
        if engine is None:  # first time this device serves the model: build the engine
            from pivotrl_hpc.engines.vllm.engine import VLLMEngine

            engine = VLLMEngine(self.spec.model_dirs[model],
                                self.spec.engine_options.get(model), weights=weights)
            self.engines[model] = engine
            raw = engine.start_phases
        else:
            raw = engine.shift_up(weights)
        return phases | engine_phases(raw)

    def up_hosted(self, model: str, place: ParallelPlace,
                  version: int | None) -> dict[str, float]:
        from pivotrl_hpc.runtime.engine_host import EngineHost

        read = self.gps_read(model, place, version)
        host = self.engines.get(model)
        if host is not None and not host.started:  # preloaded at start-up: build it now
            return engine_phases(host.start(read))
        if host is None:  # first time this device serves the model: start its host
            host = EngineHost(self.spec.model_dirs[model], self.spec.engine_options.get(model),
                              read, world=self.spec.engine_worlds.get(model),
                              name=f"{model} on device {self.spec.device}")
            self.engines[model] = host
            raw = host.start_phases
        else:
            raw = host.shift_up(read)
        return engine_phases(raw)

    def prepare(self, models) -> tuple[Any, dict[str, float]]:
        """Build each engine of `models` not built yet and put it to sleep (hosts only: in
        this process there is one engine per process, see `up_in_process`)."""
        built, phases, t0 = [], {}, time.perf_counter()
        for model in models:
            host = self.engines.get(model)
            if not self.spec.engine_process or (host is not None and host.started):
                continue
            t1 = time.perf_counter()
            up = self.up_hosted(model, self.spec.inference_place, None)
            down = self.engines[model].shift_down()
            phases.update({f"{model}.{k}": v for k, v in up.items()})
            phases.update({f"{model}.{k}": v for k, v in engine_phases(down).items()})
            phases[f"{model}.total"] = time.perf_counter() - t1
            built.append(model)
        seconds = time.perf_counter() - t0 if built else 0.0
        log.info("prepared %s asleep in %.2f s", built or "nothing", seconds)
        return {"built": built, "seconds": seconds}, phases

    def prewarm(self) -> list[int]:
        """Start the engine hosts now (job start-up, before the device's CPU cap): their
        node's host forker imports vLLM (once for the node) while this process imports
        Megatron-Core (a training device), so a first shift up builds only the engine.
        Returns the hosts' pids: the launcher moves them under the device's cap too."""
        from pivotrl_hpc.runtime import host_forker
        from pivotrl_hpc.runtime.engine_host import EngineHost

        if not self.spec.engine_process:
            return []
        host_forker.ensure_running()
        if self.spec.trainer_config is not None:
            from pivotrl_hpc.engines.megatron.trainer import preload_megatron
            preload_megatron()
        for model in ("policy", "genrm"):
            if model not in self.engines:
                self.engines[model] = EngineHost(
                    self.spec.model_dirs[model], self.spec.engine_options.get(model),
                    world=self.spec.engine_worlds.get(model), start=False,
                    name=f"{model} on device {self.spec.device}")
        for host in self.engines.values():
            host.preloaded()
        return [host.pid for host in self.engines.values()]

    def gps_read(self, model: str, place: ParallelPlace, version: int | None):
        from pivotrl_hpc.runtime.host_wire import GPSRead
        from pivotrl_hpc.runtime.worker_spec import RoleError

        job = self.spec.gps_job or getattr(self.store, "job", None)
        node = self.spec.gps_node or getattr(self.store, "node", None)
        if job is None or node is None:
            raise RoleError("engine_process needs the GPS job and node (spec.gps_job/gps_node)")
        return GPSRead(job, node, model, place, version)

    def peak_rss_bytes(self) -> dict[str, int]:
        """Peak RSS (VmHWM) of each engine host (in-process engines have no pid)."""
        from pivotrl_hpc.engines.host import peak_rss_bytes

        out = {}
        for model, engine in self.engines.items():
            pid = getattr(engine, "pid", None)
            if pid is not None:
                try:
                    out[f"host:{model}"] = peak_rss_bytes(pid)
                except (OSError, RuntimeError):  # the host is gone: nothing to report
                    pass
        return out


def engine_phases(raw: Mapping[str, float]) -> dict[str, float]:
    """Name an engine's own phases by the context each handles."""
    return {_engine_phase(k): v for k, v in raw.items()}


def _engine_phase(name: str) -> str:
    if name.startswith("params"):
        return phase(ContextKind.PARAMETERS, name.removeprefix("params_"))
    return phase(ContextKind.TEMPORARY if name in ("kv_alloc",) else ContextKind.PRESERVED, name)
