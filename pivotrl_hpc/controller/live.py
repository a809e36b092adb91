"""The live job on global rank 0: config -> task, policy, MPI handles, trace -> the loop.

`run_job` is what the launcher calls on rank 0 (`launch.entry`); the same `Controller` runs
in the simulator with modeled workers. It returns the summary and writes it as JSON next to
the trace; the trace is closed (readable) on every exit path.
"""
from __future__ import annotations

import logging
import resource
import time
import socket
from pathlib import Path
from typing import Any, Mapping

import yaml

from pivotrl_hpc.config.load import to_dict
from pivotrl_hpc.config.schema import Config
from pivotrl_hpc.controller.clock import MonotonicClock
from pivotrl_hpc.controller.decide import ThreadDecider
from pivotrl_hpc.controller.flow import ControllerError
from pivotrl_hpc.controller.handles import Devices
from pivotrl_hpc.controller.loop import Controller, LoopConfig
from pivotrl_hpc.controller.monitor import RoleModel
from pivotrl_hpc.controller.mpi_handle import MPIInbox, MPIWorkerHandle
from pivotrl_hpc.controller.policy import TauTracker, initial_tau, make_paradigm_policy
from pivotrl_hpc.controller.report import format_summary
from pivotrl_hpc.controller.rl import Lengths, RLBook
from pivotrl_hpc.controller.segments import with_segments
from pivotrl_hpc.plan.types import ReplicaSpec, ShiftPlan
from pivotrl_hpc.protocol.messages import Shutdown
from pivotrl_hpc.task.task import build_task
from pivotrl_hpc.gps.memory import replica_kv_tokens
from pivotrl_hpc.sched.model import ThroughputModel
from pivotrl_hpc.sched.tail import TailIsolation

log = logging.getLogger(__name__)

# they place their own replicas
FIXED = ("colocated", "disaggregated", "rr_colocated", "rr_colocated_pooled")


def loop_config(cfg: Config) -> LoopConfig:
    r = cfg.roles
    return LoopConfig(
        gpus=cfg.total_devices,
        replica_gpus={"rollout": r.rollout_replica_size, "reward": r.reward_replica_size},
        # the tokens each engine's cache holds (gps/memory.py), live and simulated
        kv_capacity={"rollout": replica_kv_tokens(cfg, "policy"),
                     "reward": replica_kv_tokens(cfg, "genrm")},
        training_devices=tuple(range(r.train_devices)), steps=cfg.rl.steps,
        planner_interval_s=cfg.paradigm.planner_interval_s,
        log_interval_s=cfg.trace.log_interval_s, eval_every=cfg.rl.eval_every,
        eval_before_train=cfg.rl.eval_before_train, samples=cfg.trace.samples,
        step_iterations=r.step_iterations, prebuild=prebuild_models(cfg),
        ignore_eos_judge=cfg.workload.length_mode == "budget",
        migration=cfg.paradigm.migration, tail=tail_isolation(cfg))


def tail_isolation(cfg: Config) -> TailIsolation | None:
    """paradigm.tail_isolation as the Scheduler's spec: a batch's last n judgements, each on
    a replica of its own; sample ids run a batch at a time (controller/rl.py), prompts x
    group size of them."""
    n, batch = cfg.paradigm.tail_isolation, cfg.rl.batch_size * cfg.rl.group_size
    return TailIsolation(batch, late=min(n, batch), lanes=n) if n > 0 else None


def prebuild_models(cfg: Config) -> tuple[str, ...]:
    """The engines every device builds at start (roles.prebuild_engines): none where each
    device keeps one role for the whole job."""
    mode = cfg.roles.prebuild_engines
    if mode == "none" or (mode == "auto" and cfg.paradigm.name == "disaggregated"):
        return ()
    return ("policy", "genrm")


def role_models(cfg: Config) -> dict[str, RoleModel]:
    """From the profile file when named (fixed), else the config's constants, refitted."""
    if cfg.paradigm.throughput_profile:
        data = yaml.safe_load(Path(cfg.paradigm.throughput_profile).read_text())
        return {role: RoleModel(ThroughputModel.from_dict(data[model]), True)
                for role, model in (("rollout", "policy"), ("reward", "genrm"))}
    t = cfg.throughput
    return {"rollout": RoleModel(ThroughputModel(**vars(t.policy)), False),
            "reward": RoleModel(ThroughputModel(**vars(t.genrm)), False)}


