"""Resource-shifting planner (paper §7, appendix D) and allocation policies (§8): pure logic."""
from pivotrl_hpc.plan import parallel
from pivotrl_hpc.plan.dp import Candidate, construct_candidates
from pivotrl_hpc.plan.evaluate import Estimate, MigrationSimulator, harmonic_throughput
from pivotrl_hpc.plan.pairs import ShiftPair, prepare_shift_pairs, select_shift_up_role
from pivotrl_hpc.plan.planner import CandidateEval, PivotPlanner, PlannerParams, PlanReport
from pivotrl_hpc.plan.policies import (POLICIES, ColocatedPolicy, DisaggregatedPolicy,
                                       RRColocatedPolicy, RRColocatedPooledPolicy,
                                       RuleBasedPolicy, StaticPolicy,
                                       VanillaPlanner, VanillaTMPlanner, make_policy)
from pivotrl_hpc.plan.snapshot import (GEN_ROLES, REWARD, ROLLOUT, TRAINING, TRAINING_ID,
                                       ReplicaState, RolePool, SeqState, SnapshotError,
                                       TrainingState, WorkloadSnapshot)
from pivotrl_hpc.plan.synthetic import synthetic_snapshot
from pivotrl_hpc.plan.types import AllocationPolicy, ReplicaSpec, ShiftPlan

__all__ = [
    "AllocationPolicy", "Candidate", "CandidateEval", "ColocatedPolicy", "DisaggregatedPolicy",
    "Estimate", "GEN_ROLES", "MigrationSimulator", "POLICIES", "PivotPlanner", "PlanReport",
    "PlannerParams", "REWARD", "ROLLOUT", "RRColocatedPolicy",
    "RRColocatedPooledPolicy", "ReplicaSpec", "ReplicaState",
    "RolePool", "RuleBasedPolicy", "SeqState", "ShiftPair", "ShiftPlan", "SnapshotError",
    "StaticPolicy", "TRAINING", "TRAINING_ID", "TrainingState", "VanillaPlanner",
    "VanillaTMPlanner", "WorkloadSnapshot", "construct_candidates", "harmonic_throughput",
    "make_policy", "parallel", "prepare_shift_pairs", "select_shift_up_role", "synthetic_snapshot",
]
