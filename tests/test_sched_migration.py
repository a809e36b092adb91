"""Shift-time migration: Algorithms 3 and 4 and the O(I·N + I log I) bound (appendix C)."""
from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl_hpc.sched import (Move, OpCounter, Replica, Scheduler, Sequence,
                               ThroughputModel)

M = ThroughputModel(A=5e-8, B=0.012, C=2e-4, D=0.008)

workloads = st.lists(st.lists(st.integers(50, 6_000), max_size=40), min_size=1, max_size=10)


def _scheduler(loads, queue=(), cap=120_000, counter=None) -> Scheduler:
    reps, sid = [], 0
    for i, lengths in enumerate(loads):
        seqs = []
        for length in lengths:
            if sum(s.length for s in seqs) + length <= cap:
                seqs.append(Sequence(sid, length))
            sid += 1
        reps.append(Replica(f"r{i}", cap, seqs))
    s = Scheduler(M, reps, counter=counter)
    s.queue.extend(Sequence(100_000 + i, length) for i, length in enumerate(queue))
    return s


def _where(s: Scheduler) -> dict[int, str]:
    seen: dict[int, str] = {}
    for rid, r in s.replicas.items():
        for sid in r.seqs:
            assert sid not in seen, f"sequence {sid} on {seen[sid]} and {rid}"
            seen[sid] = rid
    for q in s.queue:
        assert q.seq_id not in seen, f"sequence {q.seq_id} queued and on {seen[q.seq_id]}"
        seen[q.seq_id] = "queue"
    for r in s.replicas.values():
        assert r.n_tok <= r.capacity and r.n_tok == sum(q.length for q in r.seqs.values())
    return seen


@settings(max_examples=80, deadline=None)
@given(workloads, st.lists(st.integers(50, 6_000), max_size=30), st.integers(1, 4),
       st.sampled_from([20_000, 120_000]))
def test_shift_up_conserves_and_never_lowers_throughput(loads, queue, k, cap):
    s = _scheduler(loads, queue, cap)
    before_ids = set(_where(s))
    before = s.aggregate_throughput()
    result = s.shift_up_migration([Replica(f"new{i}", cap) for i in range(k)])
    assert set(_where(s)) == before_ids
    assert s.aggregate_throughput() >= before - 1e-9
    assert result.throughput_after >= result.throughput_before - 1e-9
    assert result.iterations <= sum(len(x) for x in loads) + len(queue)


@settings(max_examples=80, deadline=None)
@given(workloads, st.data())
def test_shift_down_conserves_sequences(loads, data):
    s = _scheduler(loads)
    ids = list(s.replicas)
    down = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=len(ids)))
    before = set(_where(s))
    result = s.shift_down_migration(down)
    assert set(_where(s)) == before
    assert not set(down) & set(s.replicas)
    aborted = set(result.aborted)
    assert {m.seq_id for m in result.moves} <= aborted
    assert all(m.src in down for m in result.moves)
    assert result.queued == len(s.queue)


def test_shift_down_moves_sequences_to_survivors():
    s = _scheduler([[1000] * 4, [1000] * 4, []])
    result = s.shift_down_migration(["r0"])
    assert sorted(result.aborted) == [0, 1, 2, 3]
    # ΔT of the empty r2 (0 -> 1 .. 3 -> 4 sequences) beats r1's 4 -> 5 every time
    assert result.moves == [Move(i, "r0", "r2") for i in range(4)]
    assert sorted(s.replicas["r1"].seqs) == [4, 5, 6, 7]
    assert sorted(s.replicas["r2"].seqs) == [0, 1, 2, 3] and not s.queue


def test_shift_up_moves_shortest_off_the_busiest_replica():
    lengths = [300, 5000, 4000, 3000, 2000, 1000, 900, 800] * 4
    s = _scheduler([lengths])
    before = s.aggregate_throughput()
    result = s.shift_up_migration([Replica("new", 120_000)])
    assert result.iterations > 0
    first = result.moves[0]
    assert (first.seq_id, first.src, first.dst) == (0, "r0", "new")  # shortest of r0
    assert s.aggregate_throughput() > before
    # it stopped because moving the shortest sequence off the now busiest replica to any
    # other replica would not raise aggregate throughput
    tp = M.throughput
    top = max(s.replicas.values(), key=lambda r: tp(r.n_seq, r.n_tok))
    seq = top.shortest()
    for other in s.replicas.values():
        if other is not top:
            gain = (tp(other.n_seq + 1, other.n_tok + seq.length) - tp(other.n_seq, other.n_tok)
                    + tp(top.n_seq - 1, top.n_tok - seq.length) - tp(top.n_seq, top.n_tok))
            assert gain <= 1e-9


def test_shift_up_skips_migration_while_the_queue_is_not_empty():
    s = _scheduler([[1000] * 10], queue=[9000] * 5, cap=20_000)
    result = s.shift_up_migration([Replica("new", 20_000)])
    assert len(s.queue) == 3 and result.iterations == 0
    assert {m.seq_id for m in result.moves} == {100_000, 100_001}


def test_migration_is_deterministic():
    rng = random.Random(3)
    loads = [[rng.randint(100, 4000) for _ in range(rng.randint(0, 40))] for _ in range(8)]
    runs = []
    for _ in range(2):
        s = _scheduler(loads, queue=[500, 700])
        res = s.shift_up_migration([Replica("u0", 120_000), Replica("u1", 120_000)])
        runs.append((res.moves, {rid: sorted(r.seqs) for rid, r in s.replicas.items()}))
    assert runs[0] == runs[1]


def test_counted_operations_within_o_i_n_plus_i_log_i():
    """Shift-down then shift-up over growing I and N: counted ΔT evaluations and heap
    operations stay under 2·(I·N + I·log2 I) + 4·N, and migrations under N."""
    rng = random.Random(0)
    for n_reps, per in ((8, 10), (32, 20), (64, 40), (128, 30)):
        counter = OpCounter()
        loads = [[rng.randint(100, 3000) for _ in range(rng.randint(per // 2, per * 3 // 2))]
                 for _ in range(n_reps)]
        s = _scheduler(loads, cap=10**7, counter=counter)
        n_seq = sum(r.n_seq for r in s.replicas.values())
        down = s.shift_down_migration([f"r{i}" for i in range(0, n_reps, 4)])
        s.shift_up_migration([Replica(f"u{i}", 10**7) for i in range(n_reps // 4)])
        bound = 2 * (n_reps * n_seq + n_reps * math.log2(n_reps)) + 4 * n_seq
        assert counter.total() <= bound, (n_reps, counter, bound)
        assert counter.migrations <= n_seq
        assert counter.dispatched >= len(down.aborted) > 0  # aborted ones were re-placed
