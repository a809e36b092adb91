"""The monitor (paper §7.1): the workload snapshot the policy decides on, and the
throughput constants A-D per role — from a `pivotrl profile` file when the config names one,
otherwise fitted online from the replicas' own step measurements (`sched.fit`) and refreshed
as samples accumulate (the paper profiles offline only).

An online sample is a replica's Step as the controller saw it — from sending the Step to
applying its reply — not the engine's own iteration time: the round trip through the worker
and the loop's turn are part of what a replica delivers, and on a device capped by a cgroup
quota the wait for the next quota period falls anywhere in that round trip. Steps are pooled
per replica into windows of `window_s` seconds, so that one sample spans several quota
periods instead of landing in one period's fast or throttled half."""
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
    refit_every: int = 48                # new samples before a refit, at least ...
    refit_growth: float = 0.25           # ... and this share of the samples held: a fit
    # costs O(samples), so refits spaced geometrically cost O(max_samples) in all, not
    # O(max_samples^2 / refit_every) (the simulator spent 40 % of its time refitting)
    max_samples: int = 4096
    max_error: float = 0.5               # a worse fit is traced but not used
    window_s: float = 0.3                # pooled Step seconds per sample (3 quota periods)
    _windows: dict[str, list[float]] = field(default_factory=dict)

    def observe_step(self, replica: str, n_seq: int, n_tok: int, iterations: int,
                     seconds: float) -> FitResult | None:
        """One Step of `iterations` engine iterations that started with `n_seq` sequences
        holding `n_tok` tokens and took `seconds` round trip, pooled into the replica's
        window; a full window (`window_s` seconds) becomes one sample: the mean latency of
        an iteration at the mean load (exact where the latency is linear in the load, i.e.
        on one side of the model's B/C breakpoint)."""
        if self.fixed or n_seq <= 0 or iterations <= 0 or seconds <= 0:
            return None
        w = self._windows.setdefault(replica, [0.0, 0.0, 0.0, 0.0])
        w[0] += iterations
        w[1] += iterations * n_seq
        w[2] += iterations * (n_tok + n_seq * (iterations - 1) / 2)   # at the middle one
        w[3] += seconds
        if w[3] < self.window_s:
            return None
        del self._windows[replica]
        return self.observe(round(w[1] / w[0]), round(w[2] / w[0]), w[3] / w[0])

    def refit_gap(self) -> int:
        """New samples the next refit waits for (none before the first fit)."""
        if self.last is None:
            return 0
        return max(self.refit_every, int(self.refit_growth * self.fitted_at))

    def observe(self, n_seq: int, n_tok: int, seconds: float) -> FitResult | None:
        """Record one decode step; refit when enough new samples came in. Returns the new
        fit, if one was made (the caller traces it)."""
        if self.fixed or n_seq <= 0 or seconds <= 0:
            return None
        self.samples.append(ThroughputSample(n_seq, n_tok, seconds))
        if len(self.samples) > self.max_samples:
            del self.samples[: len(self.samples) - self.max_samples]
        n = len(self.samples)
        if n < self.min_samples or n - self.fitted_at < self.refit_gap():
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
