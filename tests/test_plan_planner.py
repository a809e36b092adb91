"""The five-step planner (§7) on paper Figure 8 and synthetic clusters."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pivotrl_hpc.plan import (TRAINING_ID, PivotPlanner, PlannerParams, VanillaPlanner,
                              WorkloadSnapshot, harmonic_throughput, synthetic_snapshot)
from pivotrl_hpc.sched import Replica, Scheduler, Sequence, ThroughputModel

ROOT = Path(__file__).resolve().parents[1]
FIG8 = ROOT / "examples" / "figure8_snapshot.json"


@pytest.fixture(scope="module")
def fig8() -> tuple[WorkloadSnapshot, PlannerParams]:
    data = json.loads(FIG8.read_text())
    snap = WorkloadSnapshot.from_dict(data)
    return snap, PlannerParams(**data["meta"]["planner"])


def test_figure8_workload_matches_the_paper(fig8):
    snap, _ = fig8
    assert snap.role_sequences("reward") == 385 and snap.role_sequences("rollout") == 59
    assert sum(r.throughput for r in snap.role_replicas("reward")) == pytest.approx(4752, abs=1)
    assert sum(r.throughput for r in snap.role_replicas("rollout")) == pytest.approx(2077, abs=1)
    assert [len(r.devices) for r in snap.replicas].count(4) == 4          # 16 reward GPUs
    assert [len(r.devices) for r in snap.replicas].count(1) == 8          # 8 rollout GPUs
    assert len(snap.training.devices) == 8 and not snap.training.next_batch_ready


def test_figure8_selects_reward(fig8):
    snap, params = fig8
    report = PivotPlanner(params).explain(snap)
    assert report.choice.role == "reward"
    assert report.choice.taus["reward"] == pytest.approx(0.081, abs=0.001)
    assert report.choice.taus["rollout"] == pytest.approx(0.028, abs=0.001)


def test_figure8_shift_pairs_sorted_by_penalty(fig8):
    snap, params = fig8
    pairs = PivotPlanner(params).explain(snap).pairs
    assert [round(p.penalty) for p in pairs] == [0, 706, 1843]
    assert pairs[0].shift_down == (TRAINING_ID,) and pairs[0].size == 2   # 8 GPUs -> 2 x TP4
    assert pairs[1].shift_down == ("ro16", "ro17", "ro18", "ro19")        # 4 x TP1 -> 1 x TP4
    assert pairs[2].up_slots == ((20, 21, 22, 23),)


def test_figure8_candidates_and_choice(fig8):
    snap, params = fig8
    report = PivotPlanner(params).explain(snap)
    got = [(c.candidate.shift_up_count, round(c.candidate.penalty)) for c in report.candidates]
    # Algorithm 1 also keeps k=1 (one reward replica on the training GPUs); Figure 8 draws
    # the k = 2, 3, 4 candidates: Reward x24, x28, x32.
    assert got == [(1, 0), (2, 0), (3, 706), (4, 2549)]
    by_k = {c.candidate.shift_up_count: c for c in report.candidates}
    assert by_k[2].benefit > 0 and by_k[3].benefit > by_k[2].benefit and by_k[4].benefit < 0
    assert by_k[4].estimate.rollout == 0.0            # every rollout replica gone
    plan = report.plan
    assert plan is not None and plan.benefit == by_k[3].benefit
    assert plan.shift_down == (TRAINING_ID, "ro16", "ro17", "ro18", "ro19")
    assert [s.devices[0] for s in plan.shift_up] == [24, 28, 16]
    assert all(s.role == "reward" for s in plan.shift_up)


def _replay_role(data: dict, role: str, down: set[str], up: int) -> tuple[int, float]:
    """(N_Role^Seq, aggregate T) after the shifts, replayed from the raw snapshot JSON on
    the scheduler's own Algorithms 3 and 4 (plan.evaluate and plan.simulate not used)."""
    pool = data["roles"][role]
    reps = [Replica(r["id"], r["kv_capacity"], [Sequence(*q) for q in r["sequences"]])
            for r in data["replicas"] if r["role"] == role]
    sched = Scheduler(ThroughputModel.from_dict(pool["model"]), reps)
    sched.queue.extend(Sequence(*q) for q in pool["queue"])
    n = sched.n_sequences()
    if down:
        sched.shift_down_migration(sorted(down))
    if up:
        sched.shift_up_migration([Replica(f"new{i}", pool["kv_capacity"]) for i in range(up)])
    return n, sched.aggregate_throughput()


def _eq1(loads: list[tuple[int, float]]) -> float:
    if any(n and not t for n, t in loads):
        return 0.0
    return sum(n for n, _ in loads) / sum(n / t for n, t in loads if n)


