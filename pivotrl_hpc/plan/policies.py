"""Allocation policies: the paradigms and ablations of §8 behind one `decide(snapshot)`.

- `shiftable` (PivotPlanner): PivotRL's five-step planner (§7).
- `vanilla` (VanillaPlanner): §8.4 components: the planner with T_i in {0, 1}, no migration.
- `static` (StaticPolicy): §8.4: idle training GPUs split evenly between rollout and reward.
- `rule_based` (RuleBasedPolicy): §8.4: KV utilisation > 0.8 shifts up, < 0.1 shifts down.
- `colocated` (ColocatedPolicy): §8.2 colocated (veRL): all devices to one stage at a time.
- `disaggregated` (DisaggregatedPolicy): §8.2 disaggregated: a fixed split, never changed.
- `rr_colocated` (RRColocatedPolicy): §8.2, Appendix E: rollout and reward alternate on one
  pool a batch at a time (roll out a batch, judge it, the next), training on its own pool.
- `rr_colocated_pooled` (RRColocatedPooledPolicy): a stronger variant, not the paper's: the
  pool turns only when one role runs out, so it rolls out every admitted batch first.

Fixed policies return the plan that reaches their allocation from the snapshot (so they
also bootstrap an empty cluster) and None once it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pivotrl_hpc.plan.pairs import prepare_shift_pairs, training_pair
from pivotrl_hpc.plan.planner import PivotPlanner, PlannerParams
from pivotrl_hpc.plan.snapshot import (GEN_ROLES, REWARD, ROLLOUT, TRAINING, TRAINING_ID,
                                       WorkloadSnapshot)
from pivotrl_hpc.plan.types import AllocationPolicy, ReplicaSpec, ShiftPlan

Target = dict[str, list[tuple[int, ...]]]  # role -> device tuples of its replicas


def training_up_plan(snap: WorkloadSnapshot, reason: str) -> ShiftPlan:
    """Shift down whatever holds the training devices, shift training up as a whole."""
    pair = training_pair(snap, {r: 0.0 for r in (*GEN_ROLES, TRAINING)}, lambda r: 0.0)
    return ShiftPlan(pair.shift_down, (ReplicaSpec(TRAINING, tuple(snap.training.devices)),),
                     reason)


def allocation_plan(snap: WorkloadSnapshot, target: Target, training_up: bool,
                    reason: str) -> ShiftPlan | None:
    """The shifts that turn the snapshot's allocation into `target` (None: already there)."""
    wanted = {(role, devs) for role, slots in target.items() for devs in slots}
    have = {(r.role, r.devices): r.replica_id for r in snap.replicas}
    down = [rid for key, rid in have.items() if key not in wanted]
    up = [ReplicaSpec(role, devs) for role, devs in sorted(wanted - set(have),
                                                           key=lambda k: (k[1], k[0]))]
    tr = snap.training
    if tr.up and not training_up:
        if tr.active:
            return None  # never interrupt a running training step
        down.append(TRAINING_ID)
    if training_up and not tr.up:
        up.append(ReplicaSpec(TRAINING, tuple(tr.devices)))
    if not down and not up:
        return None
    return ShiftPlan(tuple(down), tuple(up), reason)


def _slots_within(snap: WorkloadSnapshot, role: str, devices: set[int]) -> list[tuple[int, ...]]:
    return [s for s in snap.roles[role].slots(snap.gpus) if set(s) <= devices]


def _non_training(snap: WorkloadSnapshot) -> list[int]:
    training = set(snap.training.devices)
    return [d for d in range(snap.gpus) if d not in training]


class VanillaPlanner(PivotPlanner):
    """The planner without throughput model (T_i = 1 if a replica runs anything, else 0)
    and without shift-up migration (Figure 11, "Vanilla")."""

    name = "vanilla"
    binary_throughput = True

    def __init__(self, params: PlannerParams | None = None, **parallel: Any) -> None:
        p = params or PlannerParams()
        super().__init__(PlannerParams(p.horizon_s, dict(p.tau_shift), migrate=False,
                                       binary_throughput=self.binary_throughput), **parallel)


