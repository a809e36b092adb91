"""The executor's sending half: carry a plan's actions out on the devices and keep the
replica table, training state and τ_shift in step with the replies."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from pivotrl_hpc.controller.actions import (Action, ReplicaInfo, migration_actions,
                                            plan_actions)
from pivotrl_hpc.controller.flow import RoleFlow, check_replies
from pivotrl_hpc.controller.handles import Devices
from pivotrl_hpc.controller.policy import TauTracker
from pivotrl_hpc.plan.snapshot import TRAINING
from pivotrl_hpc.plan.types import ShiftPlan
from pivotrl_hpc.protocol.messages import (Abort, AddSequences, Reload, Reply, RoleKind, ShiftDown,
                                           ShiftUp)
from pivotrl_hpc.sched.migration import MigrationSpec
from pivotrl_hpc.sched.state import Replica

log = logging.getLogger(__name__)


@dataclass
class TrainingUnit:
    devices: tuple[int, ...]
    up: bool = False
    active: bool = False       # a TrainStep (or its Write wait) is in flight
    shifting: bool = False
    samples: int = 0           # samples of the TrainStep running now (the trace's `running`)


@dataclass
class ShiftBook:
    """Replicas that are up, shifts in flight, and the per-kind shift statistics."""
    replicas: dict[str, ReplicaInfo] = field(default_factory=dict)
    in_flight: int = 0
    count: dict[str, int] = field(default_factory=dict)      # "rollout->reward" etc.
    by_role: dict[str, list[float]] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)


class Executor:
    def __init__(self, devices: Devices, flows: dict[str, RoleFlow], training: TrainingUnit,
                 kv_capacity: dict[str, int], tau: TauTracker, trace, now: Callable[[], float],
                 on_change: Callable[[], None], migrate: MigrationSpec = True) -> None:
        self.devices, self.flows, self.training = devices, flows, training
        # False: a shift up only Dispatches the queue (ablations); True or a loop's name
        # ("paper", "least_loss"): Algorithm 4's migration by that loop
        self.migrate = migrate
        self.kv_capacity, self.tau, self.trace, self.now = kv_capacity, tau, trace, now
        self.on_change = on_change   # a shift finished: an event for the monitor
        self.published = 0           # policy version every node holds (the loop sets it)
        self.book = ShiftBook()
        self.device_role: dict[int, str] = {d: "idle" for d in devices.handles}
        self._last_role: dict[int, str] = dict(self.device_role)

    def execute(self, plan: ShiftPlan, plan_id: int) -> None:
        """Carry out `plan`, the planner row `plan_id` (its shifts rows name it)."""
        actions, _ = plan_actions(plan, self.book.replicas,
                                  {r: f.sched for r, f in self.flows.items()},
                                  self.training.devices)
        for a in actions:
            self.apply(a, plan_id)

    def apply(self, a: Action, plan_id: int | None) -> None:
        """Send one action (`plan_id` None: not part of a plan)."""
        if a.kind == "add":
            reqs = self.flows[a.role].place_ids(a.replica, a.seq_ids)
            self.devices.send(a.devices, AddSequences(tuple(reqs)), check_replies)
        elif a.kind == "abort":
            flow = self.flows[a.role]

            def aborted(replies: list[Reply]) -> None:
                check_replies(replies)
                flow.released(a.replica, a.seq_ids)
            self.devices.send(a.devices, Abort(tuple(str(s) for s in a.seq_ids)), aborted)
        elif a.kind == "shift_down":
            self._shift_down(a, plan_id)
        else:
            self._shift_up(a, plan_id)

    # --- shift down --------------------------------------------------------------------
    def _shift_down(self, a: Action, plan_id: int) -> None:
        self.book.in_flight += 1
        t0 = self.now()
        if a.role == TRAINING:
            self.training.shifting = True
        else:
            self.book.replicas.pop(a.replica)
            flow = self.flows[a.role]
            flow.versions.pop(a.replica, None)
            # The plan's Algorithm 3 re-queued this replica's sequences in the scheduler
            # already: their records resume from the queue now, so a Step reply of this
            # replica still in flight is stale (else it grows sequences of a replica the
            # scheduler no longer has: seen at TP=4/8 on the paper groups' simulation).
            flow.requeued(flow.placed_on(a.replica), a.replica)

        def done(replies: list[Reply]) -> None:
            check_replies(replies)
            if a.role == TRAINING:
                self.training.up = self.training.shifting = False
            else:   # the engine let every sequence leaving it go (the record kept them)
                self.flows[a.role].released(a.replica)
            for d in a.devices:   # a device already idle keeps the role it held last
                if self.device_role[d] != "idle":   # (as trace.recompute.shift_kinds counts)
                    self._last_role[d] = self.device_role[d]
                self.device_role[d] = "idle"
            self._record(plan_id, "down", a, replies, self.now() - t0)

        self.devices.send(a.devices, ShiftDown(), done)

    # --- shift up ----------------------------------------------------------------------
    def _shift_up(self, a: Action, plan_id: int) -> None:
        self.book.in_flight += 1
        t0 = self.now()
        if a.role == TRAINING:
            self.training.shifting = True
        kind = RoleKind(a.role)
        index = a.devices[0]

        def done(replies: list[Reply]) -> None:
            check_replies(replies)
            for d in a.devices:
                frm = self._last_role.get(d, "idle") if self.device_role[d] == "idle" else \
                    self.device_role[d]
                key = f"{frm}->{a.role}"
                self.book.count[key] = self.book.count.get(key, 0) + 1
                self.device_role[d] = a.role
            if a.role == TRAINING:
                self.training.up, self.training.shifting = True, False
                self._record(plan_id, "up", a, replies, self.now() - t0)
            else:
                self._replica_up(a, replies, lambda: self._record(
                    plan_id, "up", a, replies, self.now() - t0,
                    self.flows[a.role].versions.get(a.replica)))

        self.devices.send(a.devices, ShiftUp(kind, index), done)

    def _replica_up(self, a: Action, replies: list[Reply], record: Callable[[], None]) -> None:
        """The replica serves; `record` writes its shifts row (with the version it serves)
        before its first sequences land on it."""
        info = ReplicaInfo(a.role, a.devices)
        self.book.replicas[a.replica] = info
        flow = self.flows[a.role]
        if a.role == "rollout":
            v = flow.versions[a.replica] = min_version(replies)
            if v is not None and (v < self.published or split(replies)):
                # It Read GPS before a step was published and missed that step's Reload:
                # bring it up to date before any sequence lands on it, or a sample admitted
                # against the newer version would be generated by this older one (seen on
                # modeled and live runs: lag k + 1). A TP replica whose ranks Read on both
                # sides of a publish is brought to the newer one.
                self.reload(a.replica, max_version(replies))
        record()
        result = flow.sched.shift_up_migration([Replica(a.replica, self.kv_capacity[a.role])],
                                               self.migrate)
        for act in migration_actions(a.role, result, self.book.replicas):
            self.apply(act, -1)

    def reload(self, rid: str, at_least: int | None = None) -> None:
        """Refresh rollout replica `rid` in place to the published policy version or a newer
        one: a worker loads the current version, as the one named may be retired before it
        reads the Reload (a step published meanwhile, issue 47)."""
        devices = self.book.replicas[rid].devices
        wanted = max(self.published, at_least or 0)

        def done(replies: list[Reply]) -> None:
            check_replies(replies)
            version = min_version(replies)
            if rid not in self.flows["rollout"].versions:   # shifted down meanwhile
                return
            self.flows["rollout"].versions[rid] = version
            self.trace.append("reloads", t=self.now(), replica=rid,
                              devices=",".join(map(str, devices)), version=version,
                              seconds=sum(replies[0].phases.values()))
            if split(replies):   # its TP ranks read on both sides of a publish: align them
                log.info("replica %s loaded versions %s: reloading", rid,
                         [r.result["version"] for r in replies])
                self.reload(rid, max_version(replies))
        self.devices.send(devices, Reload(wanted), done)

    def _record(self, plan_id: int, direction: str, a: Action, replies: list[Reply],
                seconds: float, version: int | None = None) -> None:
        self.book.in_flight -= 1
        phases = dict(replies[0].phases)
        worker_s = phases.get("total", seconds)
        self.tau.observe(a.role, worker_s, phases)
        self.book.by_role.setdefault(f"{a.role}.{direction}", []).append(worker_s)
        agg = self.book.phases.setdefault(f"{a.role}.{direction}", {})
        for k, v in phases.items():
            agg[k] = agg.get(k, 0.0) + v
        self.trace.append("shifts", t=self.now(), plan_id=plan_id, direction=direction,
                          role=a.role, replica=a.replica,
                          devices=",".join(map(str, a.devices)), seconds=worker_s,
                          phases=phases, version=version)
        log.info("shift %s %s %s in %.2f s", direction, a.role, a.replica, worker_s)
        self.on_change()


def _versions(replies: list[Reply]) -> list[int]:
    return [v for r in replies if (v := (r.result or {}).get("version")) is not None]


def min_version(replies: list[Reply]) -> int | None:
    """The oldest policy version a replica's ranks loaded (what bounds its staleness)."""
    return min(_versions(replies), default=None)


def max_version(replies: list[Reply]) -> int | None:
    return max(_versions(replies), default=None)


def split(replies: list[Reply]) -> bool:
    """The ranks of one replica loaded different versions."""
    return len(set(_versions(replies))) > 1
