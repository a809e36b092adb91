"""The executor's translation as a table, the paradigm mapping, and the controller's
purity (no torch, MPI, engines, h5py when imported)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivotrl_hpc.config.schema import Config
from pivotrl_hpc.controller.actions import (MIGRATE, SHIFT_DOWN, SHIFT_UP, PlanError,
                                             ReplicaInfo, check_plan, migration_actions,
                                             plan_actions)
from pivotrl_hpc.controller.policy import TauTracker, make_paradigm_policy, policy_params
from pivotrl_hpc.plan.policies import PLANNERS, POLICIES
from pivotrl_hpc.plan.snapshot import WorkloadSnapshot
from pivotrl_hpc.plan.types import ReplicaSpec, ShiftPlan
from pivotrl_hpc.sched.scheduler import Scheduler
from pivotrl_hpc.sched.state import Replica, Sequence
from test_sched_purity import HEAVY, _loaded

FIG8 = Path(__file__).resolve().parents[1] / "examples" / "figure8_snapshot.json"


def schedulers_of(snap: WorkloadSnapshot) -> dict[str, Scheduler]:
    out = {}
    for role, pool in snap.roles.items():
        s = Scheduler(pool.model)
        for r in snap.role_replicas(role):
            s.add_replica(Replica(r.replica_id, r.kv_capacity,
                                  [Sequence(q.seq_id, q.prompt_tokens, q.generated_tokens)
                                   for q in r.sequences]))
        for q in pool.queue:
            s.submit(Sequence(q.seq_id, q.prompt_tokens, q.generated_tokens))
        out[role] = s
    return out


def figure8():
    snap = WorkloadSnapshot.from_dict(json.loads(FIG8.read_text()))
    replicas = {r.replica_id: ReplicaInfo(r.role, r.devices) for r in snap.replicas}
    return snap, replicas, schedulers_of(snap)


def test_figure8_plan_translates_in_the_papers_order():
    snap, replicas, scheds = figure8()
    plan = make_paradigm_policy(_cfg("shiftable")).decide(snap)
    assert plan is not None and plan.shift_up[0].role == "reward"
    before = {role: s.n_sequences() for role, s in scheds.items()}
    actions, results = plan_actions(plan, replicas, scheds, snap.training.devices)
    phases = [a.phase for a in actions]
    assert phases == sorted(phases)  # migration, then shift down, then shift up
    downs = {d for a in actions if a.phase == SHIFT_DOWN for d in a.devices}
    ups = {d for a in actions if a.phase == SHIFT_UP for d in a.devices}
    assert ups <= downs | set(range(snap.gpus))
    # every sequence of a shift-down replica is re-dispatched or queued, none lost
    for role, s in scheds.items():
        assert s.n_sequences() == before[role]
    moved = {sid for a in actions if a.kind == "add" for sid in a.seq_ids}
    aborted = {sid for res in results.values() for sid in res.aborted}
    queued = {q.seq_id for res_role in results for q in scheds[res_role].queue}
    assert aborted <= moved | queued


def test_rows_of_the_table():
    replicas = {"rollout0": ReplicaInfo("rollout", (0,)), "reward1": ReplicaInfo("reward", (1,))}
    scheds = {"rollout": Scheduler(_model()), "reward": Scheduler(_model())}
    scheds["rollout"].add_replica(Replica("rollout0", 100, [Sequence(7, 5, 3)]))
    scheds["reward"].add_replica(Replica("reward1", 100))
    plan = ShiftPlan(("rollout0",), (ReplicaSpec("reward", (0,)),), "t")
    actions, _ = plan_actions(plan, replicas, scheds, (2, 3))
    assert [(a.phase, a.kind, a.replica, a.devices) for a in actions] == [
        (SHIFT_DOWN, "shift_down", "rollout0", (0,)), (SHIFT_UP, "shift_up", "reward0", (0,))]
    assert 7 in scheds["rollout"].queue  # nowhere to go: it waits, with its tokens
    train = ShiftPlan(("reward1", "training"), (ReplicaSpec("training", (2, 3)),), "t")
    actions, _ = plan_actions(train, replicas, scheds, (2, 3))
    assert [(a.kind, a.replica) for a in actions] == [
        ("shift_down", "reward1"), ("shift_down", "training"), ("shift_up", "training")]


def test_shift_up_migration_aborts_at_the_source_and_adds_at_the_destination():
    s = Scheduler(_model())
    s.add_replica(Replica("rollout0", 10_000, [Sequence(i, 50, 10) for i in range(12)]))
    replicas = {"rollout0": ReplicaInfo("rollout", (0,)), "rollout1": ReplicaInfo("rollout", (1,))}
    res = s.shift_up_migration([Replica("rollout1", 10_000)])
    acts = migration_actions("rollout", res, replicas)
    assert res.moves and acts[0].kind == "abort" and acts[0].replica == "rollout0"
    assert set(acts[0].seq_ids) == set(acts[1].seq_ids) and acts[1].replica == "rollout1"
    assert all(a.phase == MIGRATE for a in acts)


@pytest.mark.parametrize("plan,why", [
    (ShiftPlan(("rollout9",), (), "t"), "not up"),
    (ShiftPlan((), (ReplicaSpec("reward", (0,)),), "t"), "held by rollout0"),
    (ShiftPlan(("training",), (), "t"), "running a step"),
])
def test_stale_plans_are_refused(plan, why):
    replicas = {"rollout0": ReplicaInfo("rollout", (0,))}
    with pytest.raises(PlanError, match=why):
        check_plan(plan, replicas, (2, 3), training_up=True, training_active=True, gpus=4)


@pytest.mark.parametrize("name", POLICIES)
def test_every_paradigm_name_maps_to_its_policy(name):
    cfg = _cfg(name)
    policy = make_paradigm_policy(cfg)
    assert policy.name == name
    params = policy_params(cfg)
    if name in PLANNERS:
        assert policy.params.tau_shift == {"rollout": 3.0, "reward": 4.0, "training": 7.0}
        assert policy.params.horizon_s == 42.0
    if name == "rule_based":
        assert (policy.high, policy.low) == (0.7, 0.2)
    if name == "disaggregated":
        assert params == {"rollout_gpus": 2, "reward_gpus": 2}


def test_tau_follows_the_measured_shifts():
    policy = make_paradigm_policy(_cfg("shiftable"))
    tau = TauTracker({"rollout": 3.0, "reward": 4.0, "training": 7.0})
    tau.attach(policy)
    tau.observe("rollout", 1.0)
    tau.observe("rollout", 1.0)
    assert policy.params.tau_shift["rollout"] == pytest.approx((3.0 + 1.0 + 1.0) / 3)
    # an engine's first build is not what the next shift costs: left out, counted
    tau.observe("rollout", 30.0, {"preserved.engine_start": 29.0, "total": 30.0})
    tau.observe("training", 20.0, {"preserved.build": 19.0, "total": 20.0})
    assert policy.params.tau_shift == pytest.approx({"rollout": 5 / 3, "reward": 4.0,
                                                     "training": 7.0})
    assert tau.builds == {"rollout": 1, "reward": 0, "training": 1}
    tau.observe("rollout", 1.0 / 3, {"preserved.engine_wake": 0.1, "total": 1.0 / 3})
    assert policy.params.tau_shift["rollout"] == pytest.approx((5 + 1 / 3) / 4)


def test_controller_and_sim_import_no_heavy_module():
    assert _loaded(["pivotrl_hpc.controller.loop", "pivotrl_hpc.sim.modeled"], HEAVY) == []


def _model():
    from pivotrl_hpc.sched.model import ThroughputModel
    return ThroughputModel(1e-6, 0.01, 1e-3, 0.002)


def _cfg(name: str) -> Config:
    cfg = Config()
    p = cfg.paradigm
    p.name, p.horizon_s = name, 42.0
    p.shift_seconds_rollout, p.shift_seconds_reward, p.shift_seconds_training = 3.0, 4.0, 7.0
    p.rule_high_kv, p.rule_low_kv = 0.7, 0.2
    p.initial_rollout_devices, p.initial_reward_devices = 2, 2
    return cfg


def test_a_sequence_moved_twice_in_one_migration_is_sent_once():
    """Algorithm 4 may move a sequence r1 -> r2 and later r2 -> r0 in one migration: it is
    aborted on r1 and added on r0 only (before, it was also added on r2, a second live copy)."""
    from pivotrl_hpc.controller.actions import ReplicaInfo, migration_actions, net_moves
    from pivotrl_hpc.sched.scheduler import MigrationResult, Move

    moves = [Move(5, None, "r0"), Move(7, "r1", "r2"), Move(8, "r2", "r0"),
             Move(7, "r2", "r0"), Move(9, "r1", "r2"), Move(9, "r2", "r1")]
    assert net_moves(moves) == [Move(5, None, "r0"), Move(7, "r1", "r0"), Move(8, "r2", "r0")]
    replicas = {r: ReplicaInfo("reward", (i,)) for i, r in enumerate(("r0", "r1", "r2"))}
    acts = migration_actions("reward", MigrationResult(moves=moves), replicas)
    got = [(a.kind, a.replica, a.seq_ids) for a in acts]
    assert got == [("abort", "r1", (7,)), ("abort", "r2", (8,)), ("add", "r0", (5, 7, 8))]


@pytest.mark.timeout(120)
def test_a_step_reply_of_a_replica_planned_down_is_stale_and_nothing_is_lost():
    """A plan shifts a rollout replica down while its Step is in flight: Algorithm 3 has
    re-queued the sequences in the scheduler, then the Step reply lands. Its tokens are
    stale (the records resume from the queue); before, they grew sequences of a replica the
    scheduler no longer had (SchedulerError, seen simulating the paper's TP=4/8 groups)."""
    from controller_util import make_controller, split_bootstrap

    from pivotrl_hpc.plan.types import ReplicaSpec, ShiftPlan

    ctl, _ = make_controller(paradigm="static", bootstrap=split_bootstrap(), steps=1)
    ctl.executor.execute(ctl._bootstrap, 0)
    ctl._bootstrap = None
    flow, busy = ctl.flows["rollout"], None
    while busy is None:   # run the loop until a rollout replica has a Step in flight
        ctl.collect()
        ctl.admit()
        ctl.dispatch()
        ctl.drive()
        busy = next((rid for rid, r in flow.sched.replicas.items() if r.n_seq and any(
            ctl.devices.busy(d) for d in ctl.executor.book.replicas[rid].devices)), None)
        if busy is None:
            ctl.clock.wait_until(ctl.next_event())
    placed = flow.placed_on(busy)
    assert placed
    # every rollout replica goes down, so Algorithm 3 can only re-queue (not migrate)
    down = {rid: ctl.executor.book.replicas[rid].devices for rid in flow.sched.replicas}
    ctl.executor.execute(ShiftPlan(tuple(down), (), "down, a Step in flight"), 1)
    assert all(flow.records[s].replica is None for s in placed)   # re-queued at once
    while ctl.executor.book.in_flight:   # the late Step reply, then the shift downs, land
        ctl.clock.wait_until(ctl.next_event())
        ctl.collect()
    assert all(flow.records[s].replica is None and not flow.records[s].finished
               for s in placed)
    # the static paradigm never shifts: bring rollout back by hand, then finish the job
    ctl.executor.execute(ShiftPlan((), tuple(ReplicaSpec("rollout", d) for d in down.values()),
                                   "back up"), 2)
    summary = ctl.run()
    assert summary["steps"] == 1
    assert all(rec.finished for rec in flow.records.values() if rec.sid in placed)
