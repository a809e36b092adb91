"""The five-step planner of §7.1 (`PivotPlanner`, paradigm "shiftable").

1. shift-up role: training if its next batch is ready, else the larger τ_Role;
2. shift pairs with penalty φ = Σ τ_shift · T_i, ascending;
3. candidate set by the DP of Algorithm 1 (one per shift-up count k);
4. each candidate's throughput by migration simulation, Eq. (1), B = H·ΔT − φ − the tokens
   its migrated sequences' re-prefill costs (`prefill_s_per_token`, plan.evaluate);
5. the best positive candidate, or no shift.

Training shifts up as a whole, so it has one candidate, taken whatever its benefit: the
shift is needed for the RL step to progress (§8.3). τ_Role and φ use each replica's measured
throughput when the snapshot has it; current and candidate throughput both come from the
model, so model bias cancels in the benefit. `explain` returns every step's result for
`pivotrl plan`; `decide` is the AllocationPolicy entry point. Pure and deterministic.

Cost: steps 1-3 are O(I + K·I); step 4 replays one migration per candidate, so a decision
is O(K · N^Seq) Dispatch placements (each O(buckets · log I), see sched.index): quadratic in
cluster size when K and N^Seq both grow with it (`pivotrl bench planner`). The replay works
on plain counts (plan.simulate) rather than Scheduler copies; it cannot be warm-started from
candidate k to k+1 exactly, because the replicas a larger candidate also shifts down are the
least loaded, so Dispatch fills them from its first placements on. Candidates are
independent, though, so with an `executor` step 4 runs in parallel chunks (plan.parallel),
bitwise as sequentially; below `min_parallel_work` it stays sequential.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pivotrl_hpc.plan import parallel
from pivotrl_hpc.plan.dp import Candidate, construct_candidates
from pivotrl_hpc.plan.evaluate import Estimate, benefit, role_models
from pivotrl_hpc.plan.pairs import (RoleChoice, ShiftPair, ThroughputOf, prepare_shift_pairs,
                                    select_shift_up_role, training_pair)
from pivotrl_hpc.plan.snapshot import TRAINING, WorkloadSnapshot
from pivotrl_hpc.plan.types import ReplicaSpec, ShiftPlan
from pivotrl_hpc.sched.migration import MigrationSpec, resolve


def _default_tau_shift() -> dict[str, float]:
    return {"rollout": 2.0, "reward": 3.0, "training": 6.0}


@dataclass
class PlannerParams:
    horizon_s: float = 60.0                       # H: how long a gain is expected to last
    tau_shift: dict[str, float] = field(default_factory=_default_tau_shift)  # s stalled
    # the shift-up migration loop simulated and run: True the default (sched.migration),
    # "paper" Algorithm 4 as stated, "least_loss", or False none (vanilla ablations)
    migrate: MigrationSpec = True
    # seconds a replica of the role spends prefilling one token: a migrated sequence's
    # prompt + generated tokens are prefilled again where it lands (plan.evaluate charges
    # it to the candidate); a role left out costs nothing
    prefill_s_per_token: dict[str, float] = field(default_factory=dict)
    binary_throughput: bool = False               # vanilla: T_i in {0, 1}

    def __post_init__(self) -> None:
        if self.horizon_s < 0:
            raise ValueError(f"horizon_s must be >= 0, got {self.horizon_s}")
        missing = {"rollout", "reward", "training"} - set(self.tau_shift)
        if missing or any(v < 0 for v in self.tau_shift.values()):
            raise ValueError(f"tau_shift needs non-negative seconds for rollout, reward and "
                             f"training; got {self.tau_shift}")
        resolve(self.migrate)   # an unknown loop's name fails here, before any decision


@dataclass(frozen=True)
class CandidateEval:
    candidate: Candidate
    up: tuple[ReplicaSpec, ...]
    shift_down: tuple[str, ...]
    estimate: Estimate
    benefit: float

    def to_dict(self) -> dict[str, Any]:
        return {"shift_up_count": self.candidate.shift_up_count, "penalty": self.candidate.penalty,
                "pairs": [list(p) for p in self.candidate.picks],
                "shift_down": list(self.shift_down), "shift_up": [s.to_dict() for s in self.up],
                "est_throughput": self.estimate.to_dict(), "benefit": self.benefit}


@dataclass(frozen=True)
class PlanReport:
    policy: str
    choice: RoleChoice
    current: Estimate
    pairs: tuple[ShiftPair, ...]
    candidates: tuple[CandidateEval, ...]
    plan: ShiftPlan | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy,
                "shift_up_role": {"role": self.choice.role, "reason": self.choice.reason,
                                  # null: work waiting but no throughput (τ unbounded)
                                  "tau": {r: None if math.isinf(t) else t
                                          for r, t in self.choice.taus.items()}},
                "current_throughput": self.current.to_dict(),
                "shift_pairs": [p.to_dict() for p in self.pairs],
                "candidates": [c.to_dict() for c in self.candidates],
                "plan": None if self.plan is None else self.plan.to_dict(),
                "reason": self.reason}


class PivotPlanner:
    name = "shiftable"
    replay = False  # True: step 4 by plain Scheduler replay (the reference; same result)

    def __init__(self, params: PlannerParams | None = None, executor: Any = None,
                 chunks: int = 4, min_parallel_work: int = parallel.PARALLEL_MIN_WORK
                 ) -> None:
        """`executor`: optional `map(fn, items)` provider (e.g. a ProcessPoolExecutor) for
        step 4, in `chunks` chunks (best: its worker count); None runs it sequentially."""
        self.params = params or PlannerParams()
        self.executor = executor
        self.chunks = max(1, chunks)
        self.min_parallel_work = min_parallel_work

    # -- the steps, public so the benchmark can time them --------------------------------
    def model_of(self, snap: WorkloadSnapshot):
        return role_models(snap, self.params.binary_throughput)

    def throughput_of(self, snap: WorkloadSnapshot) -> ThroughputOf:
        if self.params.binary_throughput:
            return lambda r: 1.0 if r.sequences else 0.0
        return snap.replica_throughput

    def prepare(self, snap: WorkloadSnapshot) -> tuple[RoleChoice, list[ShiftPair]]:
        """Steps 1 and 2."""
        thr = self.throughput_of(snap)
        choice = select_shift_up_role(snap, thr)
        if choice.role == TRAINING:
            return choice, [training_pair(snap, self.params.tau_shift, thr)]
        return choice, prepare_shift_pairs(snap, choice.role, self.params.tau_shift, thr)

    def construct(self, pairs: list[ShiftPair]) -> list[Candidate]:
        """Step 3: Algorithm 1."""
        return construct_candidates([p.size for p in pairs], [p.penalty for p in pairs])

    def evaluate(self, snap: WorkloadSnapshot, role: str, pairs: list[ShiftPair],
                 candidates: list[Candidate]) -> tuple[Estimate, list[CandidateEval]]:
        """Step 4: migration simulation and B = H·(T_cand − T_cur) − φ."""
        shifts = [_materialise(role, pairs, cand) for cand in candidates]
        counts = [0 if role == TRAINING else cand.shift_up_count for cand in candidates]
        jobs = [(count, down) for count, (_, down) in zip(counts, shifts)]
        config = (self.params.migrate, self.params.binary_throughput, self.replay,
                  tuple(sorted(self.params.prefill_s_per_token.items())))
        if self.use_parallel(snap, len(candidates)):
            current, ests = parallel.estimate_all(self.executor, snap, config, role, jobs,
                                                  self.chunks)
        else:
            sim = parallel.simulator(snap, config)
            current = sim.current()
            ests = [sim.estimate(role, count, down) for count, down in jobs]
        return current, [CandidateEval(cand, up, down, est,
                                       benefit(self.params.horizon_s, current.overall,
                                               est.overall,
                                               cand.penalty + est.migration_cost))
                         for cand, (up, down), est in zip(candidates, shifts, ests)]

    def use_parallel(self, snap: WorkloadSnapshot, n_candidates: int) -> bool:
        """Parallel only when it pays: an executor, 2+ candidates and K·N^Seq large enough
        that process hand-offs are small next to the simulations."""
        if self.executor is None or self.chunks < 2 or n_candidates < 2:
            return False
        work = n_candidates * (sum(len(r.sequences) for r in snap.replicas)
                               + sum(len(p.queue) for p in snap.roles.values()))
        return work >= self.min_parallel_work

    # -- the whole procedure -------------------------------------------------------------
    def explain(self, snap: WorkloadSnapshot) -> PlanReport:
        choice, pairs = self.prepare(snap)
        candidates = self.construct(pairs)
        current, evals = self.evaluate(snap, choice.role, pairs, candidates)
        plan, reason = self._select(choice, evals)
        return PlanReport(self.name, choice, current, tuple(pairs), tuple(evals), plan, reason)

    def decide(self, snap: WorkloadSnapshot) -> ShiftPlan | None:
        return self.explain(snap).plan

    def _select(self, choice: RoleChoice, evals: list[CandidateEval]
                ) -> tuple[ShiftPlan | None, str]:
        """Step 5: the largest positive benefit (ties: fewer replicas); training is forced."""
        if not evals:
            return None, f"no eligible {choice.role} replica to shift up"
        if choice.role == TRAINING:
            best, why = evals[0], "next training batch is ready: shift training up"
        else:
            best = max(evals, key=lambda e: (e.benefit, -e.candidate.shift_up_count))
            if not best.benefit > 0.0:
                return None, f"no candidate has a positive benefit (best {best.benefit:.1f})"
            why = (f"shift up {best.candidate.shift_up_count} {choice.role} replica(s): "
                   f"benefit {best.benefit:.1f}")
        plan = ShiftPlan(best.shift_down, best.up, why, best.candidate.penalty,
                         best.estimate.overall, best.benefit)
        return plan, why


def _materialise(role: str, pairs: list[ShiftPair], cand: Candidate
                 ) -> tuple[tuple[ReplicaSpec, ...], tuple[str, ...]]:
    """The replicas a candidate shifts up and down: first e slots of each picked pair."""
    up: list[ReplicaSpec] = []
    down: list[str] = []
    for i, e in cand.picks:
        up.extend(ReplicaSpec(role, slot) for slot in pairs[i].up_slots[:e])
        down.extend(pairs[i].shift_down)
    return tuple(up), tuple(down)