def test_benefit_matches_an_independent_replay(fig8):
    """B = H·(T_cand − T_cur) − φ with T from a replay of the snapshot JSON and φ from the
    replicas' measured throughput: the planner's numbers, recomputed without it."""
    _, params = fig8
    data = json.loads(FIG8.read_text())
    measured = {r["id"]: r["throughput"] for r in data["replicas"]}
    report = PivotPlanner(params).explain(WorkloadSnapshot.from_dict(data))
    now = _eq1([_replay_role(data, role, set(), 0) for role in ("rollout", "reward")])
    assert report.current.overall == pytest.approx(now, rel=1e-12)
    assert len(report.candidates) == 4
    for c in report.candidates:
        down = set(c.shift_down) - {TRAINING_ID}
        assert all(measured[rid] and rid.startswith("ro") for rid in down)  # Figure 8's pairs
        roll = _replay_role(data, "rollout", down, 0)
        reward = _replay_role(data, "reward", set(), len(c.up))
        phi = sum(params.tau_shift["rollout"] * measured[rid] for rid in down)
        assert c.candidate.penalty == pytest.approx(phi, rel=1e-12)
        assert (c.estimate.rollout, c.estimate.reward) == pytest.approx((roll[1], reward[1]))
        expect = params.horizon_s * (_eq1([roll, reward]) - now) - phi
        assert c.benefit == pytest.approx(expect, rel=1e-9), c.candidate.shift_up_count


def test_vanilla_benefit_by_hand(fig8):
    """Binary throughput counts busy replicas, so Figure 8's vanilla numbers are arithmetic:
    59 rollout sequences on 8 replicas, 385 reward sequences on 4; each new reward replica
    adds one busy replica, a shifted-down rollout quad leaves 4 busy rollout replicas and
    costs 4 · τ_shift(rollout); with both quads down rollout stalls (Eq. 1 gives 0)."""
    snap, params = fig8
    report = VanillaPlanner(params).explain(snap)

    def eq1(rollout, reward):
        return (59 + 385) / (59 / rollout + 385 / reward)
    assert report.current.overall == pytest.approx(eq1(8, 4))
    h, phi = 60.0, 4 * 1.22725
    expect = {1: h * (eq1(8, 5) - eq1(8, 4)), 2: h * (eq1(8, 6) - eq1(8, 4)),
              3: h * (eq1(4, 7) - eq1(8, 4)) - phi, 4: h * (0.0 - eq1(8, 4)) - 2 * phi}
    got = {c.candidate.shift_up_count: c.benefit for c in report.candidates}
    assert got == pytest.approx(expect)


def test_equal_inputs_give_equal_plans(fig8):
    snap, params = fig8
    again = WorkloadSnapshot.from_dict(json.loads(FIG8.read_text()))
    a = PivotPlanner(params).explain(snap).to_dict()
    b = PivotPlanner(dataclasses.replace(params)).explain(again).to_dict()
    assert a == b
    big = synthetic_snapshot(64, seed=5)
    assert PivotPlanner().explain(big).to_dict() == PivotPlanner().explain(
        synthetic_snapshot(64, seed=5)).to_dict()


def test_training_is_shifted_up_when_its_batch_is_ready(fig8):
    snap, params = fig8
    down = dataclasses.replace(snap, training=dataclasses.replace(
        snap.training, up=False, next_batch_ready=True),
        replicas=snap.replicas + ())
    report = PivotPlanner(params).explain(down)
    assert report.choice.role == "training"
    assert report.plan is not None
    assert report.plan.shift_up[0].role == "training"
    assert report.plan.shift_down == ()                # its GPUs are free in this snapshot


def test_training_shift_up_takes_its_gpus_back():
    snap = synthetic_snapshot(32, training="down", seed=2)
    # let rollout occupy part of the training devices, then make the batch ready
    d = snap.to_dict()
    d["replicas"].append({"id": "ro_tr", "role": "rollout", "devices": [16],
                          "kv_capacity": 300000, "sequences": [[99999, 500, 10]]})
    d["training"]["next_batch_ready"] = True
    plan = PivotPlanner().decide(WorkloadSnapshot.from_dict(d))
    assert plan is not None and plan.shift_down == ("ro_tr",)
    assert plan.shift_up[0].devices == tuple(range(16, 32))


def test_active_training_is_never_shifted_down():
    snap = synthetic_snapshot(64, training="active")
    report = PivotPlanner().explain(snap)
    assert all(TRAINING_ID not in p.shift_down for p in report.pairs)
    idle = PivotPlanner().explain(synthetic_snapshot(64, training="idle"))
    assert any(TRAINING_ID in p.shift_down for p in idle.pairs)


def test_no_shift_when_no_candidate_pays_off():
    snap = synthetic_snapshot(16)   # one rollout pair: shifting it stalls rollout entirely
    report = PivotPlanner().explain(snap)
    assert len(report.candidates) == 1 and report.candidates[0].benefit < 0
    assert report.plan is None and "no candidate" in report.reason


def test_harmonic_mean_of_eq1():
    assert harmonic_throughput([(10, 100.0), (30, 300.0)]) == pytest.approx(40 / (0.1 + 0.1))
    assert harmonic_throughput([(10, 100.0), (0, 0.0)]) == pytest.approx(100.0)
    assert harmonic_throughput([(10, 100.0), (5, 0.0)]) == 0.0
    assert harmonic_throughput([]) == 0.0


