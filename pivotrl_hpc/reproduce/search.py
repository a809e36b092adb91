"""The baseline search: the static settings each paradigm is tried with, as the paper tuned
its baselines' allocations. `pivotrl bench e2e`, `pivotrl simulate` and `pivotrl reproduce`
run one job per candidate and keep the best."""
from __future__ import annotations

from pivotrl_hpc.config import Config

SEARCHED = ("disaggregated", "rr_colocated", "rr_colocated_pooled", "shiftable")
MAX_SPLITS = 8   # (rollout, reward) splits tried per training width


def candidates(cfg: Config, paradigm: str) -> list[list[str]]:
    """Static settings to search (each a list of dotted overrides). The training width
    (devices, whole TP groups whose DP splits the batch) is every non-colocated paradigm's
    knob: the paper's Table 4 sets it per group for PivotRL as for the baselines, and where
    training is the bottleneck a paradigm searched on it and one held to the config's are
    not compared on equal terms. Disaggregated also searches its (rollout, reward) split
    of the non-training pool."""
    if paradigm not in SEARCHED:
        return []
    widths = [[f"roles.train_devices={t}"] for t in train_widths(cfg)]
    if paradigm != "disaggregated":
        return widths
    size = cfg.roles.reward_replica_size
    return [w + [f"paradigm.initial_rollout_devices={pool - rw}",
                 f"paradigm.initial_reward_devices={rw}"]
            for w, t in zip(widths, train_widths(cfg))
            for pool in [cfg.total_devices - t]
            for rw in spread(list(range(size, pool, size)), MAX_SPLITS)]


def train_widths(cfg: Config) -> list[int]:
    """Training widths to try: half, the config's and double, in whole TP groups whose DP
    splits the batch, leaving the pool room for one replica of each inference role."""
    r, tp = cfg.roles, cfg.roles.train_tensor_parallel
    room = max(r.rollout_replica_size, r.reward_replica_size)
    return [t for t in sorted({r.train_devices // 2, r.train_devices, 2 * r.train_devices})
            if t >= tp and t % tp == 0 and t <= cfg.total_devices - room
            and (cfg.rl.batch_size * cfg.rl.group_size) % (t // tp) == 0]


def spread(options: list, most: int) -> list:
    """At most `most` of `options`, evenly spaced, the first and the last kept."""
    if len(options) <= most:
        return options
    step = (len(options) - 1) / (most - 1)
    return [options[round(i * step)] for i in range(most)]
