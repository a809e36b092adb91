"""Planner step 4 (§7.3): estimate a candidate's throughput by migration simulation.

Each role is replayed with the scheduler's own Algorithms 3 and 4: shift-down replicas abort
everything and the rest receive it; shift-up replicas take the queue and then pull
sequences while aggregate throughput rises. `RoleReplay` does it on a copy of the role's
Scheduler; `FastRole` (plan.simulate, the default) reaches the same floats for far less. The
shift-up result depends only on how many replicas come up (§7.2), so it is cached per
count; shift-down results are cached per set. Overall throughput is the weighted harmonic
mean of Eq. (1). Each replay also returns the tokens it moved between replicas: every one
is prefilled again where it lands, which `Estimate.migration_cost` charges at the role's
`prefill` seconds a token and its throughput per replica afterwards (issue 41).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from pivotrl_hpc.plan.simulate import FastRole
from pivotrl_hpc.plan.snapshot import (GEN_ROLES, REWARD, ROLLOUT, TRAINING_ID, ReplicaState,
                                       RolePool, WorkloadSnapshot)
from pivotrl_hpc.sched.migration import MigrationSpec
from pivotrl_hpc.sched.model import BinaryThroughputModel, ReplicaThroughput
from pivotrl_hpc.sched.scheduler import Scheduler
from pivotrl_hpc.sched.state import Replica, Sequence, WaitingQueue


def harmonic_throughput(loads: Iterable[tuple[int, float]]) -> float:
    """Eq. (1): (Σ N_r) / (Σ N_r / T_r) over roles with work; 0 if a busy role is stalled."""
    n_total, time_total = 0, 0.0
    for n, t in loads:
        if n <= 0:
            continue
        if t <= 0.0:
            return 0.0
        n_total += n
        time_total += n / t
    return n_total / time_total if n_total else 0.0


def role_models(snap: WorkloadSnapshot, binary: bool = False
                ) -> Callable[[str], ReplicaThroughput]:
    """Each role's throughput model: the snapshot's, or T in {0, 1} (vanilla planner)."""
    if binary:
        model = BinaryThroughputModel()
        return lambda role: model
    return lambda role: snap.roles[role].model


@dataclass(frozen=True)
class Estimate:
    rollout: float
    reward: float
    overall: float
    # tokens the migrated sequences' re-prefill costs: each moved token stalls a replica of
    # its role for prefill_s_per_token seconds, at that role's mean throughput per replica
    migration_cost: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"rollout": self.rollout, "reward": self.reward, "overall": self.overall,
                "migration_cost": self.migration_cost}


class RoleReplay:
    """The straightforward simulation of one role: copy its Scheduler and run Algorithm 3
    or 4 on the copy. `FastRole` (plan.simulate) must agree with it bitwise."""

    def __init__(self, model: ReplicaThroughput, replicas: list[ReplicaState],
                 pool: RolePool) -> None:
        waiting = WaitingQueue()
        waiting.extend(Sequence(s.seq_id, s.prompt_tokens, s.generated_tokens)
                       for s in pool.queue)
        reps = [Replica(r.replica_id, r.kv_capacity,
                        [Sequence(s.seq_id, s.prompt_tokens, s.generated_tokens)
                         for s in r.sequences]) for r in replicas]
        self.base = Scheduler(model, reps, waiting, record_moves=False)
        self.pool = pool
        self.now = self.base.aggregate_throughput()

    def shift_up(self, count: int, migrate: MigrationSpec = True) -> tuple[float, int]:
        sched = self.base.copy()
        new = [Replica(f"{self.pool.role}+{i}", self.pool.kv_capacity) for i in range(count)]
        result = sched.shift_up_migration(new, migrate=migrate)
        return result.throughput_after, result.moved_tokens

    def shift_down(self, down: Iterable[str]) -> tuple[float, int]:
        sched = self.base.copy()
        ids = set(down)
        result = sched.shift_down_migration([r for r in sched.replicas if r in ids])
        return result.throughput_after, result.moved_tokens


class MigrationSimulator:
    """Replays shift-time migration for candidate plans on one snapshot.

    `replay=True` uses the straightforward `RoleReplay`, the reference `FastRole` is
    tested against."""

    def __init__(self, snap: WorkloadSnapshot,
                 model_of: Callable[[str], ReplicaThroughput], migrate: MigrationSpec = True,
                 replay: bool = False, prefill: Mapping[str, float] | None = None) -> None:
        self.snap = snap
        self.migrate = migrate
        self.prefill = dict(prefill or {})   # role -> seconds a replica prefills a token
        self.n_replicas = {role: len(snap.role_replicas(role)) for role in GEN_ROLES}
        kind = RoleReplay if replay else FastRole
        self.roles = {role: kind(model_of(role), snap.role_replicas(role), snap.roles[role])
                      for role in GEN_ROLES}
        self.counts = {role: snap.role_sequences(role) for role in GEN_ROLES}
        self.role_of = {r.replica_id: r.role for r in snap.replicas}
        self._now = {role: sim.now for role, sim in self.roles.items()}
        self._up: dict[tuple[str, int], tuple[float, int]] = {}
        self._down: dict[tuple[str, frozenset[str]], tuple[float, int]] = {}
        self.simulations = 0

    def __getstate__(self) -> dict:
        """What plan.parallel ships to a worker: the replay state, without the snapshot
        (not needed once the roles are built) and without cached results."""
        return self.__dict__ | {"snap": None, "_up": {}, "_down": {}, "simulations": 0}

    def current(self) -> Estimate:
        return self._estimate(self._now)

    def _estimate(self, thr: Mapping[str, float], cost: float = 0.0) -> Estimate:
        overall = harmonic_throughput((self.counts[r], thr[r]) for r in GEN_ROLES)
        return Estimate(thr[ROLLOUT], thr[REWARD], overall, cost)

    def shift_up_throughput(self, role: str, count: int) -> tuple[float, int]:
        """The role's aggregate throughput after `count` replicas shift up, and the tokens
        its migration moved."""
        key = (role, count)
        if key not in self._up:
            self._up[key] = self.roles[role].shift_up(count, self.migrate)
            self.simulations += 1
        return self._up[key]

    def shift_down_throughput(self, role: str, down: frozenset[str]) -> tuple[float, int]:
        key = (role, down)
        if key not in self._down:
            self._down[key] = self.roles[role].shift_down(down)
            self.simulations += 1
        return self._down[key]

    def _down_by_role(self, shift_down: Iterable[str]) -> dict[str, set[str]]:
        by_role: dict[str, set[str]] = {}
        for rid in shift_down:
            if rid != TRAINING_ID:
                by_role.setdefault(self.role_of[rid], set()).add(rid)
        return by_role

    def estimate(self, up_role: str, up_count: int, shift_down: Iterable[str]) -> Estimate:
        """Rollout, reward and Eq. (1) throughput after the candidate's shifts, and what its
        migrations' re-prefill costs."""
        thr = dict(self._now)
        moved = dict.fromkeys(GEN_ROLES, 0)
        replicas = dict(self.n_replicas)
        for role, ids in self._down_by_role(shift_down).items():
            thr[role], moved[role] = self.shift_down_throughput(role, frozenset(ids))
            replicas[role] -= len(ids)
        if up_role in GEN_ROLES and up_count:
            thr[up_role], tokens = self.shift_up_throughput(up_role, up_count)
            moved[up_role] += tokens
            replicas[up_role] += up_count
        cost = sum(self.prefill.get(r, 0.0) * moved[r] * thr[r] / replicas[r]
                   for r in GEN_ROLES if moved[r] and replicas[r] > 0)
        return self._estimate(thr, cost)


def benefit(horizon_s: float, current: float, candidate: float, penalty: float) -> float:
    """B = H·(T_candidate − T_current) − φ."""
    if math.isinf(penalty):
        return -math.inf
    return horizon_s * (candidate - current) - penalty