class VanillaTMPlanner(VanillaPlanner):
    """The planner with the throughput model but without shift-up migration (Figure 11,
    "Vanilla + Throughput Model"): between vanilla and the full planner."""

    name = "vanilla_tm"
    binary_throughput = False


@dataclass
class StaticPolicy:
    name = "static"

    def decide(self, snap: WorkloadSnapshot) -> ShiftPlan | None:
        tr = snap.training
        if tr.next_batch_ready:
            return None if tr.up else training_up_plan(snap, "next training batch is ready")
        if not tr.up or tr.active:
            return None
        devices = sorted(tr.devices)
        half = len(devices) // 2
        target = {ROLLOUT: _slots_within(snap, ROLLOUT, set(devices[:half])),
                  REWARD: _slots_within(snap, REWARD, set(devices[half:]))}
        return ShiftPlan((TRAINING_ID,), tuple(ReplicaSpec(role, s) for role in GEN_ROLES
                                               for s in target[role]),
                         "training idle: split its GPUs evenly between rollout and reward")


@dataclass
class RuleBasedPolicy:
    high: float = 0.8
    low: float = 0.1
    name = "rule_based"

    def utilisation(self, snap: WorkloadSnapshot, role: str) -> float:
        reps = snap.role_replicas(role)
        cap = sum(r.kv_capacity for r in reps)
        if cap == 0:
            return 1.0 if snap.roles[role].queue else 0.0
        return sum(r.n_tok for r in reps) / cap

    def decide(self, snap: WorkloadSnapshot) -> ShiftPlan | None:
        tr = snap.training
        if tr.next_batch_ready and not tr.up:
            return training_up_plan(snap, "next training batch is ready")
        util = {role: self.utilisation(snap, role) for role in GEN_ROLES}
        for role in sorted(GEN_ROLES, key=lambda r: -util[r]):
            if util[role] > self.high:
                plan = self._grow(snap, role, util)
                if plan is not None:
                    return plan
        for role in GEN_ROLES:
            reps = snap.role_replicas(role)
            if util[role] < self.low and len(reps) > 1:
                victim = min(reps, key=lambda r: (r.n_tok, r.replica_id))
                return ShiftPlan((victim.replica_id,), (),
                                 f"{role} KV utilisation {util[role]:.2f} < {self.low}")
        return None

    def _grow(self, snap: WorkloadSnapshot, role: str, util: dict[str, float]
              ) -> ShiftPlan | None:
        """One more replica of `role`, taken from free GPUs, idle training or a donor role
        whose utilisation is below the low mark (cheapest pair first)."""
        role_of = {r.replica_id: r.role for r in snap.replicas}
        tau = {r: 1.0 for r in (*GEN_ROLES, TRAINING)}
        for pair in prepare_shift_pairs(snap, role, tau, snap.replica_throughput):
            donors = {role_of.get(h, TRAINING) for h in pair.shift_down}
            if all(d == TRAINING or util[d] < self.low for d in donors):
                return ShiftPlan(pair.shift_down, (ReplicaSpec(role, pair.up_slots[0]),),
                                 f"{role} KV utilisation {util[role]:.2f} > {self.high}")
        return None


@dataclass
class ColocatedPolicy:
    """Every device serves one stage at a time: rollout, then reward, then training."""

    name = "colocated"

    def decide(self, snap: WorkloadSnapshot) -> ShiftPlan | None:
        tr = snap.training
        if tr.active:
            return None
        if tr.next_batch_ready:
            stage = TRAINING
        elif snap.role_sequences(ROLLOUT):
            stage = ROLLOUT
        elif snap.role_sequences(REWARD):
            stage = REWARD
        else:
            return None
        if stage == TRAINING:
            if len(tr.devices) != snap.gpus:
                raise ValueError("colocated training must span every GPU")
            return allocation_plan(snap, {}, True, "stage boundary: training")
        target = {stage: snap.roles[stage].slots(snap.gpus)}
        return allocation_plan(snap, target, False, f"stage boundary: {stage}")


