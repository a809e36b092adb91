"""Replica state, the shared waiting queue, Dispatch and Abort (§6.1, Algorithm 2)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl_hpc.sched import (AbortSpec, DispatchIndex, Replica, Scheduler, SchedulerError,
                               Sequence, ThroughputModel, WaitingQueue)

M = ThroughputModel(A=5e-8, B=0.012, C=2e-4, D=0.008)

models = st.one_of(
    st.builds(ThroughputModel, A=st.floats(1e-9, 1e-6), B=st.floats(1e-3, 0.05),
              C=st.floats(0.0, 1e-3), D=st.floats(0.0, 0.02)),
    st.just(ThroughputModel(2e-8, 0.0, 4e-4, 0.0)))   # no latency floor: compute-bound
replica_states = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 4000), st.integers(0, 2)),
                          min_size=1, max_size=12)


def _replicas(states) -> list[Replica]:
    """Replicas with n sequences of `length` tokens each and one of three capacities."""
    reps, sid = [], 0
    for i, (n, length, cap_kind) in enumerate(states):
        cap = (200_000, 60_000, n * length + 2_000)[cap_kind]
        seqs = []
        for _ in range(n):
            if sum(s.length for s in seqs) + length > cap:
                break
            seqs.append(Sequence(sid, length))
            sid += 1
        reps.append(Replica(f"r{i}", cap, seqs))
    return reps


@settings(max_examples=150, deadline=None)
@given(models, replica_states, st.lists(st.integers(1, 30_000), min_size=1, max_size=8))
def test_index_argmax_equals_brute_force(model, states, lengths):
    reps = _replicas(states)
    index = DispatchIndex(model, reps)
    for length in lengths:
        pos = index.best(length)
        gains = [(model.gain(r.n_seq, r.n_tok, length), -i) for i, r in enumerate(reps)
                 if r.remaining >= length]
        if not gains:
            assert pos is None
            continue
        best_gain, _ = max(gains)
        assert pos is not None and reps[pos].remaining >= length
        got = model.gain(reps[pos].n_seq, reps[pos].n_tok, length)
        assert got >= best_gain - 1e-9 * max(1.0, abs(best_gain))
        reps[pos].add(Sequence(10_000_000 + len(reps[pos].seqs) * 100 + pos, length))
        index.moved(pos)


def test_dispatch_picks_largest_gain_and_breaks_ties_by_order():
    busy = Replica("busy", 100_000, [Sequence(i, 1000) for i in range(30)])
    a, b = Replica("a", 100_000), Replica("b", 100_000)
    s = Scheduler(M, [busy, a, b])
    s.submit(Sequence(100, 500))
    s.submit(Sequence(101, 500))
    moves = s.dispatch()
    # an empty replica gains the most; the first empty one wins the tie, then the other
    assert [(m.seq_id, m.dst) for m in moves] == [(100, "a"), (101, "b")]


def test_misfit_stays_queued_in_order_while_others_dispatch():
    s = Scheduler(M, [Replica("small", 1_000)])
    for sid, length in [(5, 4_000), (1, 600), (3, 2_000), (2, 300)]:
        s.submit(Sequence(sid, length))
    moves = s.dispatch()
    assert [m.seq_id for m in moves] == [1, 2]            # ascending id, each fits
    assert [q.seq_id for q in s.queue] == [3, 5]          # misfits keep their order
    assert s.replicas["small"].n_tok == 900


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5_000), max_size=300), st.integers(1, 8),
       st.integers(1_000, 60_000))
def test_dispatch_conserves_and_never_overfills(lengths, n_reps, cap):
    s = Scheduler(M, [Replica(f"r{i}", cap) for i in range(n_reps)])
    s.queue.extend(Sequence(i, length) for i, length in enumerate(lengths))
    s.dispatch()
    placed = [sid for r in s.replicas.values() for sid in r.seqs]
    waiting = [q.seq_id for q in s.queue]
    assert sorted(placed + waiting) == list(range(len(lengths)))
    for r in s.replicas.values():
        assert 0 <= r.n_tok <= r.capacity
        assert r.n_tok == sum(q.length for q in r.seqs.values())
    room = max(r.remaining for r in s.replicas.values())
    assert all(q.length > room for q in s.queue)  # what waits fits nowhere


def test_abort_returns_sequences_with_their_tokens():
    r = Replica("r", 50_000, [Sequence(1, 100, 900), Sequence(2, 100, 50), Sequence(3, 80, 60)])
    s = Scheduler(M, [r])
    short = s.abort("r", AbortSpec.SHORTEST)
    assert [(q.seq_id, q.generated_tokens) for q in short] == [(3, 60)]
    rest = s.abort("r", AbortSpec.ALL)
    assert sorted(q.seq_id for q in rest) == [1, 2]
    assert r.n_seq == 0 and r.n_tok == 0
    assert [(q.seq_id, q.length) for q in s.queue] == [(1, 1000), (2, 150), (3, 140)]


def test_queue_priority_default_and_custom():
    q = WaitingQueue()
    q.extend([Sequence(3, 10), Sequence(1, 50), Sequence(2, 5)])
    assert [s.seq_id for s in q] == [1, 2, 3] and len(q) == 3
    assert q.pop().seq_id == 1 and 1 not in q and 2 in q
    shortest_first = WaitingQueue(key=lambda s: s.length)
    shortest_first.extend([Sequence(3, 10), Sequence(1, 50), Sequence(2, 5)])
    assert [s.seq_id for s in shortest_first] == [2, 3, 1]
    with pytest.raises(SchedulerError, match="already in the waiting queue"):
        shortest_first.push(Sequence(2, 5))


def test_replica_guards_and_growth():
    r = Replica("r", 1_000, [Sequence(1, 400)])
    with pytest.raises(SchedulerError, match="sequence 1 already runs"):
        r.add(Sequence(1, 10))
    with pytest.raises(SchedulerError, match="exceeds remaining KV capacity 600"):
        r.add(Sequence(2, 700))
    grown = r.grow(1, 150)
    assert (grown.generated_tokens, r.n_tok, r.shortest().seq_id) == (150, 550, 1)
    with pytest.raises(SchedulerError, match="no running sequence 9"):
        r.remove(9)
    with pytest.raises(SchedulerError, match="negative KV capacity"):
        Replica("bad", -1)


def test_shortest_tracks_removals():
    r = Replica("r", 10_000, [Sequence(i, 100 * (i + 1)) for i in range(6)])
    order = []
    while r.seqs:
        s = r.shortest()
        order.append(s.seq_id)
        r.remove(s.seq_id)
    assert order == list(range(6)) and r.shortest() is None


@settings(max_examples=200, deadline=None)
@given(models, st.integers(1, 80), st.lists(st.lists(st.integers(10, 9_000), min_size=1,
                                                        max_size=6), min_size=2, max_size=30),
       st.lists(st.integers(1, 40_000), min_size=1, max_size=6))
def test_index_argmax_within_a_crowded_bucket(model, n, shapes, lengths):
    """Many replicas with the same sequence count and capacity but different token counts:
    the gain's peak in t falls between them, so both neighbours of the peak matter."""
    reps, sid = [], 0
    for i, shape in enumerate(shapes):
        seqs = [Sequence(sid + j, shape[j % len(shape)]) for j in range(n)]
        sid += n
        reps.append(Replica(f"r{i}", 10**7, seqs))
    index = DispatchIndex(model, reps)
    for length in lengths:
        pos = index.best(length)
        best_gain = max(model.gain(r.n_seq, r.n_tok, length) for r in reps)
        got = model.gain(reps[pos].n_seq, reps[pos].n_tok, length)
        assert got >= best_gain - 1e-9 * max(1.0, abs(best_gain))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 3_000)),
                max_size=60))
def test_index_tracks_free_capacity_under_adds_and_removes(ops):
    reps = [Replica(f"r{i}", 10_000 + 1_000 * i) for i in range(6)]
    index = DispatchIndex(M, reps)
    sid = 0
    for add, which, length in ops:
        r = reps[which]
        if add and r.remaining >= length:
            r.add(Sequence(sid, length))
            sid += 1
        elif not add and r.seqs:
            r.remove(next(iter(r.seqs)))
        else:
            continue
        index.moved(which)
        assert index.max_remaining() == max(x.remaining for x in reps)
