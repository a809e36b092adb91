"""The controller's loop: one loop for every paradigm (they differ only in the policy).

    while not ctl.done():
        ctl.collect()        # replies -> schedulers, RL book, shifts
        ctl.maybe_plan()     # interval or event; the decision runs beside the loop
        ctl.admit()          # staleness-bounded admission of prompts
        ctl.dispatch()       # Dispatch(Q, R) on both schedulers
        ctl.drive()          # Step the inference replicas that have work
        ctl.maybe_train()    # TrainStep when the next batch is ready and training is up
        ctl.monitor()        # timeseries, progress line
        clock.wait_until(ctl.next_event())

Written against a `Clock` and `WorkerHandle`s only: no sleeps, MPI or engines in here, so
the cluster simulator drives the very same code with virtual time and modeled workers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pivotrl_hpc.controller.clock import Clock
from pivotrl_hpc.controller.decide import Decider, InlineDecider
from pivotrl_hpc.controller.actions import (MIGRATE, Action, PlanError, add_actions,
                                             check_plan)
from pivotrl_hpc.controller.flow import RoleFlow, SeqRecord, check_replies
from pivotrl_hpc.controller.handles import Devices
from pivotrl_hpc.controller.monitor import RoleModel, TrainingView, snapshot
from pivotrl_hpc.controller.policy import TauTracker
from pivotrl_hpc.controller.report import NullTrace, Reporter
from pivotrl_hpc.controller.rl import RLBook, Sample, Task
from pivotrl_hpc.controller.samples import EvalTally, kept
from pivotrl_hpc.controller.shifts import Executor, TrainingUnit
from pivotrl_hpc.protocol.engine import Sampling
from pivotrl_hpc.plan.snapshot import GEN_ROLES, WorkloadSnapshot
from pivotrl_hpc.plan.types import AllocationPolicy, ShiftPlan
from pivotrl_hpc.protocol.messages import (Prepare, QueryState, Reply, Shutdown, Step, TrainBatch,
                                           TrainStep, WaitWrite)
from pivotrl_hpc.sched.scheduler import Scheduler
from pivotrl_hpc.sched.tail import TailIsolation

log = logging.getLogger(__name__)
STOP_SHUTDOWN_S = 15.0   # a stop signal's Shutdown wait: inside launch.stop's 20 s grace


@dataclass(frozen=True)
class LoopConfig:
    gpus: int
    replica_gpus: dict[str, int]          # rollout / reward devices per replica
    kv_capacity: dict[str, int]           # tokens per replica
    training_devices: tuple[int, ...]
    steps: int
    planner_interval_s: float = 5.0
    log_interval_s: float = 5.0
    step_iterations: int = 4              # engine iterations per Step command
    eval_every: int = 0                   # and after the last step (0: no evaluation)
    eval_before_train: bool = False
    samples: int | str = 4                # texts kept per step (trace.samples)
    judge_greedy: bool = True
    ignore_eos_judge: bool = True
    prebuild: tuple[str, ...] = ()        # engines every device builds asleep at start
    # shift-up migration loop of a policy without planner parameters (sched.migration)
    migration: bool | str = True
    tail: TailIsolation | None = None     # Dispatch's tail isolation (None: the paper's)


class Controller:
    def __init__(self, cfg: LoopConfig, clock: Clock, devices: Devices,
                 policy: AllocationPolicy, book: RLBook, task: Task,
                 models: dict[str, RoleModel], tau: TauTracker, trace,
                 decider: Decider | None = None, validation: Sequence = (),
                 bootstrap: ShiftPlan | None = None) -> None:
        self.cfg, self.clock, self.devices = cfg, clock, devices
        self.policy, self.book, self.task, self.models = policy, book, task, models
        self.tau, self.trace = tau, trace if trace is not None else NullTrace()
        self.decider = decider or InlineDecider()
        self.validation = list(validation)
        # tail isolation (sched/tail.py) for reward, whose batches arrive a response at a time
        self.flows = {role: RoleFlow(role, Scheduler(models[role].model, tail=cfg.tail
                                                     if role == "reward" else None),
                                     self._finished, self._seq_event) for role in GEN_ROLES}
        self.training = TrainingUnit(tuple(cfg.training_devices))
        # the planner's ablations without migration run without it, not only plan so
        migrate = getattr(getattr(policy, "params", None), "migrate", cfg.migration)
        self.executor = Executor(devices, self.flows, self.training, cfg.kv_capacity, tau,
                                 self.trace, clock.now, self._event, migrate)
        self.report = Reporter(self, self.trace)
        self.step = 0                       # next step to train
        self.plans = 0                      # planner rows so far: the next plan_id
        self._plan_at = 0.0
        self._events = True
        self._bootstrap = bootstrap
        self._eval_pending: dict[int, EvalTally] = {}   # step -> its evaluation's counts
        self.checkpoints = None             # controller.checkpointing.Checkpointer (live)
        self.stop_reason: str | None = None  # set to end the job early (a requeue)
        self.prebuilt_s: float | None = None  # when the last device's engines were built
        self.preparing: set[int] = set()       # devices still building them
        # live: the rank's stop check (launch.stop.Stopper.check), a backstop for a stop
        # signal whose interrupt was lost; nothing to check under the simulator
        self.stop_check: Callable[[], None] = lambda: None

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        ok, stopped = False, None
        try:
            self.report.start()   # what this segment starts from (a resume restored some)
            self.prebuild()
            if self._bootstrap is not None:   # the start-up allocation: planner row 0
                self._execute(self.snapshot(), self._bootstrap, None, 0.0)
            if self.cfg.eval_before_train and self.validation and self.step == 0:
                self._start_eval(0)
            while not self.done():
                self.stop_check()
                self.collect()
                self.maybe_plan()
                self.admit()
                self.dispatch()
                self.drive()
                self.maybe_train()
                self.monitor()
                self.clock.wait_until(self.next_event())
            self.report.tick(self.clock.now(), last=True)
            ok = True
            # replies the query collects (a shift still in flight) land in the trace: the
            # summary comes after them, so that it is what the rows say (trace check)
            peak_rss = self.peak_rss()
            summary = self.report.summary()
            if self.stop_reason is not None:
                summary["stopped"] = self.stop_reason
            summary["peak_rss_mb"] = peak_rss
            return summary
        except KeyboardInterrupt as e:   # a stop signal (launch.stop.Interrupted): orderly
            stopped = e
            raise
        finally:
            self.trace.flush()  # readable whatever happens next (a dead worker gets us killed)
            # A failed run waits only briefly for answers: a dead worker never replies. On a
            # stop the workers first finish the command they are in (a shift up, a step:
            # seconds), inside the ranks' stop grace (20 s).
            self.shutdown(60.0 if ok else STOP_SHUTDOWN_S if stopped is not None else 5.0,
                          orderly=ok or stopped is not None)
            if stopped is not None:   # after the shutdown's replies, as at the end above
                self._stop_summary(stopped)

    def _stop_summary(self, e: KeyboardInterrupt) -> None:
        """What the run did until the stop, for the summary the launch writes (the stop goes
        on without it if it cannot be made)."""
        try:
            e.summary = {**self.report.summary(), "stopped": f"{e} after step {self.step}"}
        except Exception:
            log.exception("no summary at the stop")

    def prebuild(self) -> None:
        """Prepare every device (its engines built, asleep) before anything else: the
        commands queue behind it per device, so the loop does not wait here."""
        if not self.cfg.prebuild:
            return
        left = self.preparing = set(self.devices.handles)

        def done(replies: list[Reply]) -> None:
            check_replies(replies)
            r, now = replies[0], self.clock.now()
            self.trace.append("events", t=now, kind="prepare",
                              message=f"device {r.device}: {r.result['built']} built asleep "
                                      f"in {r.result['seconds']:.1f} s")
            left.discard(r.device)
            if not left:
                self.prebuilt_s = now
                log.info("every device prepared %s at %.1f s", self.cfg.prebuild, now)

        for d in sorted(self.devices.handles):
            self.devices.send((d,), Prepare(self.cfg.prebuild), done)

    @property
    def published(self) -> int:
        """The policy version every node holds (the executor reloads rollout to it)."""
        return self.executor.published

    def done(self) -> bool:
        if self.stop_reason is not None:   # everything in flight is in the checkpoint
            return not self.training.active
        return (self.step >= self.cfg.steps and not self.training.active
                and not self._eval_pending)

    def collect(self) -> None:
        self.devices.collect()
        for role, flow in self.flows.items():
            for replica, sid in flow.preempted:
                info = self.executor.book.replicas.get(replica)
                if info is not None:
                    self.executor.apply(Action(MIGRATE, "abort", role, replica, info.devices,
                                               (sid,)), None)
            flow.preempted.clear()

    # --- planning ----------------------------------------------------------------------
    def maybe_plan(self) -> None:
        self._take_decision()
        now = self.clock.now()
        if not self._plan_due(now):
            return
        self._events, self._plan_at = False, now + self.cfg.planner_interval_s
        self.decider.start(self.policy, self.snapshot())
        # An inline decider (virtual time) has its plan already: carry it out now, as the
        # live loop does within milliseconds, not at the next planner tick; one that
        # charges the decision's seconds hands it over then (next_event wakes the loop).
        self._take_decision()

    def _take_decision(self) -> None:
        got = self.decider.poll()
        if got is not None:
            self._execute(*got)

    def _plan_due(self, now: float) -> bool:
        """A decision may start: nothing decided or shifting now, and an event came in or
        the planner interval passed."""
        return not (self.decider.busy or self.executor.book.in_flight
                    or self.training.shifting) and (self._events or now >= self._plan_at)

    def _execute(self, snap: WorkloadSnapshot, plan: ShiftPlan | None, report: Any,
                 seconds: float) -> None:
        """Re-check the plan against the state now (the loop went on while it was made)."""
        executed, reason = 0, "no shift" if plan is None else plan.reason
        plan_id, self.plans = self.plans, self.plans + 1
        if plan is not None and not self.executor.book.in_flight:
            try:
                check_plan(plan, self.executor.book.replicas, self.training.devices,
                           self.training.up, self.training.active, self.cfg.gpus)
                self.executor.execute(plan, plan_id)
                executed = 1
            except PlanError as exc:
                reason = f"discarded: {exc}"
        self.report.planner(plan_id, snap, plan, report, seconds, executed, reason)

    def snapshot(self) -> WorkloadSnapshot:
        tr = self.training
        view = TrainingView(tr.devices, tr.up, tr.active, self.book.batch_ready(self.step))
        devices_of = {rid: info.devices for rid, info in self.executor.book.replicas.items()}
        return snapshot(self.cfg.gpus, self.cfg.replica_gpus, self.cfg.kv_capacity,
                        self.models, {r: f.sched for r, f in self.flows.items()},
                        devices_of, view, self.clock.now())

    def _event(self) -> None:
        self._events = True

    # --- sequences ---------------------------------------------------------------------
    def gen_version(self) -> int:
        """The oldest policy version a rollout replica serves (or will, once up)."""
        served = [v for v in self.flows["rollout"].versions.values() if v is not None]
        return min(served + [self.published])

    def admit(self) -> None:
        version, held, now = self.gen_version(), self.book.held_s, self.clock.now()
        # rr_colocated's pool serves one batch at a time (plan.policies.RRColocatedPolicy)
        admitted = self.book.admit(version, now, getattr(self.policy, "per_batch", False))
        if admitted or self.book.held_s != held:
            self.report.admission(now, version, len(admitted), self.book.held_s - held)
        for s in admitted:
            self._submit_rollout(s)
            self._events = True

    def _submit_rollout(self, s: Sample) -> None:
        self.flows["rollout"].submit(SeqRecord(s.sid, "rollout", s.prompt.prompt_ids,
                                               s.budget, s.sampling))

    def _submit_judge(self, s: Sample) -> None:
        greedy = Sampling(temperature=0.0, ignore_eos=self.cfg.ignore_eos_judge)
        self.flows["reward"].submit(SeqRecord(s.sid, "reward", tuple(s.judge_prompt),
                                              s.judge_budget, greedy))

    def dispatch(self) -> None:
        for role, flow in self.flows.items():
            if not flow.sched.queue:   # nothing to place: skip building the index
                continue
            moves = flow.sched.dispatch()
            flow.evicted()
            for action in add_actions(role, moves, self.executor.book.replicas):
                self.executor.apply(action, None)

    def drive(self) -> None:
        """Step every replica that has work and whose devices are all free (a TP replica's
        devices run in lockstep: one Step at a time on all of them)."""
        for role, flow in self.flows.items():
            for rid, r in flow.sched.replicas.items():
                info = self.executor.book.replicas[rid]
                if r.n_seq and not any(self.devices.busy(d) for d in info.devices):
                    self.devices.send(info.devices, Step(self.cfg.step_iterations),
                                      self._stepped(role, rid, flow.placements(rid),
                                                    (r.n_seq, r.n_tok), self.clock.now(),
                                                    info.devices))

    def _stepped(self, role: str, rid: str, epochs: dict[int, int], load: tuple[int, int],
                 sent: float, devices: tuple[int, ...]):
        def done(replies: list[Reply]) -> None:
            check_replies(replies)
            outputs, now = replies[0].result, self.clock.now()
            # what the Step cost beyond its engine iterations (the round trip through the
            # worker and its engine host, the loop's own turn), and a first Step's warm-up
            engine_s = sum(o.seconds for o in outputs)
            first = self.flows[role].first_step(devices)
            self.report.step_timing(role, now - sent, engine_s, first)
            if not first:   # a first Step's warm-up is no decode iteration
                self._observe(role, rid, load, sum(o.iterations for o in outputs), now - sent)
            new = self.flows[role].on_step(rid, outputs, now, epochs)
            self.report.work(now, role, rid, devices, now - sent, engine_s, new, first)
        return done

    def _observe(self, role: str, rid: str, load: tuple[int, int], iterations: int,
                 seconds: float) -> None:
        """One Step's round trip, with the load it was sent with -> the online fit
        (monitor.RoleModel pools Steps into windows); Dispatch uses the model in use."""
        fit = self.models[role].observe_step(rid, *load, iterations, seconds)
        if fit is not None:
            self.flows[role].sched.model = self.models[role].model
            self.report.fit(role, fit)

    def _seq_event(self, event: str, rec: SeqRecord, replica: str,
                   tokens: int | None = None) -> None:
        self.report.sequence(event, rec, replica, tokens)

    def _finished(self, rec: SeqRecord, now: float) -> None:
        self._events = True
        s = self.book.samples[rec.sid]
        if rec.role == "rollout":
            self.book.rolled(rec.sid, rec.generated, rec.logprobs, rec.version, self.task)
            if s.batch < 0:
                self._validated(s)
                return
            self._submit_judge(s)
        else:
            self.book.rewarded(rec.sid, rec.generated, self.task)
            self.report.sequence("reward", rec, "")

    # --- training ----------------------------------------------------------------------
    def maybe_train(self) -> None:
        tr = self.training
        if not tr.up or tr.active or tr.shifting or not self.book.batch_ready(self.step):
            return
        if self.stop_reason is not None:   # the job ends at the checkpoint just written
            return
        samples = self.book.form(self.step)   # partial rollout chooses its groups here
        batch = TrainBatch(tuple(s.prompt.prompt_ids for s in samples),
                           tuple(tuple(s.response) for s in samples),
                           tuple(tuple(s.logprobs) for s in samples),
                           tuple(s.score.reward for s in samples),
                           self.book.group_ids(samples))
        tr.active, tr.samples = True, len(samples)
        step, t0 = self.step, self.clock.now()
        self.devices.send(tr.devices, TrainStep(batch, publish=True),
                          lambda replies: self._trained(step, t0, replies))

    def _trained(self, step: int, t0: float, replies: list[Reply]) -> None:
        check_replies(replies)
        metrics = replies[0].result
        samples = self.book.trained(step)
        self.step, self.training.samples = step + 1, 0
        self._events = True
        self.report.step(step, metrics, samples, self.clock.now() - t0)
        # The GPS Write replicates while the loop goes on (§5.1); rollout reloads after.
        self.devices.send(self.training.devices, WaitWrite(), self._published)

    def _published(self, replies: list[Reply]) -> None:
        check_replies(replies)
        writer = next((r for r in replies if r.result.get("dp_rank", 0) == 0), replies[0])
        self.report.replicated(writer.result, getattr(self.devices.handles[writer.device],
                                                      "rank", -1))
        self.executor.published = int(writer.result["version"])
        self.training.active = False
        self._events = True
        for rid, info in self.executor.book.replicas.items():
            if info.role == "rollout":
                self.executor.reload(rid)
        every = self.cfg.eval_every
        if every and self.validation and (self.step % every == 0 or self.step == self.cfg.steps):
            self._start_eval(self.step)
        if self.checkpoints is not None and self.checkpoints.due(self.step, self.cfg.steps,
                                                                 self.clock.now()):
            self.checkpoints.save(self)  # the trainer stays up (and busy) until it is written

    # --- validation --------------------------------------------------------------------
    def _start_eval(self, step: int) -> None:
        samples = self.book.validation(self.validation)
        for s in samples:
            s.batch = -1 - step  # negative: validation of the policy after `step` steps
            self._submit_rollout(s)
        self._eval_pending[step] = EvalTally(samples[0].sid, len(samples))

    def _validated(self, s: Sample) -> None:
        """pass@1 over every sample of every prompt, overall and per data source."""
        step = -1 - s.batch
        tally = self._eval_pending[step]
        correct = self.task.correct(s.prompt, s.response)
        tally.add(s.prompt.data_source, correct, s.version)
        if s.sid - tally.first_sid < kept(self.cfg.samples, s.sid - tally.first_sid + 1):
            self.report.sample(s, "eval", step, correct)
        if not self.book.keep_trained:
            del self.book.samples[s.sid]
        if tally.pending == 0:
            del self._eval_pending[step]
            self.report.validation(step, tally.accuracy(), tally.by_source(),
                                   dict(tally.versions))

    # --- monitor, waiting, shutdown ----------------------------------------------------
    def describe(self) -> str:
        """What the loop waits on (`kill -USR1` of rank 0 logs it): devices, replicas,
        sequences not finished, training."""
        lines = [f"step {self.step}/{self.cfg.steps}, published v{self.published}, "
                 f"training up={self.training.up} active={self.training.active} "
                 f"shifting={self.training.shifting}, plans in flight "
                 f"{self.executor.book.in_flight}"]
        lines += [f"  device {d}: {s}" for d, s in self.devices.describe().items()]
        for role, flow in self.flows.items():
            for rid, r in flow.sched.replicas.items():
                lines.append(f"  {role} {rid}: {sorted(r.seqs)} on devices "
                             f"{self.executor.book.replicas[rid].devices}")
            open_recs = [f"{r.sid}@{r.replica}#{r.epoch}:{len(r.generated)}/{r.budget}"
                         for r in flow.records.values() if not r.finished]
            lines.append(f"  {role} queue {[q.seq_id for q in flow.sched.queue]}, open "
                         f"records {open_recs[:40]}")
        return "\n".join(lines)

    def monitor(self) -> None:
        self.report.tick(self.clock.now())
        if self.checkpoints is not None:
            self.checkpoints.poll(self.clock.now())

    def next_event(self) -> float:
        """The earliest of: a reply due (simulation), the next planning round, the next
        progress line, a decision handed over. Nothing pending at all: one planner
        interval on."""
        now = self.clock.now()
        reply = self.devices.next_reply_time()
        if reply is not None and reply <= now:
            # a zero-second command (Abort, AddSequences) answered at once: take it now, not
            # at the next tick (the sequence it moves would sit on two replicas meanwhile)
            return now
        if self._events and self._plan_due(now):
            return now   # an event came in after this turn's planning: plan on it now
        due = [self._plan_at, self.report.next_tick, reply, self.decider.ready_at]
        later = [t for t in due if t is not None and t > now]
        return min(later) if later else now + self.cfg.planner_interval_s

    def peak_rss(self, timeout_s: float = 30.0) -> dict[str, dict[str, float]]:
        """Peak RSS per device worker and its engine hosts (QueryState, after the run)."""
        replies = self.devices.ask_each(QueryState(), self.clock, timeout_s)
        return {str(d): r.result["peak_rss_mb"] for d, r in replies.items()
                if r.ok and isinstance(r.result, dict) and "peak_rss_mb" in r.result}

    def shutdown(self, timeout_s: float = 60.0, orderly: bool = True) -> None:
        """Every worker gets Shutdown on every exit path (Devices.stop_all). After a stop
        signal a device still busy is no fault: it ends with the job's other ranks."""
        self.decider.close()
        try:
            left = self.devices.stop_all(Shutdown(), self.clock, timeout_s)
            if left:
                (log.warning if orderly else log.error)(
                    "devices %s did not answer Shutdown within %.0f s", left, timeout_s)
        except Exception:  # a dead worker must not hide the original error
            log.exception("shutdown broadcast failed")
