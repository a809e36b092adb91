"""Tail isolation (sched/tail.py), the Dispatch lever beyond the paper: it changes what it
claims and only that; off (the default) Dispatch is the paper's."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pivotrl_hpc.config import load_config
from pivotrl_hpc.config.validate import ConfigError
from pivotrl_hpc.controller.live import tail_isolation
from pivotrl_hpc.sched import Replica, Scheduler, Sequence, ThroughputModel
from pivotrl_hpc.sched.tail import TailIsolation, Tails

# the 7B group's GenRM as the online fit sees it (A per token, B, C per sequence, D)
MODEL = ThroughputModel(A=9.4e-9, B=0.0107, C=3.7e-7, D=0.0101)


def role(tail, loads: dict[str, list[tuple[int, int]]], cap: int = 100_000) -> Scheduler:
    """A role whose replicas run (seq_id, tokens) each."""
    reps = [Replica(rid, cap, [Sequence(sid, tok) for sid, tok in seqs])
            for rid, seqs in loads.items()]
    return Scheduler(MODEL, reps, tail=tail)


def placed(sched: Scheduler, seqs) -> dict[int, str]:
    for s in seqs:
        sched.submit(s)
    return {m.seq_id: m.dst for m in sched.dispatch()}


def test_a_batchs_last_arrivals_are_its_tail_and_a_resumed_one_keeps_its_kind():
    tails = Tails(SPEC)
    assert [tails.arrive(i) for i in (0, 1, 2, 3, 4, 5, 6, 7)] == [False] * 8
    assert tails.arrive(12) is False            # batch 1's first: counted apart
    assert [tails.arrive(i) for i in (9, 8)] == [True, True]   # the last two of batch 0
    assert tails.arrive(3) is False and tails.arrive(9) is True    # arriving again
    for b in range(2, 12):                       # old batches are forgotten
        tails.arrive(b * 10)
    assert 0 not in tails.arrived and 9 not in tails.tails


# r2 holds the fewest tokens. The paper's largest ΔT_i puts new work on it.
LOADS = {"r0": [(1, 9000), (11, 500), (12, 700)], "r1": [(13, 12000), (14, 8000)],
         "r2": [(15, 3000)], "r3": [(16, 9000), (17, 9000)]}
SPEC = TailIsolation(batch=10, late=2, lanes=1)
BULK = [Sequence(i, 4000) for i in range(20, 28)]   # batch 2's first eight arrivals


def test_off_the_paper_places_new_work_beside_the_others():
    assert placed(role(None, LOADS), [Sequence(25, 800)]) == {25: "r2"}
    paper = placed(role(None, LOADS), [*BULK, Sequence(28, 15000)])
    assert [s for s, r in paper.items() if r == "r2" and s != 28] != []


def test_a_tail_sequence_gets_the_fewest_token_replica_to_itself():
    sched = role(SPEC, LOADS)
    got = placed(sched, [*BULK, Sequence(28, 15000)])   # 28: batch 2's 9th arrival, a tail
    assert got[28] == "r2"
    assert list(sched.replicas["r2"].seqs) == [28]
    assert sched.evicted == [("r2", 15)]               # the caller aborts it on r2
    assert 15 in sched.queue                            # and it waits, with its tokens
    assert next(s for s in sched.queue if s.seq_id == 15).length == 3000
    assert "r2" not in [got[i] for i in range(20, 28)]  # the bulk kept off the lane
    again = {m.seq_id: m.dst for m in sched.dispatch()}
    assert again == {15: again[15]} and again[15] != "r2"


def test_past_its_lanes_a_tail_joins_the_lane_and_evicts_nothing():
    sched = role(SPEC, LOADS)
    placed(sched, [*BULK, Sequence(28, 15000)])
    sched.evicted.clear()
    got = placed(sched, [Sequence(29, 100)])           # the 10th: a tail too, lanes = 1
    assert got[29] == "r2" and sched.evicted == []
    assert sorted(sched.replicas["r2"].seqs) == [28, 29]


def test_two_replicas_always_stay_for_the_rest():
    loads = {k: LOADS[k] for k in ("r0", "r2")}
    sched = role(SPEC, loads)
    placed(sched, [*BULK, Sequence(28, 15000)])
    assert sched.evicted == [] and len(sched.replicas["r2"].seqs) > 1


def test_migration_leaves_the_lane_alone():
    sched = role(SPEC, LOADS)
    placed(sched, [*BULK, Sequence(28, 15000)])
    sched.dispatch()
    result = sched.shift_up_migration([Replica("r4", 100_000)], migrate="least_loss")
    assert list(sched.replicas["r2"].seqs) == [28]
    assert all("r2" not in (m.src, m.dst) for m in result.moves)


def test_a_role_too_small_for_a_lane_dispatches_as_the_paper():
    rng = random.Random(5)
    for _ in range(100):
        loads = {f"r{k}": [(10 * k + i, rng.randint(10, 9000)) for i in range(rng.randint(0, 4))]
                 for k in range(rng.randint(1, 2))}
        seqs = [Sequence(i, rng.randint(10, 30_000)) for i in range(40, 40 + rng.randint(1, 9))]
        a, b = role(SPEC, loads, cap=60_000), role(None, loads, cap=60_000)
        assert placed(a, seqs) == placed(b, seqs)
        assert [s.seq_id for s in a.queue] == [s.seq_id for s in b.queue]


def test_nothing_is_lost_or_duplicated():
    sched = role(SPEC, LOADS, cap=30_000)
    before = {s.seq_id for r in sched.replicas.values() for s in r.seqs.values()}
    new = [Sequence(i, 6000) for i in range(20, 30)]
    placed(sched, new)
    sched.dispatch()
    running = [s.seq_id for r in sched.replicas.values() for s in r.seqs.values()]
    assert len(running) == len(set(running))
    assert set(running) | {s.seq_id for s in sched.queue} == before | {s.seq_id for s in new}
    assert all(r.n_tok <= r.capacity for r in sched.replicas.values())


def test_the_config_switch_defaults_to_the_paper_and_checks_its_range():
    path = Path(__file__).resolve().parents[1] / "configs/qwen2.5-7b_qwen3-30b-a3b.yaml"
    assert tail_isolation(load_config(path, check_files=False)) is None
    cfg = load_config(path, ["paradigm.tail_isolation=2"], check_files=False)
    assert tail_isolation(cfg) == TailIsolation(batch=512, late=2, lanes=2)
    with pytest.raises(ConfigError, match="paradigm.tail_isolation"):
        load_config(path, ["paradigm.tail_isolation=-1"], check_files=False)
    with pytest.raises(ValueError, match="late <= batch"):
        TailIsolation(batch=512, late=0)


def test_the_controller_aborts_an_evicted_sequence_as_a_kv_preemption_victim():
    """RoleFlow on a tail-isolating Scheduler: the sequence evicted for a tail gets a
    `preempt` row, its epoch bumped (its output still in flight is stale), an Abort due on
    its engine, and waits in the queue with its tokens; the next Dispatch resumes it."""
    from pivotrl_hpc.controller.flow import RoleFlow, SeqRecord
    from pivotrl_hpc.protocol.engine import Sampling

    events = []
    flow = RoleFlow("reward", Scheduler(MODEL, tail=TailIsolation(batch=4, late=1)),
                    lambda rec, now: None, lambda e, rec, rep, *a: events.append((e, rec.sid)))
    for rid in ("r0", "r1", "r2", "r3"):
        flow.sched.add_replica(Replica(rid, 100_000))
    for sid, n in ((0, 900), (1, 800), (2, 700), (4, 100)):   # batch 0's first three, 1's first
        flow.submit(SeqRecord(sid, "reward", (7,) * n, 50, Sampling()))
    for m in flow.sched.dispatch():
        flow.place_ids(m.dst, [m.seq_id])
    flow.evicted()
    assert flow.preempted == [] and "preempt" not in [e for e, _ in events]
    victim_rid = min(flow.sched.replicas.values(), key=lambda r: (r.n_tok, r.n_seq)).replica_id
    victims = sorted(flow.sched.replicas[victim_rid].seqs)
    epochs = {sid: flow.records[sid].epoch for sid in victims}
    flow.submit(SeqRecord(3, "reward", (7,) * 5000, 50, Sampling()))   # batch 0's last
    events.clear()
    moves = flow.sched.dispatch()
    flow.evicted()
    assert [(m.seq_id, m.dst) for m in moves] == [(3, victim_rid)]
    assert list(flow.sched.replicas[victim_rid].seqs) == [3]
    assert flow.preempted == [(victim_rid, sid) for sid in victims]
    assert events == [("preempt", sid) for sid in victims]
    for sid in victims:
        assert flow.records[sid].replica is None
        assert flow.records[sid].epoch == epochs[sid] + 1
        assert sid in flow.sched.queue
    assert flow.sched.evicted == []
    again = flow.sched.dispatch()
    assert sorted(m.seq_id for m in again) == victims
    assert all(m.dst != victim_rid for m in again)