def test_vanilla_uses_binary_throughput_and_no_migration(fig8):
    snap, params = fig8
    report = VanillaPlanner(params).explain(snap)
    # every replica runs something, so T_Role is its replica count: tau = N / replicas
    assert report.choice.taus["rollout"] == pytest.approx(59 / 8)
    assert report.choice.taus["reward"] == pytest.approx(385 / 4)
    # φ = τ_shift · (number of busy replicas) and estimates count busy replicas
    assert [round(p.penalty, 3) for p in report.pairs] == [0.0, round(4 * 1.22725, 3),
                                                           round(4 * 1.22725, 3)]
    assert report.current.rollout == 8 and report.current.reward == 4


def test_rollout_shift_up_takes_a_whole_reward_replica(fig8):
    """When rollout has the larger τ, one TP4 reward replica yields up to four TP1 rollout
    replicas: one pair of four, its penalty paid once for any k."""
    snap, params = fig8
    d = snap.to_dict()
    d["roles"]["rollout"]["queue"] = [[10_000 + i, 500, 0] for i in range(3000)]
    d["training"]["active"] = True
    report = PivotPlanner(params).explain(WorkloadSnapshot.from_dict(d))
    assert report.choice.role == "rollout"
    assert [p.size for p in report.pairs] == [4, 4, 4, 4]
    first = report.pairs[0]
    assert len(first.shift_down) == 1 and first.shift_down[0].startswith("rw")
    ks = [c.candidate.shift_up_count for c in report.candidates]
    assert ks == list(range(1, 17))
    by_k = {c.candidate.shift_up_count: c for c in report.candidates}
    assert by_k[1].candidate.penalty == by_k[4].candidate.penalty == first.penalty
    assert by_k[5].candidate.penalty == pytest.approx(first.penalty + report.pairs[1].penalty)



def test_role_with_work_and_no_replica_has_unbounded_tau(fig8):
    snap, params = fig8
    d = snap.to_dict()
    d["replicas"] = [r for r in d["replicas"] if r["role"] == "rollout"]   # reward all down
    report = PivotPlanner(params).explain(WorkloadSnapshot.from_dict(d))
    assert report.choice.role == "reward" and report.choice.taus["reward"] == float("inf")
    assert report.to_dict()["shift_up_role"]["tau"]["reward"] is None
    assert report.current.overall == 0.0            # Eq. (1): a stalled role stalls all
    assert report.plan is not None and report.plan.benefit > 0
    # the 16 free GPUs form one free pair, taken first at no penalty
    assert report.pairs[0].shift_down == () and report.pairs[0].size == 4


def test_a_candidates_migration_cost_is_its_moved_tokens_prefill(fig8):
    """Step 4 charges each candidate the re-prefill of what it migrates: p x moved tokens x
    the role's throughput per replica afterwards, per role, worked out here from the
    scheduler's own replay (Figure 8: the planner shifts reward up, moving sequences)."""
    from pivotrl_hpc.plan.evaluate import RoleReplay

    snap, params = fig8
    p = {"rollout": 2e-4, "reward": 5e-4}
    free = PivotPlanner(params).explain(snap)
    paid = PivotPlanner(dataclasses.replace(params, prefill_s_per_token=p)).explain(snap)
    role = free.choice.role
    replay = {r: RoleReplay(snap.roles[r].model, snap.role_replicas(r), snap.roles[r])
              for r in ("rollout", "reward")}
    charged = 0
    for a, b in zip(free.candidates, paid.candidates):
        assert a.estimate.migration_cost == 0.0
        assert b.estimate.overall == a.estimate.overall
        cost, replicas = 0.0, {r: len(snap.role_replicas(r)) for r in replay}
        for r in replay:
            down = [rid for rid in b.shift_down if rid in {x.replica_id
                                                           for x in snap.role_replicas(r)}]
            if not down:
                continue
            thr, moved = replay[r].shift_down(down)
            assert moved == sum(x.n_tok for x in snap.replicas if x.replica_id in down)
            if replicas[r] > len(down):   # none left: they wait, nothing is prefilled yet
                cost += p[r] * moved * thr / (replicas[r] - len(down))
        thr, moved = replay[role].shift_up(b.candidate.shift_up_count, params.migrate)
        cost += p[role] * moved * thr / (replicas[role] + b.candidate.shift_up_count)
        charged += moved > 0
        assert b.estimate.migration_cost == pytest.approx(cost, rel=1e-12)
        assert b.benefit == pytest.approx(a.benefit - cost, rel=1e-9, abs=1e-6)
    assert charged   # some candidate migrated something
    # prefill dear enough, and no shift pays for its migration any more
    dear = dataclasses.replace(params, prefill_s_per_token={"rollout": 1.0, "reward": 1.0})
    assert free.plan is not None and PivotPlanner(dear).decide(snap) is None
