"""The fast migration simulation (plan.simulate) against the plain Scheduler replay: the same
plans, candidates, penalties, estimated throughput and benefits, bit for bit."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from pivotrl_hpc.plan import (GEN_ROLES, PivotPlanner, PlannerParams, VanillaPlanner,
                              WorkloadSnapshot, synthetic_snapshot)
from pivotrl_hpc.plan.evaluate import RoleReplay
from pivotrl_hpc.plan.simulate import FastRole
from pivotrl_hpc.sched.model import BinaryThroughputModel, ThroughputModel

FIG8 = Path(__file__).resolve().parents[1] / "examples" / "figure8_snapshot.json"


def _exact(report) -> str:
    """The whole report as JSON: floats by repr, so equal text means equal bits."""
    return json.dumps(report.to_dict(), sort_keys=True)


def _both(planner: PivotPlanner, snap: WorkloadSnapshot) -> tuple[str, str]:
    fast = _exact(planner.explain(snap))
    planner.replay = True
    return fast, _exact(planner.explain(snap))


def _tight(snap: WorkloadSnapshot, rng: random.Random) -> WorkloadSnapshot:
    """Little free KV room everywhere, so Dispatch leaves sequences waiting."""
    reps = tuple(dataclasses.replace(r, kv_capacity=r.n_tok + rng.randint(0, 3000))
                 for r in snap.replicas)
    roles = {k: dataclasses.replace(p, kv_capacity=rng.randint(2000, 40_000))
             for k, p in snap.roles.items()}
    return dataclasses.replace(snap, replicas=reps, roles=roles)


def _random_snapshots(count: int):
    rng = random.Random(7)
    for i in range(count):
        snap = synthetic_snapshot(rng.choice((16, 32, 48, 64, 96, 128)), seed=i,
                                  seqs_per_rollout=rng.randint(1, 40),
                                  seqs_per_reward=rng.randint(2, 120),
                                  queued_per_reward=rng.randint(0, 40),
                                  training=rng.choice(("active", "idle", "down")))
        yield _tight(snap, rng) if i % 4 == 3 else snap


@pytest.mark.parametrize("params", [PlannerParams(), PlannerParams(migrate=False),
                                    PlannerParams(migrate="paper"),
                                    PlannerParams(binary_throughput=True),
                                    PlannerParams(horizon_s=5.0)],
                         ids=["default", "no-migration", "paper", "binary", "short-horizon"])
def test_fast_simulation_matches_replay_on_random_snapshots(params):
    for snap in _random_snapshots(40):
        fast, replay = _both(PivotPlanner(params), snap)
        assert fast == replay, snap.meta


def test_fast_simulation_matches_replay_on_figure8_and_vanilla():
    data = json.loads(FIG8.read_text())
    snap = WorkloadSnapshot.from_dict(data)
    fast, replay = _both(PivotPlanner(PlannerParams(**data["meta"]["planner"])), snap)
    assert fast == replay
    fast, replay = _both(VanillaPlanner(), snap)
    assert fast == replay


def test_fast_simulation_matches_replay_at_scale():
    """A 512-GPU decision: 64 candidates over thousands of sequences."""
    fast, replay = _both(PivotPlanner(), synthetic_snapshot(512, seed=3))
    assert fast == replay


@pytest.mark.parametrize("model", [None, ThroughputModel(A=0.0, B=0.01, C=1e-4, D=0.0),
                                   ThroughputModel(A=2e-7, B=0.0, C=5e-4, D=0.0),
                                   BinaryThroughputModel()],
                         ids=["snapshot", "no-attention", "compute-bound", "binary"])
def test_every_shift_down_set_and_count_agree(model):
    """Beyond the DP's candidates: arbitrary shift-down sets (any order of ids) and every
    shift-up count, on both roles, with and without the migration loop."""
    rng = random.Random(11)
    for i, snap in enumerate(_random_snapshots(12)):
        for role in GEN_ROLES:
            reps, pool = snap.role_replicas(role), snap.roles[role]
            m = model or pool.model
            fast, plain = FastRole(m, reps, pool), RoleReplay(m, reps, pool)
            assert fast.now == plain.now
            ids = [r.replica_id for r in reps]
            for _ in range(6):
                down = rng.sample(ids, rng.randint(0, len(ids)))
                assert fast.shift_down(down) == plain.shift_down(down), (i, role, down)
            for count in range(1, 7):
                for migrate in ("least_loss", "paper", False):
                    assert (fast.shift_up(count, migrate)
                            == plain.shift_up(count, migrate)), (i, role, count, migrate)
