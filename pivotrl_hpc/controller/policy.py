"""The config's `paradigm` section -> an allocation policy, and τ_shift measured online.

One function maps all seven names (`plan.make_policy` takes plain parameters). The planner's
τ_shift starts from the config's `shift_seconds_*` (the one source of truth: the planner's
own defaults are only for tools without a config) and then follows the running mean of the
shift seconds the workers report, per role (`TauTracker`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pivotrl_hpc.plan.policies import PLANNERS, make_policy
from pivotrl_hpc.plan.types import AllocationPolicy
from pivotrl_hpc.protocol.context import BUILD_PHASES

if TYPE_CHECKING:  # the config package loads YAML: keep the loop importable without it
    from pivotrl_hpc.config.schema import Config

ROLES = ("rollout", "reward", "training")


def initial_tau(cfg: Config) -> dict[str, float]:
    p = cfg.paradigm
    return {"rollout": p.shift_seconds_rollout, "reward": p.shift_seconds_reward,
            "training": p.shift_seconds_training}


def policy_params(cfg: Config) -> dict[str, Any]:
    """The plain parameters `plan.make_policy` takes for the configured paradigm."""
    p = cfg.paradigm
    if p.name in PLANNERS:
        t = cfg.throughput
        return {"horizon_s": p.horizon_s, "tau_shift": initial_tau(cfg),
                "migrate": p.migration,
                "prefill_s_per_token": {"rollout": t.prefill_s_per_token_policy,
                                        "reward": t.prefill_s_per_token_genrm}}
    if p.name == "rule_based":
        return {"high": p.rule_high_kv, "low": p.rule_low_kv}
    if p.name == "disaggregated":
        rollout, reward = split_of(cfg)
        return {"rollout_gpus": rollout, "reward_gpus": reward}
    return {}


def split_of(cfg: Config) -> tuple[int, int]:
    """Disaggregated split: the configured one, else every non-training device, rollout
    taking the larger half (aligned to the replica sizes)."""
    p, r = cfg.paradigm, cfg.roles
    if p.initial_rollout_devices or p.initial_reward_devices:
        return p.initial_rollout_devices, p.initial_reward_devices
    pool = cfg.total_devices - r.train_devices
    reward = max(r.reward_replica_size, (pool // 2) // r.reward_replica_size
                 * r.reward_replica_size)
    return pool - reward, reward


def make_paradigm_policy(cfg: Config) -> AllocationPolicy:
    return make_policy(cfg.paradigm.name, policy_params(cfg))


@dataclass
class TauTracker:
    """Running mean of observed shift seconds per role (shift up + the matching down).

    A shift that built its engine is left out: a first build (seconds under a CPU cap, a
    model load on a GPU) happens once per device and model, while τ_shift prices the shifts
    the planner weighs next, which wake what was built (tenths of a second here). Counting
    builds made the planner price every shift at the build's cost."""
    tau: dict[str, float]
    counts: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    builds: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})

    def observe(self, role: str, seconds: float, phases: dict[str, float] | None = None
                ) -> float:
        if phases and BUILD_PHASES & phases.keys():
            self.builds[role] += 1
            return self.tau[role]
        n = self.counts[role]
        # The configured value counts as one prior observation, so one odd shift cannot
        # swing the planner.
        self.tau[role] = (self.tau[role] * (n + 1) + seconds) / (n + 2)
        self.counts[role] = n + 1
        return self.tau[role]

    def attach(self, policy: AllocationPolicy) -> None:
        """Let the planner see the live values (same dict object)."""
        params = getattr(policy, "params", None)
        if params is not None and hasattr(params, "tau_shift"):
            params.tau_shift = self.tau