@dataclass
class DisaggregatedPolicy:
    """Fixed pools: rollout on the first `rollout_gpus` non-training GPUs, reward on the
    next `reward_gpus`, training always up on its own devices."""

    rollout_gpus: int
    reward_gpus: int
    name = "disaggregated"

    def decide(self, snap: WorkloadSnapshot) -> ShiftPlan | None:
        pool = _non_training(snap)
        if self.rollout_gpus + self.reward_gpus > len(pool):
            raise ValueError(f"disaggregated split {self.rollout_gpus}+{self.reward_gpus} "
                             f"exceeds the {len(pool)} non-training GPUs")
        target = {ROLLOUT: _slots_within(snap, ROLLOUT, set(pool[:self.rollout_gpus])),
                  REWARD: _slots_within(snap, REWARD, set(pool[self.rollout_gpus:
                                                               self.rollout_gpus
                                                               + self.reward_gpus]))}
        return allocation_plan(snap, target, True, "fixed disaggregated allocation")


@dataclass
class RRColocatedPolicy:
    """Rollout and reward alternate on the non-training pool; training keeps its own.

    Appendix E: "Once rollout completes sampling a batch, reward evaluation is launched on
    the same resources ... and the cycle repeats", staleness letting later batches go on
    while training runs. The allocation below turns the pool when the role it serves runs
    out; `per_batch` asks the controller to admit a batch only once every sample before it
    is judged (`RLBook.admit`), so that the pool serves one batch at a time. A decision
    sees no batches (the snapshot holds sequences), hence the flag."""

    name = "rr_colocated"
    per_batch = True

    def decide(self, snap: WorkloadSnapshot) -> ShiftPlan | None:
        pool = set(_non_training(snap))
        holders = [r.role for r in snap.replicas if set(r.devices) <= pool]
        current = holders[0] if holders else ROLLOUT
        other = REWARD if current == ROLLOUT else ROLLOUT
        stage = current if snap.role_sequences(current) or not snap.role_sequences(other) \
            else other
        target = {stage: _slots_within(snap, stage, pool)}
        return allocation_plan(snap, target, True, f"rollout-reward pool serves {stage}")


@dataclass
class RRColocatedPooledPolicy(RRColocatedPolicy):
    """The same allocation with admission bounded by staleness alone: with staleness k the
    pool rolls out up to k + 1 batches before it judges any, paying one pair of tails (the
    last rollouts, the last judgements) per k + 1 batches instead of per batch. Kept as a
    named, stronger baseline beside the paper's (issue 49)."""

    name = "rr_colocated_pooled"
    per_batch = False


# the planner and its two ablations, by paradigm name
_PLANNER_CLASSES = {"shiftable": PivotPlanner, "vanilla": VanillaPlanner,
                    "vanilla_tm": VanillaTMPlanner}
PLANNERS = tuple(_PLANNER_CLASSES)
POLICIES = ("colocated", "disaggregated", "rr_colocated", "rr_colocated_pooled", "shiftable",
            "static", "rule_based", "vanilla", "vanilla_tm")


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> AllocationPolicy:
    """Build a policy from the config's paradigm name and its plain parameters."""
    p = dict(params or {})
    planner_keys = {"horizon_s", "tau_shift", "migrate", "prefill_s_per_token"}
    if name in PLANNERS:
        unknown = set(p) - planner_keys
        if unknown:
            raise ValueError(f"policy {name}: unknown parameters {sorted(unknown)}")
        return _PLANNER_CLASSES[name](PlannerParams(**p))
    factories = {"static": StaticPolicy, "rule_based": RuleBasedPolicy,
                 "colocated": ColocatedPolicy, "disaggregated": DisaggregatedPolicy,
                 "rr_colocated": RRColocatedPolicy,
                 "rr_colocated_pooled": RRColocatedPooledPolicy}
    if name not in factories:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    try:
        return factories[name](**p)
    except TypeError as exc:
        raise ValueError(f"policy {name}: {exc}") from None