def bootstrap_plan(cfg: Config) -> ShiftPlan | None:
    """The initial allocation of the non-fixed paradigms: rollout slots from device 0 up,
    then reward slots, as many devices as `paradigm.initial_*_devices` say."""
    if cfg.paradigm.name in FIXED:
        return None
    p, r = cfg.paradigm, cfg.roles
    ups, d = [], 0
    for role, count, size in (("rollout", p.initial_rollout_devices, r.rollout_replica_size),
                              ("reward", p.initial_reward_devices, r.reward_replica_size)):
        d = -(-d // size) * size
        for _ in range(count // size):
            ups.append(ReplicaSpec(role, tuple(range(d, d + size))))
            d += size
    return ShiftPlan((), tuple(ups), "initial allocation") if ups else None


def lengths(cfg: Config) -> Lengths:
    w, m = cfg.workload, cfg.models
    return Lengths(w.length_mode, w.rollout_median, w.rollout_sigma, m.policy.max_response_len,
                   w.genrm_median, w.genrm_sigma, m.genrm.max_response_len)


def build_controller(cfg: Config, devices: Devices, clock, trace,
                     decider=None) -> Controller:
    """The job's controller over `devices` (MPI handles live, modeled ones in sim.run);
    `decider` None decides inline (virtual time), a ThreadDecider beside the loop."""
    task, prompts, validation = build_task(cfg)
    book = RLBook(prompts, steps=cfg.rl.steps, batch_size=cfg.rl.batch_size,
                  group_size=cfg.rl.group_size, staleness=cfg.rl.staleness,
                  lengths=lengths(cfg), temperature=cfg.rl.temperature, seed=cfg.rl.seed,
                  keep_trained=False, eval_samples=cfg.rl.eval_samples,
                  eval_temperature=cfg.rl.eval_temperature,
                  partial=cfg.paradigm.partial_rollout)
    policy = make_paradigm_policy(cfg)
    tau = TauTracker(initial_tau(cfg))
    if cfg.paradigm.measured_tau:
        tau.attach(policy)
    return Controller(loop_config(cfg), clock, devices, policy, book, task, role_models(cfg),
                      tau, trace, decider, validation, bootstrap_plan(cfg))


def add_checkpoints(ctl: Controller, cfg: Config, trace_path: str | Path) -> None:
    """Checkpoints into the run's folder, and the resume when the launch resolved one."""
    from pivotrl_hpc.checkpoint.layout import base_trace, root_for
    from pivotrl_hpc.checkpoint.state import fixed_values
    from pivotrl_hpc.controller.checkpointing import Checkpointer, resume
    from pivotrl_hpc.config.schema import resumed_from

    ctl.checkpoints = Checkpointer(root_for(trace_path), cfg.rl.checkpoint_every,
                                   cfg.rl.keep_checkpoints, fixed_values(cfg),
                                   base_trace(Path(trace_path)).with_suffix(".logs"),
                                   cfg.trace.group_shared)
    if folder := resumed_from(cfg):
        resume(ctl, folder)


def run_job(cfg: Config, comm, layout, trace_path: str | Path, stopper=None) -> dict[str, Any]:
    """Run the RL job from rank 0 against the worker ranks of `layout` (launch.layout
    RankLayout); returns the summary (the launcher writes it next to the trace). `stopper`:
    the rank's launch.stop.Stopper, whose check the loop runs and which a deferred stop
    signal marks."""
    device_ranks = {d: layout.worker_rank(d) for d in layout.devices}
    try:
        return run_on(cfg, comm, device_ranks, trace_path, layout.placement(), stopper)
    except ControllerError as e:
        if e.device is None or e.device not in device_ranks:
            raise
        rank = device_ranks[e.device]
        where = layout.info(rank).describe()
        raise ControllerError(f"{where}: {e}", e.device) from e


def _on_usr1(ctl: Controller) -> None:
    """`kill -USR1 <rank 0>` logs what the loop waits on and asks for a checkpoint after the
    next step (main thread only)."""
    import signal
    import threading

    def handler(*_) -> None:
        log.warning("SIGUSR1: checkpoint after the next step; controller state:\n%s",
                    ctl.describe())
        if ctl.checkpoints is not None:
            ctl.checkpoints.request()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, handler)


SAME_SIGNAL_S = 5.0   # a SIGTERM this soon after the deferred one is the same stop


def _on_stop_signal(ctl: Controller, grace_s: float, stopper=None) -> None:
    """With a grace time (`rl.preempt_grace_s`), the first SIGTERM asks for a checkpoint
    after the running step and the end of the job, when `Checkpointer.fits`; otherwise, and
    on any later signal, the handler before (the rank's Stopper: stop at once) takes it. The
    Stopper has seen the signal either way (its wakeup fd): the job still ends as stopped by
    it, and the ranks' watchdogs run (launch.resume.stop_grace sizes them for the grace)."""
    import signal
    import threading

    if grace_s <= 0 or ctl.checkpoints is None or \
            threading.current_thread() is not threading.main_thread():
        return
    before = signal.getsignal(signal.SIGTERM)
    deferred: list[float] = []   # when the first SIGTERM was deferred

    def handler(signum, frame) -> None:
        now = time.monotonic()
        if deferred and now - deferred[0] < SAME_SIGNAL_S:
            return   # the same stop twice: from Slurm and from srun passing it on
        if not deferred and ctl.checkpoints.fits(ctl.clock.now(), grace_s):
            deferred.append(now)
            if stopper is not None:
                stopper.deferred = True   # not lost: the loop ends at the checkpoint
            log.warning("SIGTERM with %.0f s of grace: checkpoint after the running step, "
                        "then stop", grace_s)
            ctl.checkpoints.request("stop")
        elif callable(before):
            if not deferred:
                log.warning("SIGTERM: no checkpoint fits in %.0f s of grace: stopping now "
                            "(the next start resumes from the last periodic checkpoint)",
                            grace_s)
            before(signum, frame)

    signal.signal(signal.SIGTERM, handler)


def run_id(cfg: Config) -> str:
    """The run's id, the same in every segment: the resumed checkpoint's (its state.json
    "run"), else a new one. Its checkpoints carry it (pruning keeps to the run's own) and
    wandb resumes the run of that id."""
    import uuid

    from pivotrl_hpc.checkpoint.layout import CheckpointError, read_state
    from pivotrl_hpc.config.schema import resumed_from

    if folder := resumed_from(cfg):
        try:
            return str(read_state(Path(folder)).get("run") or uuid.uuid4().hex[:12])
        except CheckpointError:
            pass
    return uuid.uuid4().hex[:12]


def run_on(cfg: Config, comm, device_ranks: Mapping[int, int], trace_path: str | Path,
           placement: list[dict] | None = None, stopper=None) -> dict[str, Any]:
    from pivotrl_hpc.config.schema import resumed_from
    from pivotrl_hpc.trace import TraceWriter
    from pivotrl_hpc.trace.loggers import sinks

    clock = MonotonicClock()
    inbox = MPIInbox(comm)
    devices = Devices([MPIWorkerHandle(comm, rank, d, inbox)
                       for d, rank in sorted(device_ranks.items())])
    meta = {"config": to_dict(cfg), "paradigm": cfg.paradigm.name, "host": socket.gethostname(),
            "resumed_from": resumed_from(cfg), "run_id": run_id(cfg),
            "device_ranks": {str(d): r for d, r in device_ranks.items()},
            "ranks": placement or []}
    try:   # a logger that cannot start (wandb) ends the job now, not at a barrier's time-out
        trace = TraceWriter(str(trace_path), meta, **sinks(trace_path, cfg.trace, meta))
    except BaseException:
        devices.stop_all(Shutdown(), clock, 10.0)
        raise
    summary: dict[str, Any] | None = None
    try:
        try:
            ctl = build_controller(cfg, devices, clock, trace, ThreadDecider())
            ctl.run_id = meta["run_id"]
            add_checkpoints(ctl, cfg, trace_path)
        except BaseException:   # the loop never ran: its shutdown neither, so stop them here
            devices.stop_all(Shutdown(), clock, 10.0)
            raise
        _on_usr1(ctl)
        _on_stop_signal(ctl, cfg.rl.preempt_grace_s, stopper)
        if stopper is not None:
            ctl.stop_check = stopper.check
        summary = with_segments(ctl.run(), trace_path)   # the run's earlier segments too
        summary["controller_peak_rss_mb"] = resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 1024
        log.info("summary:\n%s", format_summary(summary))
        return summary
    except BaseException as exc:
        trace.append("events", t=clock.now(), kind="error", message=f"{type(exc).__name__}: {exc}")
        if getattr(exc, "summary", None) is not None:   # stopped by a signal: kept, as is
            summary = exc.summary = with_segments(exc.summary, trace_path)
        raise
    finally:
        trace.close(summary)
