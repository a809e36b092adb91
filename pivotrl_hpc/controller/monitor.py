"""The monitor (paper §7.1): the workload snapshot the policy decides on, and the
throughput constants A-D per role — from a `pivotrl profile` file when the config names one,
otherwise fitted online from the replicas' own step measurements (`sched.fit`) and refreshed
as samples accumulate (the paper profiles offline only)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from pivotrl_hpc.plan.snapshot import (GEN_ROLES, ReplicaState, RolePool, SeqState,
                                       TrainingState, WorkloadSnapshot)
from pivotrl_hpc.sched.fit import FitResult, ThroughputSample, fit_throughput_model
from pivotrl_hpc.sched.model import ThroughputModel
from pivotrl_hpc.sched.scheduler import Scheduler


@dataclass
class RoleModel:
    """A role's throughput model and the samples it is fitted from."""
    model: ThroughputModel
    fixed: bool                          # from a profile: never refitted
    samples: list[ThroughputSample] = field(default_factory=list)
    fitted_at: int = 0                   # sample count at the last fit
    last: FitResult | None = None
    min_samples: int = 24
    refit_every: int = 48
    max_samples: int = 4096
    max_error: float = 0.5               # a worse fit is traced but not used

    def observe(self, n_seq: int, n_tok: int, seconds: float) -> FitResult | None:
        """Record one decode step; refit when enough new samples came in. Returns the new
        fit, if one was made (the caller traces it)."""
        if self.fixed or n_seq <= 0 or seconds <= 0:
            return None
        self.samples.append(ThroughputSample(n_seq, n_tok, seconds))
        if len(self.samples) > self.max_samples:
            del self.samples[: len(self.samples) - self.max_samples]
        n = len(self.samples)
        if n < self.min_samples or n - self.fitted_at < (self.refit_every if self.last else 0):
            return None
        distinct = {s.n_seq for s in self.samples}
        if len(distinct) < 3:  # B and C cannot be told apart yet
            return None
        try:
            fit = fit_throughput_model(self.samples)
        except ValueError:
            return None
        self.last, self.fitted_at = fit, n
        if fit.rel_rms_error <= self.max_error:
            self.model = fit.model
        return fit


@dataclass(frozen=True)
class TrainingView:
    devices: tuple[int, ...]
    up: bool
    active: bool
    next_batch_ready: bool


def snapshot(gpus: int, replica_gpus: Mapping[str, int], kv_capacity: Mapping[str, int],
             models: Mapping[str, RoleModel], schedulers: Mapping[str, Scheduler],
             devices_of: Mapping[str, tuple[int, ...]], training: TrainingView,
             now: float) -> WorkloadSnapshot:
    """The workload snapshot (docs/snapshot.md) from the live schedulers."""
    roles = {role: RolePool(role, replica_gpus[role], kv_capacity[role], models[role].model,
                            tuple(SeqState(s.seq_id, s.prompt_tokens, s.generated_tokens)
                                  for s in schedulers[role].queue))
             for role in GEN_ROLES}
    replicas = tuple(
        ReplicaState(rid, role, devices_of[rid], r.capacity,
                     tuple(SeqState(s.seq_id, s.prompt_tokens, s.generated_tokens)
                           for s in r.seqs.values()))
        for role in GEN_ROLES for rid, r in schedulers[role].replicas.items())
    return WorkloadSnapshot(gpus, roles, replicas,
                            TrainingState(training.devices, training.up, training.active,
                                          training.next_batch_ready), now)
