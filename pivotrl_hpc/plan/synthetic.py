"""Deterministic synthetic workload snapshots in the paper's proportions (§8.1, Table 4).

Policy replicas are TP1 (one GPU), GenRM replicas TP4, training is one unit over the upper
half of the cluster; the lower half is split evenly between rollout and reward. As in
Figure 8 (59 rollout sequences on 8 replicas, 385 reward sequences on 4) reward is the
bottleneck: by default rollout replicas run 8-24 sequences, reward replicas 32-96 plus a
waiting queue of 16 per replica. Used by
`pivotrl bench planner` and reusable by the cluster simulator.
"""
from __future__ import annotations

import random

from pivotrl_hpc.plan.snapshot import (REWARD, ROLLOUT, ReplicaState, RolePool, SeqState,
                                       TrainingState, WorkloadSnapshot)
from pivotrl_hpc.sched.model import ThroughputModel

# Constants in the range a profiled 7B policy (TP1) and 30B GenRM (TP4) give on H100s.
ROLLOUT_MODEL = ThroughputModel(A=5e-8, B=0.012, C=2e-4, D=0.008)
REWARD_MODEL = ThroughputModel(A=1.5e-7, B=0.02, C=3e-4, D=0.015)
ROLLOUT_KV, REWARD_KV = 300_000, 600_000


def synthetic_snapshot(gpus: int, seed: int = 0, seqs_per_rollout: int = 16,
                       seqs_per_reward: int = 64, queued_per_reward: int = 16,
                       training: str = "active") -> WorkloadSnapshot:
    """A snapshot of `gpus` devices (a multiple of 16). `training` is "active" (running, so
    its GPUs cannot move), "idle" (holding its GPUs, batch not ready) or "down"."""
    if gpus < 16 or gpus % 16:
        raise ValueError(f"synthetic snapshots need a multiple of 16 GPUs, got {gpus}")
    if training not in ("active", "idle", "down"):
        raise ValueError(f"training must be active, idle or down, got {training!r}")
    rng = random.Random(seed)
    quarter = gpus // 4
    replicas: list[ReplicaState] = []
    next_id = [0]

    def seqs(count: int, prompt: tuple[int, int], gen: tuple[int, int], cap: int
             ) -> tuple[SeqState, ...]:
        out, used = [], 0
        for _ in range(count):
            s = SeqState(next_id[0], rng.randint(*prompt), rng.randint(*gen))
            next_id[0] += 1
            if used + s.length > cap:
                break
            used += s.length
            out.append(s)
        return tuple(out)

    def measured(model: ThroughputModel, ss: tuple[SeqState, ...]) -> float:
        return model.throughput(len(ss), sum(s.length for s in ss)) * rng.uniform(0.95, 1.05)

    for d in range(quarter):
        n = rng.randint(seqs_per_rollout // 2, seqs_per_rollout * 3 // 2)
        ss = seqs(n, (100, 1000), (0, 3000), ROLLOUT_KV)
        replicas.append(ReplicaState(f"ro{d}", ROLLOUT, (d,), ROLLOUT_KV, ss,
                                     measured(ROLLOUT_MODEL, ss)))
    for j in range(quarter // 4):
        first = quarter + 4 * j
        n = rng.randint(seqs_per_reward // 2, seqs_per_reward * 3 // 2)
        ss = seqs(n, (500, 4000), (0, 1500), REWARD_KV)
        replicas.append(ReplicaState(f"rw{j}", REWARD, tuple(range(first, first + 4)),
                                     REWARD_KV, ss, measured(REWARD_MODEL, ss)))
    reward_queue = seqs(quarter // 4 * queued_per_reward, (500, 4000), (0, 0), 1 << 62)
    roles = {ROLLOUT: RolePool(ROLLOUT, 1, ROLLOUT_KV, ROLLOUT_MODEL),
             REWARD: RolePool(REWARD, 4, REWARD_KV, REWARD_MODEL, reward_queue)}
    train = TrainingState(tuple(range(gpus // 2, gpus)), up=training != "down",
                          active=training == "active")
    return WorkloadSnapshot(gpus, roles, tuple(replicas), train,
                            meta={"generator": "synthetic", "seed": seed})
